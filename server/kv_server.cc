#include "kv_server.h"

#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "fleet/peers.h"
#include "gpu/device.h"
#include "gpu/quant_kernels.h"
#include "service/grpc/kv_cache_service.h"
#include "service/handlers.h"
#include "service/lane/data_lane.h"
#include "service/tenants.h"
#include "state_metrics.h"
#include "wire/ids/replica_id.h"
#include "wire/net/address.h"

namespace kvcache {
namespace {

// The disk tier's scratch file in the data dir: not a saved file (those end
// in .safetensors), so the saved-file index leaves it alone.
constexpr char kDiskTierFile[] = "kvcached-evicted-pages.tier";

// The disk tier's size when disk_bytes sets none: what the data dir's file
// system has free now, but at most kUnboundedDiskTierShare times the tiers
// above it (the pool keeps 16 bytes of bookkeeping per page of every tier).
constexpr uint64_t kUnboundedDiskTierShare = 8;

absl::StatusOr<uint64_t> DefaultDiskTierBytes(const std::string& data_dir,
                                              const gpu::PoolOptions& pool) {
  struct statvfs fs;
  if (::statvfs(data_dir.c_str(), &fs) != 0) {
    return absl::InternalError(absl::StrCat("data_dir ", data_dir, ": statvfs: ", strerror(errno)));
  }
  return std::min<uint64_t>(uint64_t{fs.f_bavail} * fs.f_frsize,
                            kUnboundedDiskTierShare * (pool.budget_bytes + pool.host_bytes));
}

// What one tenant's calls run on, in the order it must go: handlers, then
// the reaper (which calls into the engine), then the engine, then its files.
struct TenantRuntime {
  // The tenant's view of the pool, charging its pages to its account.
  std::unique_ptr<gpu::PagePool> pool;
  std::unique_ptr<engine::SavedFileStore> saved_files;
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<engine::LeaseReaper> lease_reaper;
  std::unique_ptr<service::Handlers> handlers;
  ~TenantRuntime() {
    handlers.reset();
    lease_reaper.reset();
    engine.reset();
    saved_files.reset();
    pool.reset();
  }
};

// Whether the data lane listens: with TLS always (it runs TLS too); in
// plaintext on loopback, or beyond it where allowed explicitly.
absl::StatusOr<bool> LaneMayListen(const ServerConfig& config) {
  if (config.data_lane_listen.empty()) return false;
  ASSIGN_OR_RETURN(const net::HostPort lane, net::ParseHostPort(config.data_lane_listen,
                                                                "data_lane_listen",
                                                                net::AddressUse::kListen));
  if (config.tls.enabled()) return true;
  const bool loopback = net::IsLoopbackHost(lane.host);
  if (config.allow_plaintext_lane) {
    if (!loopback) {
      LogWarning("data lane on %s carries K/V and tokens in plaintext (--allow_plaintext_lane)",
                 config.data_lane_listen);
    }
    return true;
  }
  if (!loopback) {
    return absl::InvalidArgumentError(absl::StrCat("data_lane_listen: \"", lane.host,
                                                   "\" is not a loopback address and the lane is "
                                                   "plaintext; --allow_plaintext_lane allows it"));
  }
  return true;
}

// A tenant's tier quotas in whole pages; INVALID_ARGUMENT for one under a page,
// which would read as no limit.
absl::StatusOr<gpu::AccountLimits> TierLimits(const TenantQuotas& quotas, uint64_t page_bytes) {
  gpu::AccountLimits limits;
  const struct {
    uint64_t TenantQuotas::*quota;
    uint32_t& pages;
  } tiers[] = {{&TenantQuotas::max_device_bytes, limits.device_pages},
               {&TenantQuotas::max_host_bytes, limits.host_pages},
               {&TenantQuotas::max_disk_bytes, limits.disk_pages}};
  for (const auto& tier : tiers) {
    const uint64_t bytes = quotas.*tier.quota;
    if (bytes == 0) continue;
    if (bytes < page_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(TenantQuotaName(tier.quota), " ", bytes,
                                                     " is less than one page (page_bytes ",
                                                     page_bytes, ")"));
    }
    tier.pages = static_cast<uint32_t>(std::min<uint64_t>(bytes / page_bytes, UINT32_MAX));
  }
  return limits;
}

int Milliseconds(absl::Duration duration) {
  return static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(duration), 1, INT32_MAX));
}

// Pings on every connection, idle ones too, so that a worker that vanished
// mid-stream ends its calls (and frees its tenant's in-flight quota) in
// seconds; and a bound on the handshake, so that connections that never
// speak do not hold the port's memory for gRPC's two minutes.
absl::Status SetConnectionLiveness(const ServerConfig& config, grpc::ServerBuilder& builder) {
  RETURN_IF_ERROR(config.keepalive.Validate());
  if (config.grpc_handshake_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("grpc_handshake_timeout: must be positive");
  }
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, Milliseconds(config.keepalive.time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             Milliseconds(config.keepalive.timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // gRPC stops pinging after two pings with no data between; 0: never stops.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Clients that ping their server as often as it pings them are welcome
  // (gRPC's default sends GOAWAY to clients pinging more than every 5 min).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             Milliseconds(std::min(config.keepalive.time, absl::Seconds(10))));
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             Milliseconds(config.grpc_handshake_timeout));
  return absl::OkStatus();
}

absl::Status SetConnectionLimits(const ServerConfig& config, grpc::ServerBuilder& builder) {
  const uint32_t streams = config.grpc_max_streams_per_connection;
  if (streams < 1 || streams > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("grpc_max_streams_per_connection: ", streams, " is not from 1 to ", INT32_MAX));
  }
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, static_cast<int>(streams));
  return absl::OkStatus();
}

// What the pool holds and how long handles last by default, said once at start.
void LogCapacity(const gpu::PagePool& pool_of_pages, const engine::EngineOptions& engine) {
  const gpu::PoolStats pool = pool_of_pages.stats();
  LogInfo("pool: %d pages of %d KiB (%d MiB budget), up to %d tokens per page", pool.max_pages,
          pool.page_bytes >> 10, (uint64_t{pool.max_pages} * pool.page_bytes) >> 20,
          engine.page_tokens);
  LogInfo("tiers below the device: host memory %d MiB, disk %d MiB",
          (uint64_t{pool.max_host_pages} * pool.page_bytes) >> 20,
          (uint64_t{pool.max_disk_pages} * pool.page_bytes) >> 20);
  LogInfo("quantized layers: %s",
          pool_of_pages.quantizes_on_host()
              ? absl::StrCat("native CPU kernels (",
                             std::string(gpu::QuantIsaName(gpu::BestQuantIsa())), ")")
              : std::string("compute shaders"));
  if (engine.default_ttl > absl::ZeroDuration()) {
    LogInfo("leases: %s by default", absl::FormatDuration(engine.default_ttl));
  }
}

}  // namespace

absl::StatusOr<service::TenantParts> KvCacheServer::MakeTenant(const TenantConfig* tenant) {
  auto runtime = std::make_shared<TenantRuntime>();
  engine::EngineOptions options = engine_options_;
  // Everything that can refuse the tenant comes before its store is opened.
  gpu::AccountLimits limits;
  if (tenant != nullptr) {
    ASSIGN_OR_RETURN(limits, TierLimits(tenant->quotas, pool_->page_bytes()));
    if (next_account_ == std::numeric_limits<gpu::AccountId>::max()) {
      return absl::ResourceExhaustedError("tokens_file: more tenants than pool accounts");
    }
  }
  if (!data_dir_.empty()) {
    std::string dir = data_dir_;
    if (tenant != nullptr) {
      dir = absl::StrCat(data_dir_, "/tenants");
      if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
        return absl::InternalError(absl::StrCat("data_dir ", dir, ": mkdir: ", strerror(errno)));
      }
      absl::StrAppend(&dir, "/", tenant->name);
    }
    ASSIGN_OR_RETURN(runtime->saved_files,
                     engine::SavedFileStore::Open(
                         dir, *disk_budget_,
                         {.quota_bytes = tenant != nullptr ? tenant->quotas.max_saved_bytes : 0,
                          .tell_others_use = tenant == nullptr}));
    options.saved_files = runtime->saved_files.get();
    LogInfo("data dir %s: %d saved files", dir, runtime->saved_files->List().size());
  }
  if (tenant != nullptr) {
    // A tenant's quota where it has one, never above the server's own limit.
    const auto tighter = [](uint64_t server, uint64_t quota) {
      return server == 0 ? quota : quota == 0 ? server : std::min(server, quota);
    };
    options.max_pinned_bytes = tighter(options.max_pinned_bytes, tenant->quotas.max_pinned_bytes);
    options.metadata_bytes = tighter(options.metadata_bytes, tenant->quotas.max_metadata_bytes);
    if (tenant->quotas.max_metadata_bytes != 0 &&
        options.metadata_bytes == tenant->quotas.max_metadata_bytes) {
      options.metadata_quota_of = tenant->name;  // its quota, not the flag, is what binds
    }
    options.max_caches = tenant->quotas.max_caches;
    options.max_snapshots = tenant->quotas.max_snapshots;
    // The pool is shared, so one tenant's idle snapshots make room for another's work.
    options.evict_elsewhere = [this](uint32_t pages) { return EvictAnyTenant(pages); };
    runtime->pool = pool_->ForAccount(next_account_++, limits);
  }
  runtime->engine =
      std::make_unique<engine::Engine>(runtime->pool != nullptr ? *runtime->pool : *pool_, options);
  runtime->lease_reaper =
      std::make_unique<engine::LeaseReaper>(*runtime->engine, lease_check_interval_);
  runtime->handlers = std::make_unique<service::Handlers>(*runtime->engine, service_options_);
  service::TenantParts parts{.handlers = runtime->handlers.get(), .engine = runtime->engine.get()};
  parts.owned = std::move(runtime);
  return parts;
}

absl::Status KvCacheServer::StartPeers(const ServerConfig& config) {
  ASSIGN_OR_RETURN(auto listed, service::ParsePeerList(config.peers, "peers"));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   GrpcPeerCredentials(config.tls, {.ca_file = config.peer_ca_file,
                                                    .cert_file = config.peer_cert_file,
                                                    .key_file = config.peer_key_file}));
  if (listed.empty() && config.etcd.endpoints.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(peers_, service::Peers::Make({.self = config.replica_name,
                                                 .listed = std::move(listed),
                                                 .etcd = config.etcd,
                                                 .credentials = std::move(credentials)}));
  return absl::OkStatus();
}

absl::Status KvCacheServer::StartTenants() {
  if (tokens_file_.empty()) {
    ASSIGN_OR_RETURN(service::TenantParts anonymous, MakeTenant(nullptr));
    tenants_ = std::make_unique<service::Tenants>(std::move(anonymous));
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(tenants_,
                   service::Tenants::Open(tokens_file_, [this](const TenantConfig& tenant) {
                     return MakeTenant(&tenant);
                   }));
  return absl::OkStatus();
}

uint32_t KvCacheServer::EvictAnyTenant(uint32_t pages) {
  uint32_t moved = 0;
  for (engine::Engine* engine : tenants_->Engines()) {
    if (moved >= pages) break;
    absl::StatusOr<uint32_t> evicted = engine->EvictIdlePages(pages - moved);
    if (evicted.ok()) moved += *evicted;
  }
  return moved;
}

engine::Engine& KvCacheServer::engine() { return *tenants_->anonymous_engine(); }

absl::Status KvCacheServer::ReloadTokens() { return tenants_->Reload(); }

absl::Status KvCacheServer::ReplaceKvEventSubscribers(const std::vector<std::string>& keys) {
  if (kv_events_ == nullptr) {
    return absl::FailedPreconditionError(
        "kv_events_curve_subscribers_file: KV events are off (no --kv_events_endpoint)");
  }
  return kv_events_->ReplaceSubscribers(keys);
}

absl::StatusOr<std::unique_ptr<KvCacheServer>> KvCacheServer::Start(const ServerConfig& config) {
  auto server = std::unique_ptr<KvCacheServer>(new KvCacheServer);
  ASSIGN_OR_RETURN(const net::HostPort listen,
                   net::ParseHostPort(config.listen, "listen", net::AddressUse::kListen));
  server->host_ = listen.host;
  RETURN_IF_ERROR(server->OpenDevice(config.device));
  RETURN_IF_ERROR(server->TakeEngineSettings(config));
  ASSIGN_OR_RETURN(const gpu::PoolOptions pool_options, server->OpenDataDir(config));
  RETURN_IF_ERROR(server->CreatePool(pool_options, config.engine));
  RETURN_IF_ERROR(config.request_log.Validate());
  // The lane listens first, so GetStats can name its port.
  RETURN_IF_ERROR(server->OpenDataLane(config));
  server->SetServiceOptions(config);
  server->metrics_registry_ = std::make_shared<prometheus::Registry>();
  RETURN_IF_ERROR(server->StartKvEvents(config.kv_events));
  RETURN_IF_ERROR(server->StartTenants());
  RETURN_IF_ERROR(server->StartPeers(config));
  RETURN_IF_ERROR(server->StartGrpcServer(config));
  server->ServeDataLane(config.tls);
  // Listed last: a client that sees the listing finds the replica serving.
  RETURN_IF_ERROR(server->ListInEtcd(config));
  // Logged last: whoever waits for this line finds the whole server up.
  server->LogListening(config.tls);
  return server;
}

absl::Status KvCacheServer::OpenDevice(const gpu::DeviceOptions& options) {
  ASSIGN_OR_RETURN(device_, gpu::Device::Create(options));
  const gpu::DeviceDescription& device = device_->description();
  LogInfo("device: %s (%s), transfers: %s", device.name, device.type,
          device_->transfer_path_name());
  return absl::OkStatus();
}

absl::Status KvCacheServer::TakeEngineSettings(const ServerConfig& config) {
  data_dir_ = config.data_dir;
  tokens_file_ = config.tokens_file;
  engine_options_ = config.engine;
  if (!config.replica_name.empty()) {
    RETURN_IF_ERROR(ids::CheckReplicaName(config.replica_name, "replica_name"));
    engine_options_.id_prefix = ids::IdPrefix(config.replica_name);
    LogInfo("replica %s: ids begin with \"%s\"", config.replica_name, engine_options_.id_prefix);
  }
  lease_check_interval_ = config.lease_check_interval;
  return absl::OkStatus();
}

absl::StatusOr<gpu::PoolOptions> KvCacheServer::OpenDataDir(const ServerConfig& config) {
  gpu::PoolOptions pool_options = config.pool;
  if (config.data_dir.empty()) return pool_options;
  disk_budget_ = std::make_unique<DiskBudget>(config.disk_bytes);
  std::error_code error;
  std::filesystem::create_directories(config.data_dir, error);
  if (error) {
    return absl::InternalError(
        absl::StrCat("data_dir ", config.data_dir, ": cannot create: ", error.message()));
  }
  pool_options.disk_path = absl::StrCat(config.data_dir, "/", kDiskTierFile);
  pool_options.disk_bytes = config.disk_bytes;
  if (pool_options.disk_bytes == 0) {
    ASSIGN_OR_RETURN(pool_options.disk_bytes, DefaultDiskTierBytes(config.data_dir, pool_options));
  }
  pool_options.disk_budget = disk_budget_.get();
  return pool_options;
}

absl::Status KvCacheServer::CreatePool(const gpu::PoolOptions& options,
                                       const engine::EngineOptions& engine) {
  ASSIGN_OR_RETURN(pool_, gpu::PagePool::Create(*device_, options));
  LogCapacity(*pool_, engine);
  return absl::OkStatus();
}

absl::Status KvCacheServer::OpenDataLane(const ServerConfig& config) {
  ASSIGN_OR_RETURN(const bool lane_on, LaneMayListen(config));
  if (!lane_on) {
    if (config.data_lane_advertise.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError("data_lane_advertise: set, but the data lane is off");
  }
  ASSIGN_OR_RETURN(const net::HostPort lane_host,
                   net::ParseHostPort(config.data_lane_listen, "data_lane_listen",
                                      net::AddressUse::kListen));
  RETURN_IF_ERROR(config.lane_limits.Validate());
  RETURN_IF_ERROR(config.keepalive.Validate());
  ASSIGN_OR_RETURN(std::shared_ptr<const lane::TlsContext> lane_tls, LaneTlsContext(config.tls));
  absl::StatusOr<std::unique_ptr<service::DataLane>> lane =
      service::DataLane::Listen(config.data_lane_listen, config.max_message_bytes,
                                std::move(lane_tls), config.lane_limits, config.keepalive);
  if (!lane.ok()) {
    return absl::UnavailableError(absl::StrCat("data_lane_listen: ", lane.status().message()));
  }
  data_lane_ = *std::move(lane);
  lane_host_ = lane_host.host;
  if (!config.data_lane_advertise.empty()) {
    // Clients connect to it: a wildcard host or port 0 would reach nothing.
    RETURN_IF_ERROR(net::ParseHostPort(config.data_lane_advertise, "data_lane_advertise",
                                       net::AddressUse::kConnect)
                        .status());
    lane_advertise_ = config.data_lane_advertise;
  }
  return absl::OkStatus();
}

void KvCacheServer::SetServiceOptions(const ServerConfig& config) {
  service_options_ = {.max_message_bytes = config.max_message_bytes,
                      .device_name = device_->description().name,
                      .transfer_path = device_->transfer_path_name(),
                      .data_lane_address = advertised_lane_address(),
                      .replica_name = config.replica_name,
                      .request_log = config.request_log};
}

absl::Status KvCacheServer::StartKvEvents(const KvEventsConfig& config) {
  if (config.endpoint.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(kv_events_, KvEventPublisher::Start(config, *metrics_registry_));
  engine_options_.prefix_blocks = &kv_events_->blocks();
  LogInfo("KV events (vLLM's, %s, blocks of %d tokens) on %s%s",
          config.format == KvEventFormat::kMap ? "map" : "array", config.block_tokens,
          kv_events_->endpoint(),
          kv_events_->replay_endpoint().empty()
              ? ""
              : absl::StrCat(", replays on ", kv_events_->replay_endpoint()));
  return absl::OkStatus();
}

absl::Status KvCacheServer::StartGrpcServer(const ServerConfig& config) {
  service_ = std::make_unique<service::KvCacheService>(*tenants_, peers_.get(),
                                                       config.replica_name);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   GrpcServerCredentials(config.tls));
  grpc::ServerBuilder builder;
  RETURN_IF_ERROR(SetConnectionLiveness(config, builder));
  RETURN_IF_ERROR(SetConnectionLimits(config, builder));
  builder.AddListeningPort(config.listen, credentials, &port_);
  RETURN_IF_ERROR(ObserveCalls(config.metrics_listen, config.access_log, builder));
  builder.RegisterService(service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config.max_message_bytes));
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(absl::StrCat("listen: cannot listen on ", config.listen));
  }
  // The standard health service answers for "" (the whole server) by
  // default; orchestrators and grpc_health_probe ask by service name too.
  server_->GetHealthCheckService()->SetServingStatus(v1::KvCacheService::service_full_name(),
                                                     true);
  return absl::OkStatus();
}

void KvCacheServer::ServeDataLane(const TlsConfig& tls) {
  if (!data_lane_) return;
  data_lane_->Serve(*tenants_);
  LogInfo("data lane (Update and Fetch over %s) on %s%s", tls.enabled() ? "TLS 1.3" : "plain TCP",
          data_lane_address(),
          lane_advertise_.empty() ? "" : absl::StrCat(", given to clients as ", lane_advertise_));
}

absl::Status KvCacheServer::ListInEtcd(const ServerConfig& config) {
  if (config.etcd.endpoints.empty()) return absl::OkStatus();
  // A listen address on every interface names no host a client could reach:
  // EtcdRegistration then asks for advertise_address.
  const std::string listed = !config.advertise_address.empty() ? config.advertise_address
                             : net::IsWildcardHost(host_)      ? ""
                                                               : address();
  ASSIGN_OR_RETURN(etcd_, EtcdRegistration::Start({.etcd = config.etcd,
                                                   .name = config.replica_name,
                                                   .address = listed,
                                                   .lease_ttl = config.etcd_lease_ttl},
                                                  *metrics_registry_));
  return absl::OkStatus();
}

void KvCacheServer::LogListening(const TlsConfig& tls) const {
  LogInfo("listening on %s (%s)", address(),
          !tls.enabled()               ? "plaintext"
          : tls.client_ca_file.empty() ? "TLS"
                                       : "mutual TLS: clients present certificates");
}

// Every call is observed (request ids, failures logged, metrics taken)
// whether or not anyone scrapes the metrics: an interceptor per call costs
// little next to a call, and --metrics_listen then changes nothing but the
// endpoint.
absl::Status KvCacheServer::ObserveCalls(const std::string& listen, bool access_log,
                                         grpc::ServerBuilder& builder) {
  rpc_observer_ = std::make_unique<service::RpcObserver>(
      *metrics_registry_,
      service::RpcObserverOptions{
          .extra_methods = {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
                            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"},
          .access_log = access_log});
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> factories;
  factories.push_back(rpc_observer_->InterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(factories));
  if (listen.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(metrics_, MetricsExporter::Start(
                                 listen, {metrics_registry_,
                                          std::make_shared<service::StateMetrics>(
                                              *tenants_, data_lane_.get())}));
  LogInfo("metrics (Prometheus) on http://%s/metrics", metrics_->address());
  return absl::OkStatus();
}

// Cancels whatever is still in flight at once: an open stream would otherwise
// keep an unbounded Shutdown() waiting for its client.
KvCacheServer::~KvCacheServer() {
  metrics_.reset();
  if (server_) server_->Shutdown(std::chrono::system_clock::now());
  if (data_lane_) data_lane_->Shutdown(absl::ZeroDuration());
}

std::string KvCacheServer::address() const { return net::HostPort{host_, port_}.ToString(); }

std::string KvCacheServer::data_lane_address() const {
  if (!data_lane_) return "";
  return net::HostPort{lane_host_, data_lane_->port()}.ToString();
}

std::string KvCacheServer::advertised_lane_address() const {
  return lane_advertise_.empty() ? data_lane_address() : lane_advertise_;
}

void KvCacheServer::Shutdown(absl::Duration grace) {
  // Off etcd's list first: fleet clients stop placing caches here at once.
  if (etcd_) etcd_->Withdraw();
  // NOT_SERVING to health checks and watchers first: a load balancer stops
  // sending new work while the calls in flight drain.
  server_->GetHealthCheckService()->SetServingStatus(false);
  const absl::Time deadline = absl::Now() + grace;
  absl::Notification shutting_down;
  absl::Notification stopped;
  std::thread stopper([&] {
    // Shutdown is about to begin; only the 50 ms wait below orders the polls after it.
    shutting_down.Notify();
    server_->Shutdown(absl::ToChronoTime(deadline));
    stopped.Notify();
  });
  // gRPC's Shutdown also waits, until the deadline, for every client to
  // hang up after its GOAWAY, and an idle client that is not polling its
  // connection never does. Once no call is in flight (none that gRPC has
  // made, refused or admitted, and no admitted one still answering), nothing
  // is left to drain: the idle connections are cut. Two polls 10 ms apart
  // must agree, so a call that arrived just before the GOAWAY is seen.
  // The first wait lets clients that do read the GOAWAY close by themselves.
  shutting_down.WaitForNotification();
  if (!stopped.WaitForNotificationWithTimeout(absl::Milliseconds(50))) {
    int idle_polls = 0;
    while (!stopped.WaitForNotificationWithTimeout(absl::Milliseconds(10))) {
      const bool idle = rpc_observer_->calls_in_flight() == 0 && tenants_->calls_alive() == 0;
      idle_polls = idle ? idle_polls + 1 : 0;
      if (idle_polls >= 2) grpc_server_cancel_all_calls(server_->c_server());
    }
  }
  stopper.join();
  if (data_lane_) data_lane_->Shutdown(std::max(deadline - absl::Now(), absl::ZeroDuration()));
}

void KvCacheServer::Wait() { server_->Wait(); }

}  // namespace kvcache
