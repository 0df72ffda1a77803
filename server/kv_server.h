// A running kvcached: device, page pool, engine and the gRPC server around
// them (with health checking and reflection). main.cc wraps it in flags and
// signal handling; end-to-end tests start it on a loopback port.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/disk_budget.h"
#include "engine/engine.h"
#include "engine/lease_reaper.h"
#include "fleet/etcd_registration.h"
#include "fleet/kv_events.h"
#include "gpu/device_options.h"
#include "gpu/page_pool.h"
#include "metrics_exporter.h"
#include "prometheus/registry.h"
#include "service/grpc/rpc_observer.h"
#include "service/handlers.h"
#include "service/lane/lane_limits.h"
#include "service/request_log.h"
#include "service/tokens_file.h"
#include "transport_security.h"
#include "wire/lane/socket.h"

namespace grpc {
class Server;
class ServerBuilder;
}

namespace kvcache {
namespace service {
class DataLane;
class Handlers;
class KvCacheService;
class Peers;
class Tenants;
struct TenantParts;
}  // namespace service

struct ServerConfig {
  // host:port; port 0 picks a free one (see KvCacheServer::port()).
  std::string listen = "127.0.0.1:50051";
  gpu::DeviceOptions device;
  gpu::PoolOptions pool;
  engine::EngineOptions engine;
  // The largest message either side may send (gRPC's default is 4 MiB).
  uint64_t max_message_bytes = 64 << 20;
  // host:port of the data lane (service/lane/data_lane.h; port 0 picks a free
  // one); empty: no lane, Update and Fetch over gRPC only.
  std::string data_lane_listen;
  // host:port that Stats gives clients for the lane where they reach it at
  // another address than it listens on (a container's published port, a
  // NAT); empty: the address it listens on.
  std::string data_lane_advertise;
  // This replica's name in a fleet (protos/wire/ids/replica_id.h): every id it
  // makes begins with it, and GetStats gives it. Empty: ids without a name
  // (a single server).
  std::string replica_name;
  // How many lane connections may be open, and opening (TLS handshake,
  // preamble, AUTH where there are tenants), and for how long.
  service::LaneLimits lane_limits;
  // A peer that went away without closing (its host down, the network cut)
  // is found by pings (HTTP/2 PING on gRPC, TCP keepalive on the lane) and
  // dropped with its calls, freeing their quota, about keepalive.time +
  // keepalive.timeout after its last byte (lane::Keepalive). gRPC also ends
  // a connection whose sent bytes stay unacknowledged for keepalive.timeout
  // (its TCP_USER_TIMEOUT, 20 s by its own default too).
  lane::Keepalive keepalive;
  // A gRPC connection must finish its TLS handshake and send its HTTP/2
  // settings within this of its connect (gRPC's own default: 2 minutes).
  absl::Duration grpc_handshake_timeout = absl::Seconds(10);
  // The most calls one gRPC connection may have open at once (HTTP/2's
  // SETTINGS_MAX_CONCURRENT_STREAMS; gRPC's own default has no bound). A
  // client's calls past it wait for one of its others to end, so one
  // connection cannot make the server hold state for unbounded calls.
  uint32_t grpc_max_streams_per_connection = 1024;
  // How long and how many answers each tenant keeps for requests sent again
  // with the same request_id (service/request_log.h).
  service::RequestLogLimits request_log;
  // How often the lease reaper looks for leases that ran out (lease_reaper.h).
  absl::Duration lease_check_interval = absl::Milliseconds(250);
  // Where prompt-cache files are kept (engine/files/saved_files.h); empty: nowhere
  // (SaveSnapshot and LoadSnapshot refuse, Export/Import of snapshots work).
  std::string data_dir;
  // Most bytes kvcached may keep there, saved files and the disk tier's
  // evicted pages together; 0: no limit but the disk's. The disk tier (a
  // scratch file there, below host memory: pool.host_bytes) is on whenever
  // data_dir is set.
  uint64_t disk_bytes = 0;
  // Bearer tokens and the tenants they name (core/tokens_file.h); empty: one
  // anonymous tenant, and every call is admitted. Each tenant gets an engine
  // of its own over the shared pool, and its saved files go to
  // <data_dir>/tenants/<name>.
  std::string tokens_file;
  // TLS on the gRPC port and the data lane (transport_security.h); off
  // without a cert.
  TlsConfig tls;
  // Without TLS the data lane is plaintext: on a non-loopback address it
  // refuses to start unless this is set.
  bool allow_plaintext_lane = false;
  // host:port of the Prometheus endpoint (metrics_exporter.h; port 0 picks
  // a free one); empty: none.
  std::string metrics_listen;
  // A log line per gRPC call (service/grpc/rpc_observer.h); failures are logged
  // either way.
  bool access_log = false;
  // vLLM-style KV events of every tenant's prefix entries (kv_events.h); off
  // without an endpoint.
  KvEventsConfig kv_events;
  // Lists this replica in etcd for fleet clients (etcd_registration.h); off
  // without endpoints. It needs replica_name.
  etcd::EtcdOptions etcd;
  absl::Duration etcd_lease_ttl = absl::Seconds(10);
  // host:port clients reach the gRPC port at, as listed in etcd; empty: the
  // address it listens on, which must then name a host (not 0.0.0.0).
  std::string advertise_address;
  // The other replicas by name, "name=host:port,..." (fleet/peers.h), for
  // PullSnapshot; with etcd, names not listed here are looked up there.
  std::string peers;
  // PEM CA of the peers' certificates where it is not tls.client_ca_file.
  std::string peer_ca_file;
  // PEM client certificate and key this replica shows its peers; empty: its
  // server certificate, where the fleet runs mutual TLS.
  std::string peer_cert_file;
  std::string peer_key_file;
};

class KvCacheServer {
 public:
  static absl::StatusOr<std::unique_ptr<KvCacheServer>> Start(const ServerConfig& config);
  ~KvCacheServer();

  int port() const { return port_; }
  std::string address() const;
  // The data lane's host:port; empty when it is off.
  std::string data_lane_address() const;
  // What Stats names: data_lane_advertise, else data_lane_address.
  std::string advertised_lane_address() const;
  // Where KV events and their replays are published; empty when off.
  std::string kv_events_endpoint() const { return kv_events_ ? kv_events_->endpoint() : ""; }
  std::string kv_events_replay_endpoint() const {
    return kv_events_ ? kv_events_->replay_endpoint() : "";
  }
  // The Prometheus endpoint's host:port; empty when it is off.
  std::string metrics_address() const { return metrics_ ? metrics_->address() : ""; }
  // Null when the lane is off.
  service::DataLane* data_lane() { return data_lane_.get(); }
  // Stops accepting calls, lets in-flight ones finish until `grace` has passed,
  // then cancels the rest.
  void Shutdown(absl::Duration grace);
  void Wait();

  gpu::Device& device() { return *device_; }
  gpu::PagePool& pool() { return *pool_; }
  // The anonymous tenant's engine (without a tokens file).
  engine::Engine& engine();
  // Re-reads the tokens file (SIGHUP); a file that does not parse changes nothing.
  absl::Status ReloadTokens();
  // The CURVE subscribers that KV events admit from now on (SIGHUP, with
  // the re-read file; KvEventPublisher::ReplaceSubscribers).
  absl::Status ReplaceKvEventSubscribers(const std::vector<std::string>& keys);

 private:
  KvCacheServer() = default;
  // Start's steps, in its order; each leaves the server's state for the next.
  absl::Status OpenDevice(const gpu::DeviceOptions& options);
  // The engine's options, its data dir and tokens file, and the replica's
  // name at the front of every id it makes.
  absl::Status TakeEngineSettings(const ServerConfig& config);
  // The pool's options: with a data dir, the disk tier's file there (the
  // dir made if missing) under the budget the saved files share.
  absl::StatusOr<gpu::PoolOptions> OpenDataDir(const ServerConfig& config);
  absl::Status CreatePool(const gpu::PoolOptions& options, const engine::EngineOptions& engine);
  // The lane's socket where it may listen (before gRPC, so Stats can name
  // its port), and the address Stats gives for it.
  absl::Status OpenDataLane(const ServerConfig& config);
  void SetServiceOptions(const ServerConfig& config);
  // Before the tenants: each engine counts its blocks into the publisher.
  absl::Status StartKvEvents(const KvEventsConfig& config);
  // The service on config.listen, with health checking, reflection, the
  // calls' observer and the metrics endpoint.
  absl::Status StartGrpcServer(const ServerConfig& config);
  void ServeDataLane(const TlsConfig& tls);
  // This replica's listing in etcd, where the config names etcd.
  absl::Status ListInEtcd(const ServerConfig& config);
  void LogListening(const TlsConfig& tls) const;
  // An engine, its lease reaper, saved files and handlers for a tenant
  // (null: the anonymous one).
  absl::StatusOr<service::TenantParts> MakeTenant(const TenantConfig* tenant);
  // The RPC observer's interceptor on `builder`, and the metrics endpoint
  // when `listen` is set.
  absl::Status ObserveCalls(const std::string& listen, bool access_log,
                            grpc::ServerBuilder& builder);
  absl::Status StartTenants();
  // peers_ where the config names any (a list, or etcd).
  absl::Status StartPeers(const ServerConfig& config);
  // Evicts idle snapshots of any tenant (tiering.h, EvictElsewhere).
  uint32_t EvictAnyTenant(uint32_t pages);

  std::string host_;
  int port_ = 0;
  std::string lane_host_;
  std::string lane_advertise_;
  std::unique_ptr<gpu::Device> device_;
  std::unique_ptr<DiskBudget> disk_budget_;  // null without a data dir
  std::unique_ptr<gpu::PagePool> pool_;
  // The pool account of the next tenant made (each has its own; 0 is the pool's).
  gpu::AccountId next_account_ = 1;
  std::string data_dir_;
  std::string tokens_file_;
  engine::EngineOptions engine_options_;
  service::ServiceOptions service_options_;
  absl::Duration lease_check_interval_;
  // Request ids, logs, RPC counts and latencies; the gRPC server's
  // interceptor refers to them, so they are declared before it.
  std::shared_ptr<prometheus::Registry> metrics_registry_;
  std::unique_ptr<service::RpcObserver> rpc_observer_;
  // Every tenant's prefix index counts its blocks into its ledger: declared
  // before tenants_, so it outlives them.
  std::unique_ptr<KvEventPublisher> kv_events_;
  // Each tenant's engine and handlers; declared after the pool and before
  // the gRPC server and the lane, which stop before it goes.
  std::unique_ptr<service::Tenants> tenants_;
  // Refers to tenants_ and data_lane_; the destructor stops it first, so no
  // scrape reads them while they go.
  std::unique_ptr<MetricsExporter> metrics_;
  // Before service_ (destroyed after it and the server): lookups in flight
  // hold calls that the server's shutdown waits for.
  std::unique_ptr<service::Peers> peers_;
  std::unique_ptr<service::KvCacheService> service_;
  std::unique_ptr<grpc::Server> server_;
  // Declared last: it stops, and its sessions end, before the handlers go.
  std::unique_ptr<service::DataLane> data_lane_;
  // Lists the replica only while all above serve; withdrawn first.
  std::unique_ptr<EtcdRegistration> etcd_;
};

}  // namespace kvcache
