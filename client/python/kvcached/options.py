"""How a Client connects: kvcache::ClientOptions (client/kvcache_client.h) in Python."""

from dataclasses import dataclass
from typing import Optional, Union

# PEM text, as str or bytes (not a path: the C++ client takes the texts too).
Pem = Union[str, bytes]


@dataclass
class ClientOptions:
    """Where the server is, how calls are authenticated, and their limits.

    address: the gRPC target, host:port.
    deadline: seconds each unary call, and each whole update or fetch, may take.
    max_message_bytes: gRPC's message limit on both sides (kvcached's default too).
    dedicated_connection: a TCP connection of this client's own; by default
        grpc shares one between channels of the same target and options.
    data_lane: where update and fetch go. "": gRPC. "auto": the server's data
        lane (Stats.data_lane_address) if it has one that answers, else gRPC.
        host:port: that lane, with no fallback. Every other call is gRPC.
        (The C++ client's default is ""; this package exists to move tensors
        without copies, which the lane does best, so it asks for "auto".)
    token: a bearer token (kvcached --tokens_file), sent as `authorization:
        Bearer <token>` with every gRPC call and in each lane connection's
        AUTH frame. Empty: none.
    replica: sent as `x-kvcache-replica` metadata, for a proxy in front of a fleet.
    tls: TLS on gRPC (grpcio's) and on the lane (Python's ssl, TLS 1.3).
        tls_root_certs_pem empty trusts the system's CAs; a client
        certificate and key are for mutual TLS; tls_server_name overrides the
        name checked against the server's certificate (default: the host).
    max_reconnect_backoff: the longest wait between reconnects, seconds (0: grpc's).
    first_connect_wait: until the channel has connected once, each call first
        waits up to this long for the connection (a worker started beside its
        server). 0: calls fail fast from the start.
    keepalive_time, keepalive_timeout: HTTP/2 pings on gRPC and TCP
        keepalive on the lane after this much silence, dropped when no answer
        comes within the timeout (seconds; 0: none).
    """

    address: str = "127.0.0.1:50051"
    deadline: float = 60.0
    max_message_bytes: int = 64 << 20
    dedicated_connection: bool = False
    data_lane: str = "auto"
    token: str = ""
    replica: str = ""
    tls: bool = False
    tls_root_certs_pem: Optional[Pem] = None
    tls_client_cert_pem: Optional[Pem] = None
    tls_client_key_pem: Optional[Pem] = None
    tls_server_name: str = ""
    max_reconnect_backoff: float = 0.0
    first_connect_wait: float = 3.0
    keepalive_time: float = 30.0
    keepalive_timeout: float = 20.0


def pem_bytes(pem: Optional[Pem]) -> Optional[bytes]:
    """PEM text as bytes; None (or empty) stays None."""
    if not pem:
        return None
    return pem.encode("ascii") if isinstance(pem, str) else bytes(pem)
