// kvcached: the KV-cache service. Flags configure the device, the pool and the
// listening address; SIGTERM or SIGINT stops it gracefully (exit 0).
#include <malloc.h>

#include <csignal>
#include <cstdio>
#include <limits>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "gpu/device.h"
#include "kv_server.h"
#include "wire/curve/curve_keys.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "address to listen on (host:port)");
ABSL_FLAG(std::string, data_lane_listen, "127.0.0.1:50052",
          "address of the data lane, Update and Fetch over plain TCP for bulk K/V (host:port; "
          "empty: off)");
ABSL_FLAG(std::string, data_lane_advertise, "",
          "host:port clients are told to reach the data lane at, where it differs from "
          "--data_lane_listen (a container's published port, a NAT); empty: that address");
ABSL_FLAG(int32_t, lane_max_connections, 1024,
          "most data-lane connections held at once (each holds a thread); past it a new one "
          "cuts the connection opening longest, or is refused where all have opened");
ABSL_FLAG(int32_t, lane_max_opening, 64,
          "most data-lane connections still opening (TLS handshake, preamble, AUTH) at once; a "
          "new one past it cuts the one opening longest, so peers that never authenticate "
          "hold at most this many of the lane's connections");
ABSL_FLAG(absl::Duration, lane_opening_timeout, absl::Seconds(10),
          "how long a data-lane connection may take to open before it is cut");
ABSL_FLAG(absl::Duration, keepalive_time, absl::Seconds(30),
          "a gRPC or data-lane connection silent this long is pinged (HTTP/2 PING, TCP "
          "keepalive), so a worker whose host went away is dropped with its calls and their "
          "quota; past --keepalive_timeout with no answer it is closed");
ABSL_FLAG(absl::Duration, keepalive_timeout, absl::Seconds(20),
          "how long a ping waits for its answer before the connection is closed (at most "
          "32767s). Bytes sent and unacknowledged (or a peer's shut receive window) end a "
          "connection too: on gRPC after this long, on the lane after --keepalive_time plus "
          "this");
ABSL_FLAG(absl::Duration, grpc_handshake_timeout, absl::Seconds(10),
          "how long a gRPC connection may take for its TLS handshake and HTTP/2 settings");
ABSL_FLAG(uint32_t, grpc_max_streams_per_connection, 1024,
          "the most calls one gRPC connection may have open at once; its further calls wait");
ABSL_FLAG(std::string, replica_name, "",
          "this replica's name in a fleet (1-63 letters, digits, '-', '_', '.'; a StatefulSet "
          "pod's name): every id it makes begins with \"NAME:\", so clients of many replicas "
          "send each call to its owner; empty: a single server");
ABSL_FLAG(std::string, device, "",
          "Vulkan device: empty picks the best (discrete, integrated, CPU); a number picks by "
          "index; other text picks the first device whose name contains it");
ABSL_FLAG(bool, list_devices, false, "print the Vulkan devices and exit");
ABSL_FLAG(uint64_t, pool_bytes, uint64_t{1} << 30, "device memory budget of the page pool");
ABSL_FLAG(uint64_t, page_bytes, 64 << 10,
          "bytes per pool page; a page holds as many tokens of one layer (all rows, heads, K and V) as fit");
ABSL_FLAG(uint32_t, page_tokens, 256, "most tokens per page");
ABSL_FLAG(uint64_t, max_message_bytes, 64 << 20, "largest gRPC message either side may send");
ABSL_FLAG(uint64_t, max_update_tokens, 1 << 16, "most tokens one Update message may carry");
ABSL_FLAG(bool, force_staging, false,
          "use staging buffers and transfer commands even where device memory is host-visible");
ABSL_FLAG(std::string, quantize_kernel, "auto",
          "where quantized layers are packed: auto (native CPU kernels on a CPU device such as "
          "lavapipe, compute shaders elsewhere), shader, or host (CPU kernels; direct path only)");
ABSL_FLAG(bool, validation, false, "enable the Vulkan validation layer (debugging)");
ABSL_FLAG(absl::Duration, default_ttl, absl::ZeroDuration(),
          "lease of caches and snapshots created without a ttl_seconds: deleted once no call "
          "has named them for this long (e.g. 10m); 0 = no lease");
ABSL_FLAG(uint64_t, max_pinned_bytes, 0,
          "most bytes pinned snapshots may hold (pinning past it is RESOURCE_EXHAUSTED); "
          "0 = no limit");
ABSL_FLAG(std::string, data_dir, "",
          "where prompt-cache files (mlx-lm safetensors) are saved and loaded; listed at start. "
          "Empty: no files (SaveSnapshot and LoadSnapshot refuse)");
ABSL_FLAG(uint64_t, disk_bytes, 0,
          "most bytes kvcached may keep in --data_dir: saved files and the disk tier's evicted "
          "pages together; 0 = no limit but the disk (the tier then holds at most 8x "
          "--pool_bytes + --host_bytes)");
ABSL_FLAG(uint64_t, host_bytes, 0,
          "host memory for pages evicted from the device when it is full (snapshot pages no "
          "cache holds, least recently used first); past it they go on to a file in "
          "--data_dir. 0 = no host tier");
ABSL_FLAG(uint64_t, metadata_bytes, 0,
          "most host memory caches and snapshots may hold outside the pool (page tables, layer "
          "objects, ids); past it a new cache or snapshot is RESOURCE_EXHAUSTED. "
          "0 = an eighth of --pool_bytes, at least 64 MiB");
ABSL_FLAG(absl::Duration, request_log_window, absl::Minutes(10),
          "how long the answer to a request with a request_id is kept, so the same request "
          "sent again (a client's retry) is answered without being run twice");
ABSL_FLAG(uint64_t, request_log_bytes, 8 << 20,
          "most bytes of kept answers per tenant (oldest dropped first)");
ABSL_FLAG(absl::Duration, lease_check_interval, absl::Milliseconds(250),
          "how often expired leases are looked for");
ABSL_FLAG(std::string, tokens_file, "",
          "bearer tokens and their tenants, one per line: tenant=NAME token=SECRET (or "
          "sha256=HEX) [admin] [max_pinned_bytes=N] [max_metadata_bytes=N] "
          "[max_requests_in_flight=N] [max_lane_connections=N]; re-read on SIGHUP. "
          "Empty: one anonymous tenant, every call admitted");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: gRPC and the data lane run TLS (empty: plaintext)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: mutual TLS, clients must present a certificate it signed");
ABSL_FLAG(bool, allow_plaintext_lane, false,
          "let a plaintext data lane (no --tls_cert) listen on a non-loopback address");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port of a Prometheus endpoint (GET /metrics); empty: none. It shows tenant "
          "names and counts, never tokens, ids or data");
ABSL_FLAG(std::string, kv_events_endpoint, "",
          "publish which prefix blocks this replica stores and drops as vLLM's KV events "
          "(BlockStored, BlockRemoved, AllBlocksCleared; msgpack over a ZMQ PUB socket bound "
          "here, e.g. tcp://127.0.0.1:5557) for KV-aware routers (Dynamo, llm-d); empty: none. "
          "They carry prompts' token ids");
ABSL_FLAG(std::string, kv_events_replay_endpoint, "",
          "ZMQ ROUTER endpoint answering replay requests for missed KV event batches "
          "(e.g. tcp://127.0.0.1:5558); empty: none");
ABSL_FLAG(std::string, kv_events_topic, "", "ZMQ topic of every KV event batch");
ABSL_FLAG(uint32_t, kv_events_block_size, 16,
          "tokens per block in KV events (the router's vLLM --block-size)");
ABSL_FLAG(std::string, kv_events_format, "map",
          "map (events as named-field maps: vLLM since mid 2026) or array (positional: "
          "older vLLM)");
ABSL_FLAG(bool, kv_events_allow_remote, false,
          "let the KV event endpoints bind a non-loopback address");
ABSL_FLAG(std::string, kv_events_curve_key_file, "",
          "a file holding the KV event publisher's CURVE secret key (Z85, as `kvcachectl "
          "curve-keypair` or libzmq's curve_keygen make it; mode 600): both KV event sockets "
          "then speak CurveZMQ, encrypted, and admit only the subscribers that "
          "--kv_events_curve_subscribers_file lists. Its public key is logged at start");
ABSL_FLAG(std::string, kv_events_curve_subscribers_file, "",
          "the CURVE public keys (Z85, one per line, # comments) of the routers admitted to "
          "the KV event sockets; re-read on SIGHUP (a key taken off loses its connection)");
ABSL_FLAG(std::string, etcd_endpoints, "",
          "list this replica in etcd for fleet clients (kvcachectl --etcd_endpoints): "
          "comma-separated host:port, http:// or https:// endpoints; empty: not listed. "
          "Needs --replica_name");
ABSL_FLAG(std::string, etcd_prefix, "/kvcached/replicas/",
          "the key prefix replicas are listed under (the key is it plus --replica_name)");
ABSL_FLAG(absl::Duration, etcd_lease_ttl, absl::Seconds(10),
          "how long the listing outlives the replica's last keep-alive (at least 2s)");
ABSL_FLAG(std::string, etcd_ca, "", "PEM CA of etcd's certificate: TLS to etcd");
ABSL_FLAG(std::string, etcd_cert, "", "PEM client certificate for etcd (its --client-cert-auth)");
ABSL_FLAG(std::string, etcd_key, "", "PEM private key of --etcd_cert");
ABSL_FLAG(std::string, advertise_address, "",
          "host:port that clients reach the gRPC port at, as listed in etcd (a pod's IP); "
          "empty: the --listen address, which must then name a host");
ABSL_FLAG(std::string, peers, "",
          "the fleet's other replicas, name=host:port,... : where PullSnapshot reads a "
          "snapshot another replica made (with --etcd_endpoints, names not listed here are "
          "found in etcd's list, which the replica watches)");
ABSL_FLAG(std::string, peer_ca, "",
          "PEM CA of the peers' certificates (default: --tls_client_ca; else the system's)");
ABSL_FLAG(std::string, peer_cert, "",
          "PEM client certificate shown to peers (default: --tls_cert, where the fleet runs "
          "mutual TLS); with --peer_key");
ABSL_FLAG(std::string, peer_key, "", "PEM private key of --peer_cert");
ABSL_FLAG(bool, access_log, false,
          "log a line per gRPC call (request id, method, code, duration, peer)");
ABSL_FLAG(std::string, log_format, "text",
          "text (one line per event, fields as key=value) or json (one object per line)");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(10),
          "how long in-flight calls may run after SIGTERM/SIGINT");

namespace {

absl::StatusOr<kvcache::gpu::QuantKernel> QuantKernelFromFlag(const std::string& name) {
  if (name == "auto") return kvcache::gpu::QuantKernel::kAuto;
  if (name == "shader") return kvcache::gpu::QuantKernel::kShader;
  if (name == "host") return kvcache::gpu::QuantKernel::kHost;
  return absl::InvalidArgumentError(
      absl::StrCat("--quantize_kernel: \"", name, "\" is not auto, shader or host"));
}

// The KV event sockets' CURVE key and subscribers, from the files given
// (KvEventPublisher::Start refuses one without the other).
absl::Status ReadKvEventKeys(kvcache::KvEventsConfig& config) {
  const std::string key_file = absl::GetFlag(FLAGS_kv_events_curve_key_file);
  const std::string subscribers_file = absl::GetFlag(FLAGS_kv_events_curve_subscribers_file);
  if (key_file.empty() && subscribers_file.empty()) return absl::OkStatus();
  if (config.endpoint.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        key_file.empty() ? "--kv_events_curve_subscribers_file" : "--kv_events_curve_key_file",
        ": KV events are off (no --kv_events_endpoint)"));
  }
  if (!subscribers_file.empty()) {
    ASSIGN_OR_RETURN(
        config.curve_subscribers,
        kvcache::curve::ReadPublicKeysFile(subscribers_file, "--kv_events_curve_subscribers_file"));
  }
  if (key_file.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const kvcache::curve::KeyPair pair,
                   kvcache::curve::ReadSecretKeyFile(key_file, "--kv_events_curve_key_file"));
  config.curve_secret_key = pair.secret_key;
  kvcache::LogInfo("kv events: CURVE on, publisher key %s, %d subscriber keys admitted",
                   pair.public_key, config.curve_subscribers.size());
  return absl::OkStatus();
}

// Routers' keys are added and revoked without a restart, as tokens are.
absl::Status ReloadKvEventSubscribers(kvcache::KvCacheServer& server) {
  const std::string file = absl::GetFlag(FLAGS_kv_events_curve_subscribers_file);
  if (file.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::vector<std::string> keys,
                   kvcache::curve::ReadPublicKeysFile(file, "--kv_events_curve_subscribers_file"));
  return server.ReplaceKvEventSubscribers(keys);
}

absl::StatusOr<kvcache::ServerConfig> ConfigFromFlags() {
  kvcache::ServerConfig config;
  config.listen = absl::GetFlag(FLAGS_listen);
  config.data_lane_listen = absl::GetFlag(FLAGS_data_lane_listen);
  config.data_lane_advertise = absl::GetFlag(FLAGS_data_lane_advertise);
  config.lane_limits = {.max_connections = absl::GetFlag(FLAGS_lane_max_connections),
                        .max_opening = absl::GetFlag(FLAGS_lane_max_opening),
                        .opening_timeout = absl::GetFlag(FLAGS_lane_opening_timeout)};
  config.keepalive = {.time = absl::GetFlag(FLAGS_keepalive_time),
                      .timeout = absl::GetFlag(FLAGS_keepalive_timeout)};
  config.grpc_handshake_timeout = absl::GetFlag(FLAGS_grpc_handshake_timeout);
  config.grpc_max_streams_per_connection = absl::GetFlag(FLAGS_grpc_max_streams_per_connection);
  config.replica_name = absl::GetFlag(FLAGS_replica_name);
  config.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  config.access_log = absl::GetFlag(FLAGS_access_log);
  config.device.selector = absl::GetFlag(FLAGS_device);
  config.device.force_staging = absl::GetFlag(FLAGS_force_staging);
  config.device.enable_validation = absl::GetFlag(FLAGS_validation);
  config.pool.budget_bytes = absl::GetFlag(FLAGS_pool_bytes);
  config.pool.page_bytes = absl::GetFlag(FLAGS_page_bytes);
  config.pool.host_bytes = absl::GetFlag(FLAGS_host_bytes);
  config.engine.page_tokens = absl::GetFlag(FLAGS_page_tokens);
  config.engine.max_update_tokens = absl::GetFlag(FLAGS_max_update_tokens);
  config.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  config.engine.default_ttl = absl::GetFlag(FLAGS_default_ttl);
  config.engine.max_pinned_bytes = absl::GetFlag(FLAGS_max_pinned_bytes);
  config.data_dir = absl::GetFlag(FLAGS_data_dir);
  config.disk_bytes = absl::GetFlag(FLAGS_disk_bytes);
  config.engine.metadata_bytes = absl::GetFlag(FLAGS_metadata_bytes);
  config.lease_check_interval = absl::GetFlag(FLAGS_lease_check_interval);
  config.request_log = {.window = absl::GetFlag(FLAGS_request_log_window),
                        .max_bytes = absl::GetFlag(FLAGS_request_log_bytes)};
  config.tokens_file = absl::GetFlag(FLAGS_tokens_file);
  config.tls = {.cert_file = absl::GetFlag(FLAGS_tls_cert),
                .key_file = absl::GetFlag(FLAGS_tls_key),
                .client_ca_file = absl::GetFlag(FLAGS_tls_client_ca)};
  config.allow_plaintext_lane = absl::GetFlag(FLAGS_allow_plaintext_lane);
  config.kv_events = {.endpoint = absl::GetFlag(FLAGS_kv_events_endpoint),
                      .replay_endpoint = absl::GetFlag(FLAGS_kv_events_replay_endpoint),
                      .topic = absl::GetFlag(FLAGS_kv_events_topic),
                      .block_tokens = absl::GetFlag(FLAGS_kv_events_block_size),
                      .allow_remote = absl::GetFlag(FLAGS_kv_events_allow_remote)};
  config.etcd = {.endpoints = absl::GetFlag(FLAGS_etcd_endpoints),
                 .prefix = absl::GetFlag(FLAGS_etcd_prefix),
                 .ca_file = absl::GetFlag(FLAGS_etcd_ca),
                 .cert_file = absl::GetFlag(FLAGS_etcd_cert),
                 .key_file = absl::GetFlag(FLAGS_etcd_key)};
  config.etcd_lease_ttl = absl::GetFlag(FLAGS_etcd_lease_ttl);
  config.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  config.peers = absl::GetFlag(FLAGS_peers);
  config.peer_ca_file = absl::GetFlag(FLAGS_peer_ca);
  config.peer_cert_file = absl::GetFlag(FLAGS_peer_cert);
  config.peer_key_file = absl::GetFlag(FLAGS_peer_key);
  RETURN_IF_ERROR(ReadKvEventKeys(config.kv_events));
  const std::string kv_events_format = absl::GetFlag(FLAGS_kv_events_format);
  if (kv_events_format != "map" && kv_events_format != "array") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_events_format: \"", kv_events_format.substr(0, 16), "\" is neither map nor array"));
  }
  config.kv_events.format =
      kv_events_format == "map" ? kvcache::KvEventFormat::kMap : kvcache::KvEventFormat::kArray;
  if (config.engine.default_ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--default_ttl: must not be negative");
  }
  // What ttl_seconds can carry; a lease past it (or "inf") would show wrong.
  if (config.engine.default_ttl > absl::Seconds(std::numeric_limits<uint32_t>::max())) {
    return absl::InvalidArgumentError(
        "--default_ttl: at most 4294967295s (ttl_seconds' range); 0 means no lease");
  }
  if (config.lease_check_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--lease_check_interval: must be positive");
  }
  ASSIGN_OR_RETURN(config.pool.quantize_kernel,
                   QuantKernelFromFlag(absl::GetFlag(FLAGS_quantize_kernel)));
  return config;
}

int ListDevices() {
  auto devices = kvcache::gpu::Device::List();
  if (!devices.ok()) {
    kvcache::LogError("%s", devices.status().ToString());
    return 1;
  }
  for (const auto& device : *devices) {
    std::printf("%u: %s (%s)\n", device.index, device.name.c_str(), device.type.c_str());
  }
  return 0;
}

// gRPC allocates a fresh buffer per socket read and per message, up to a few
// MiB each. glibc serves those from mmap, or hands freed heap tops back to the
// kernel, so every message paid page faults and munmap/madvise (in perf, the
// largest cost after the copies themselves). Keeping them in the heap for
// reuse roughly doubled Update throughput at 64 KiB (bench/RESULTS.md).
void KeepMessageBuffersInHeap() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);   // glibc's largest allowed
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("kvcached: GPU-resident KV-cache pools and snapshots over gRPC");
  absl::ParseCommandLine(argc, argv);
  const std::string log_format = absl::GetFlag(FLAGS_log_format);
  if (log_format != "text" && log_format != "json") {
    std::fprintf(stderr, "kvcached: --log_format: \"%s\" is neither text nor json\n",
                 log_format.c_str());
    return 2;
  }
  kvcache::SetLogFormat(log_format == "json" ? kvcache::LogFormat::kJson
                                             : kvcache::LogFormat::kText);
  // Debian's abseil is built with lock-order (deadlock) detection on, which
  // tracks every acquisition in a graph: a fifth of the engine's time on
  // snapshot-heavy work (bench/RESULTS.md). The tests keep it on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (absl::GetFlag(FLAGS_list_devices)) return ListDevices();
  KeepMessageBuffersInHeap();

  // Block the stop signals (and SIGHUP, which re-reads the tokens file and the KV
  // event subscribers) in
  // every thread (gRPC's too); main waits for them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::StatusOr<kvcache::ServerConfig> config = ConfigFromFlags();
  if (!config.ok()) {
    kvcache::LogError("%s", config.status().ToString());
    return 2;
  }
  auto server = kvcache::KvCacheServer::Start(*config);
  if (!server.ok()) {
    kvcache::LogError("cannot start: %s", server.status().ToString());
    return 1;
  }
  int signal_number = 0;
  while (sigwait(&stop_signals, &signal_number) == 0 && signal_number == SIGHUP) {
    // Connections and calls under way stay; the next call sees the new file.
    if (absl::Status reloaded = (*server)->ReloadTokens(); !reloaded.ok()) {
      kvcache::LogError("SIGHUP: tokens file kept as it was: %s", reloaded.ToString());
    }
    if (absl::Status reloaded = ReloadKvEventSubscribers(**server); !reloaded.ok()) {
      kvcache::LogError("SIGHUP: KV event subscribers kept as they were: %s", reloaded.ToString());
    }
  }
  const absl::Duration grace = absl::GetFlag(FLAGS_shutdown_grace);
  kvcache::LogInfo("%s: stopping (in-flight calls get %s)", strsignal(signal_number),
                   absl::FormatDuration(grace));
  (*server)->Shutdown(grace);
  (*server)->Wait();
  kvcache::LogInfo("stopped");
  return 0;
}
