"""The gRPC channel a Client calls on, set up as the C++ client sets up its own.

Unary calls and Fetch are retried by gRPC on UNAVAILABLE (its retry policy in
the service config): reads, and calls whose request carries a request_id, which
the server answers once however often it arrives (kvcache.proto, "Retries").
Update, ImportSnapshot and EvictSnapshots are never retried by gRPC.
"""

import json
from typing import List, Tuple

import grpc

from .options import ClientOptions, pem_bytes

SERVICE = "kvcache.v1.KvCacheService"

# The methods gRPC may send again on UNAVAILABLE (client/retry_policy.cc's list).
RETRIED_METHODS = (
    "CreateCache", "GetCache", "ListCaches", "DeleteCache", "Trim", "Snapshot", "Restore",
    "MergeSnapshots", "SplitSnapshot", "ReleaseSnapshot", "ListSnapshots", "ExtractRow",
    "FilterRows", "MergeCaches", "ExtendCache", "BeginSpeculation", "CommitSpeculation",
    "AbortSpeculation", "GetStats", "RenewLease", "SetPinned", "SaveSnapshot", "LoadSnapshot",
    "ListSaved", "DeleteSaved", "PublishPrefix", "LookupPrefix", "ListPrefixes", "PullSnapshot",
    "Fetch", "ExportSnapshot",
)

# Four attempts in all, 50 ms doubling up to 1 s between them, as the C++ client.
MAX_ATTEMPTS = 4
INITIAL_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
BACKOFF_MULTIPLIER = 2

REPLICA_HEADER = "x-kvcache-replica"


def retry_service_config() -> str:
    """The channel's service config: RETRIED_METHODS under the retry policy."""
    policy = {"maxAttempts": MAX_ATTEMPTS, "initialBackoff": "%gs" % INITIAL_BACKOFF_S,
              "maxBackoff": "%gs" % MAX_BACKOFF_S, "backoffMultiplier": BACKOFF_MULTIPLIER,
              "retryableStatusCodes": ["UNAVAILABLE"]}
    names = [{"service": SERVICE, "method": method} for method in RETRIED_METHODS]
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})


def channel_arguments(options: ClientOptions) -> List[Tuple[str, object]]:
    """grpc channel arguments for `options`."""
    args: List[Tuple[str, object]] = [
        ("grpc.max_send_message_length", options.max_message_bytes),
        ("grpc.max_receive_message_length", options.max_message_bytes),
        ("grpc.service_config", retry_service_config()),
        ("grpc.enable_retries", 1),
    ]
    if options.dedicated_connection:
        args.append(("grpc.use_local_subchannel_pool", 1))
    if options.keepalive_time > 0:
        # Pings on idle channels too, without end (grpc stops after two otherwise).
        args += [("grpc.keepalive_time_ms", int(options.keepalive_time * 1000)),
                 ("grpc.keepalive_timeout_ms", int(options.keepalive_timeout * 1000)),
                 ("grpc.keepalive_permit_without_calls", 1),
                 ("grpc.http2.max_pings_without_data", 0)]
    if options.max_reconnect_backoff > 0:
        ms = int(options.max_reconnect_backoff * 1000)
        args += [("grpc.max_reconnect_backoff_ms", ms),
                 ("grpc.initial_reconnect_backoff_ms", min(ms, 1000)),
                 ("grpc.min_reconnect_backoff_ms", min(ms, 1000))]
    if options.tls and options.tls_server_name:
        args.append(("grpc.ssl_target_name_override", options.tls_server_name))
    return args


def make_channel(options: ClientOptions) -> grpc.Channel:
    """A channel to options.address, TLS or plaintext as the options say."""
    args = channel_arguments(options)
    if not options.tls:
        return grpc.insecure_channel(options.address, options=args)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pem_bytes(options.tls_root_certs_pem),
        private_key=pem_bytes(options.tls_client_key_pem),
        certificate_chain=pem_bytes(options.tls_client_cert_pem))
    return grpc.secure_channel(options.address, credentials, options=args)


def call_metadata(options: ClientOptions) -> Tuple[Tuple[str, str], ...]:
    """Metadata every call carries: the bearer token and the replica, where set.

    Sent as plain metadata rather than call credentials, which grpc sends only
    over TLS: the token must reach a plaintext loopback server too."""
    metadata = []
    if options.token:
        metadata.append(("authorization", "Bearer " + options.token))
    if options.replica:
        metadata.append((REPLICA_HEADER, options.replica))
    return tuple(metadata)
