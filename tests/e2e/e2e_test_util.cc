#include "e2e_test_util.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "chunked_recurrent_test_util.h"
#include "gmock/gmock.h"
#include "gpu/device.h"
#include "reference_quantized.h"
#include "reference_recurrent.h"
#include "wire_forms_util.h"

namespace kvcache::testing {

std::unique_ptr<TestServer> TestServer::Start(const ServerSetup& setup) {
  ServerConfig config;
  config.listen = setup.listen;
  if (setup.data_lane) config.data_lane_listen = "127.0.0.1:0";
  config.device.enable_validation = true;
  config.device.force_staging =
      setup.path == TransferPath::kStagingRegions || setup.path == TransferPath::kStagingShader;
  config.device.stage_reads = setup.path == TransferPath::kMappedWrites;
  config.device.copy_engine = setup.path == TransferPath::kStagingShader
                                  ? gpu::CopyEngine::kComputeShader
                                  : gpu::CopyEngine::kCopyRegions;
  config.pool.page_bytes = setup.page_bytes;
  config.pool.budget_bytes = setup.budget_bytes;
  config.engine.page_tokens = setup.page_tokens;
  config.engine.max_update_tokens = 256;
  config.engine.default_ttl = setup.default_ttl;
  config.engine.max_pinned_bytes = setup.max_pinned_bytes;
  config.engine.metadata_bytes = setup.metadata_bytes;
  config.pool.host_bytes = setup.host_bytes;
  config.data_dir = setup.data_dir;
  config.disk_bytes = setup.disk_bytes;
  config.lease_check_interval = setup.lease_check_interval;
  config.tokens_file = setup.tokens_file;
  config.tls = setup.tls;
  config.allow_plaintext_lane = setup.allow_plaintext_lane;
  config.lane_limits = setup.lane_limits;
  config.keepalive = setup.keepalive;
  config.grpc_handshake_timeout = setup.grpc_handshake_timeout;
  config.grpc_max_streams_per_connection = setup.grpc_max_streams_per_connection;
  config.metrics_listen = setup.metrics_listen;
  config.access_log = setup.access_log;
  config.kv_events = setup.kv_events;
  config.replica_name = setup.replica_name;
  config.peers = setup.peers;
  config.peer_ca_file = setup.peer_ca_file;
  config.peer_cert_file = setup.peer_cert_file;
  config.peer_key_file = setup.peer_key_file;
  absl::StatusOr<std::unique_ptr<KvCacheServer>> server = KvCacheServer::Start(config);
  if (!server.ok()) {
    ADD_FAILURE() << "KvCacheServer::Start: " << server.status();
    return nullptr;
  }
  auto test_server = std::unique_ptr<TestServer>(new TestServer);
  test_server->server_ = *std::move(server);
  test_server->token_ = setup.token;
  test_server->client_tls_ = setup.client_tls;
  test_server->client_ =
      test_server->Connect(/*dedicated=*/false, setup.client_on_lane ? "auto" : "");
  const absl::Status ready = test_server->client_->WaitForReady(absl::Seconds(10));
  if (!ready.ok()) {
    ADD_FAILURE() << ready;
    return nullptr;
  }
  return test_server;
}

void ExpectStartRefused(ServerConfig config, const std::string& field) {
  SCOPED_TRACE(field);
  config.listen = "127.0.0.1:0";
  if (!config.data_lane_listen.empty()) config.data_lane_listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<KvCacheServer>> server = KvCacheServer::Start(config);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
  EXPECT_THAT(std::string(server.status().message()), ::testing::HasSubstr(field));
}

TestServer::~TestServer() {
  client_.reset();  // before the server, so no call of ours is left in flight
  server_.reset();
}

std::unique_ptr<Client> TestServer::Connect(bool dedicated, const std::string& data_lane) const {
  ClientOptions options = client_tls_;
  options.address = server_->address();
  options.deadline = absl::Seconds(30);
  options.dedicated_connection = dedicated;
  options.data_lane = data_lane;
  options.token = token_;
  return Client::Connect(options);
}

std::unique_ptr<Client> TestServer::ConnectAs(const std::string& token,
                                              const std::string& data_lane) const {
  return Client::Connect(ClientOptions{.address = server_->address(),
                                       .deadline = absl::Seconds(30),
                                       .dedicated_connection = true,
                                       .data_lane = data_lane,
                                       .token = token});
}

std::unique_ptr<Client> TestServer::ConnectTo(const std::string& address) const {
  return Client::Connect(ClientOptions{
      .address = address, .deadline = absl::Seconds(30), .dedicated_connection = true});
}

void TestServer::Shutdown(absl::Duration grace) {
  shut_down_ = true;
  server_->Shutdown(grace);
}

void TestServer::CleanUpAndCheck() {
  if (shut_down_) {
    ReleaseEverything(server_->engine());
    EXPECT_EQ(server_->engine().pool().stats().used_pages, 0u) << "pages leaked";
  } else {
    absl::StatusOr<std::vector<v1::SnapshotInfo>> snapshots = client_->ListSnapshots();
    ASSERT_TRUE(snapshots.ok()) << snapshots.status();
    for (const v1::SnapshotInfo& info : *snapshots) {
      EXPECT_TRUE(client_->ReleaseSnapshot(info.snapshot_id()).ok());
    }
    absl::StatusOr<std::vector<v1::CacheInfo>> caches = client_->ListCaches();
    ASSERT_TRUE(caches.ok()) << caches.status();
    for (const v1::CacheInfo& info : *caches) {
      EXPECT_TRUE(client_->DeleteCache(info.cache_id()).ok());
    }
    // A lease that ran out hides its handle at once and is released by the
    // reaper within its interval (later on a loaded machine): wait for it.
    absl::StatusOr<v1::Stats> stats;
    gpu::PoolStats pool;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    do {
      stats = client_->GetStats();
      ASSERT_TRUE(stats.ok()) << stats.status();
      // From the pool itself: a tenant's GetStats does not show the pool's use.
      pool = server_->pool().stats();
      if (pool.used_pages + pool.host_pages + pool.disk_pages + stats->caches() +
              stats->snapshots() ==
          0) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(20));
    } while (absl::Now() < deadline);
    EXPECT_EQ(pool.used_pages, 0u) << "pages leaked";
    EXPECT_EQ(pool.host_pages, 0u) << "host-tier pages leaked";
    EXPECT_EQ(pool.disk_pages, 0u) << "disk-tier pages leaked";
    EXPECT_EQ(stats->caches(), 0u);
    EXPECT_EQ(stats->snapshots(), 0u);
  }
  const gpu::Device& device = server_->device();
  EXPECT_EQ(device.validation_message_count(), 0u)
      << "Vulkan validation messages from the server's device:\n  "
      << absl::StrJoin(device.validation_messages(), "\n  ");
}

void E2eTest::SetUp() {
  server_ = TestServer::Start({.path = GetParam()});
  ASSERT_NE(server_, nullptr);
}

void E2eTest::TearDown() {
  if (server_) server_->CleanUpAndCheck();
  server_.reset();
}

void E2eTest::ExpectRefused(absl::StatusCode code, const std::string& field,
                            const std::function<absl::Status()>& call) {
  SCOPED_TRACE(field);
  const EngineFingerprint before = WireFingerprint(client());
  const absl::Status status = call();
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_NE(std::string(status.message()).find(field), std::string::npos)
      << "\"" << status.message() << "\" should name " << field;
  const EngineFingerprint after = WireFingerprint(client());
  EXPECT_TRUE(after == before) << "a refused call changed state:\nbefore: " << Describe(before)
                               << "\nafter: " << Describe(after);
}

std::vector<std::string> EveryRpcMethod() {
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          v1::KvCacheService::service_full_name());
  std::vector<std::string> methods;
  for (int i = 0; i < service->method_count(); ++i) {
    methods.push_back(absl::StrCat("/", service->full_name(), "/", service->method(i)->name()));
  }
  return methods;
}

grpc::StatusCode CallWithEmptyMessage(const std::string& address, const std::string& method,
                                      const std::string& authorization) {
  return CallWithBytes(address, method, "", authorization).error_code();
}

grpc::Status CallWithBytes(const std::string& address, const std::string& method,
                           const std::string& request, const std::string& authorization) {
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (!authorization.empty()) context.AddMetadata("authorization", authorization);
  grpc::Slice bytes(request);
  grpc::ByteBuffer message(&bytes, 1), response;
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, method, grpc::StubOptions(), &message, &response, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  done.WaitForNotification();
  return status;
}

std::string PathTestName(const ::testing::TestParamInfo<TransferPath>& info) {
  return TransferPathName(info.param);
}

LayerUpdate MakeLayerUpdate(const engine::CacheSpec& spec, uint32_t layer, const KvTensors& kv) {
  const RefShape shape = ShapeOf(spec, layer);
  return LayerUpdate{.layer = layer,
                     .dtype = static_cast<v1::DType>(spec.dtype),
                     .keys_shape = {shape.batch, shape.heads, kv.tokens, shape.k_dim},
                     .keys = kv.keys,
                     .values_shape = {shape.batch, shape.heads, kv.tokens, shape.v_dim},
                     .values = kv.values};
}

LayerUpdate MakeStateUpdate(const engine::CacheSpec& spec, uint32_t layer, const RefState& state,
                            uint64_t advance) {
  const auto& r = std::get<engine::RecurrentKind>(spec.layers[layer].kind);
  const uint64_t b = spec.batch_size;
  return LayerUpdate{.layer = layer,
                     .dtype = static_cast<v1::DType>(spec.dtype),
                     .state = RecurrentStateUpdate{
                         .conv_shape = {b, r.conv_tail, r.conv_dim},
                         .conv = state.conv,
                         .delta_shape = {b, r.num_v_heads, r.head_v_dim, r.head_k_dim},
                         .delta = state.delta,
                         .advance = advance}};
}

absl::Status StepBoth(Client& client, const std::string& id, RefCache& reference, uint64_t tokens,
                      std::mt19937_64& rng) {
  const engine::CacheSpec& spec = reference.spec();
  std::vector<KvTensors> kv(spec.layers.size());
  std::vector<RefState> states(spec.layers.size());
  std::vector<LayerUpdate> updates;
  for (uint32_t l = 0; l < spec.layers.size(); ++l) {
    if (engine::IsRecurrent(spec.layers[l])) {
      states[l] = RandomState(spec, l, rng);
      updates.push_back(MakeStateUpdate(spec, l, states[l], tokens));
    } else {
      kv[l] = RandomLayerKv(spec, l, tokens, rng);
      updates.push_back(MakeLayerUpdate(spec, l, kv[l]));
    }
  }
  absl::StatusOr<std::vector<v1::UpdateResponse>> acks = client.Update(id, updates);
  if (!acks.ok()) return acks.status();
  for (uint32_t l = 0; l < spec.layers.size(); ++l) {
    if (engine::IsRecurrent(spec.layers[l])) {
      reference.UpdateState(l, states[l], tokens);
    } else {
      reference.Update(l, TokensFromTensors(ShapeOf(spec, l), kv[l].keys, kv[l].values, tokens));
    }
  }
  return absl::OkStatus();
}

absl::Span<const std::byte> BytesOf(const std::string& data) {
  return {reinterpret_cast<const std::byte*>(data.data()), data.size()};
}

LayerUpdate ToLayerUpdate(const v1::UpdateRequest& request) {
  return LayerUpdate{
      .layer = request.layer(),
      .dtype = request.keys().dtype(),
      .keys_shape = {request.keys().shape().begin(), request.keys().shape().end()},
      .keys = BytesOf(request.keys().data()),
      .values_shape = {request.values().shape().begin(), request.values().shape().end()},
      .values = BytesOf(request.values().data())};
}

std::vector<RefToken> TokensOf(const LayerHistory& history, const RefShape& shape) {
  std::vector<RefToken> tokens =
      TokensFromTensors(shape, history.keys, history.values, history.tokens);
  size_t next = 0;
  for (const auto& [begin, end] : history.ranges) {
    for (uint64_t position = begin; position < end && next < tokens.size(); ++position) {
      tokens[next++].position = position;
    }
  }
  return tokens;
}

::testing::AssertionResult HistoryMatches(const std::vector<RefToken>& expected,
                                          const absl::StatusOr<LayerHistory>& history,
                                          const RefShape& shape) {
  if (!history.ok()) return ::testing::AssertionFailure() << "fetch: " << history.status();
  std::vector<engine::TokenRange> ranges;
  uint64_t tokens = 0;
  for (const auto& [begin, end] : history->ranges) {
    ranges.push_back({begin, end});
    tokens += end - begin;
  }
  if (RangesString(ranges) != RangesString(RangesOf(expected)) || tokens != history->tokens ||
      history->keys.size() != shape.KTensorBytes(tokens) ||
      history->values.size() != shape.VTensorBytes(tokens)) {
    return ::testing::AssertionFailure()
           << "fetched ranges " << RangesString(ranges) << " (" << history->tokens << " tokens, "
           << history->keys.size() << "+" << history->values.size() << " bytes), expected "
           << RangesString(RangesOf(expected));
  }
  return SameTokens(expected, TokensOf(*history, shape));
}

::testing::AssertionResult LayerMatchesReference(Client& client, const std::string& cache_id,
                                                 const std::string& snapshot_id,
                                                 const engine::CacheSpec& spec, uint32_t layer,
                                                 const std::vector<RefToken>& stored,
                                                 const std::optional<RefState>& state) {
  if (engine::IsRecurrent(spec.layers[layer])) {
    absl::StatusOr<v1::RecurrentState> fetched = client.FetchState(cache_id, snapshot_id, layer);
    if (!state.has_value()) {
      if (fetched.status().code() == absl::StatusCode::kFailedPrecondition) {
        return ::testing::AssertionSuccess();
      }
      return ::testing::AssertionFailure() << "no state expected, fetched " << fetched.status();
    }
    if (!fetched.ok()) return ::testing::AssertionFailure() << "FetchState: " << fetched.status();
    absl::StatusOr<RefState> actual = StateOf(spec, layer, *fetched);
    if (!actual.ok()) return ::testing::AssertionFailure() << actual.status();
    if (!(*actual == *state)) return ::testing::AssertionFailure() << "state bytes differ";
    return ::testing::AssertionSuccess();
  }
  ::testing::AssertionResult same =
      HistoryMatches(AsFetched(spec, layer, stored),
                     client.FetchLayer(cache_id, snapshot_id, layer), ShapeOf(spec, layer));
  if (!same || !std::holds_alternative<engine::QuantizedKind>(spec.layers[layer].kind)) {
    return same;
  }
  absl::StatusOr<std::vector<v1::FetchResponse>> packed =
      client.FetchPacked(cache_id, snapshot_id, layer);
  if (!packed.ok()) return ::testing::AssertionFailure() << "FetchPacked: " << packed.status();
  absl::StatusOr<std::vector<RefToken>> tokens = PackedTokensOf(spec, layer, *packed);
  if (!tokens.ok()) return ::testing::AssertionFailure() << tokens.status();
  return SameTokens(stored, *tokens) << " (packed)";
}

RefState LiveStateOf(const RefCache& reference, uint32_t layer) {
  return reference.layer(layer).FetchState().value_or(ZeroState(reference.spec(), layer));
}

::testing::AssertionResult CacheMatchesReference(Client& client, const std::string& id,
                                                 const RefCache& reference) {
  absl::StatusOr<v1::CacheInfo> info = client.GetCache(id);
  if (!info.ok()) return ::testing::AssertionFailure() << "GetCache: " << info.status();
  const engine::CacheSpec& spec = reference.spec();
  std::vector<uint32_t> padding = spec.left_padding;
  if (std::all_of(padding.begin(), padding.end(), [](uint32_t p) { return p == 0; })) {
    padding.clear();  // the server drops all-zero padding
  }
  const std::vector<uint32_t> wire_padding(info->spec().left_padding().begin(),
                                           info->spec().left_padding().end());
  const std::vector<uint64_t> offsets(info->layer_offsets().begin(), info->layer_offsets().end());
  if (info->spec().batch_size() != spec.batch_size || wire_padding != padding ||
      offsets != reference.layer_offsets()) {
    return ::testing::AssertionFailure()
           << "cache " << info->ShortDebugString() << " differs from the reference's rows ("
           << spec.batch_size << "), padding {" << absl::StrJoin(padding, ",") << "} or offsets {"
           << absl::StrJoin(reference.layer_offsets(), ",") << "}";
  }
  for (uint32_t layer = 0; layer < reference.num_layers(); ++layer) {
    const bool recurrent = engine::IsRecurrent(spec.layers[layer]);
    ::testing::AssertionResult same = LayerMatchesReference(
        client, id, "", spec, layer,
        recurrent ? std::vector<RefToken>{} : reference.layer(layer).Fetch(),
        recurrent ? std::optional<RefState>(LiveStateOf(reference, layer)) : std::nullopt);
    if (!same) return same << " (layer " << layer << ")";
  }
  return ::testing::AssertionSuccess();
}

namespace {

// Every layer of a cache or snapshot, fetched in one stream.
std::vector<EngineFingerprint::Layer> FetchAllLayers(Client& client, const std::string& cache_id,
                                                     const std::string& snapshot_id) {
  v1::FetchRequest request;
  request.set_cache_id(cache_id);
  request.set_snapshot_id(snapshot_id);
  std::map<uint32_t, std::vector<v1::FetchResponse>> chunks;
  const absl::Status status = client.Fetch(request, [&](const v1::FetchResponse& chunk) {
    chunks[chunk.layer()].push_back(chunk);
    return absl::OkStatus();
  });
  EXPECT_TRUE(status.ok()) << status;
  std::vector<EngineFingerprint::Layer> layers;
  for (const auto& [layer, parts] : chunks) {
    if (parts.size() == 1 && parts[0].has_state()) {
      const v1::RecurrentState& state = parts[0].state();
      const absl::Span<const std::byte> conv = BytesOf(state.conv_state().data());
      const absl::Span<const std::byte> delta = BytesOf(state.delta_state().data());
      layers.push_back({.ranges = {{parts[0].start(), parts[0].start()}},
                        .keys = {conv.begin(), conv.end()},
                        .values = {delta.begin(), delta.end()}});
      continue;
    }
    absl::StatusOr<LayerHistory> history = AssembleHistory(parts);
    EXPECT_TRUE(history.ok()) << history.status();
    if (!history.ok()) continue;
    EngineFingerprint::Layer out{.keys = history->keys, .values = history->values};
    for (const auto& [begin, end] : history->ranges) out.ranges.push_back({begin, end});
    layers.push_back(std::move(out));
  }
  return layers;
}

}  // namespace

EngineFingerprint WireFingerprint(Client& client) {
  EngineFingerprint fingerprint;
  absl::StatusOr<std::vector<v1::CacheInfo>> caches = client.ListCaches();
  EXPECT_TRUE(caches.ok()) << caches.status();
  for (const v1::CacheInfo& info : caches.value_or(std::vector<v1::CacheInfo>{})) {
    fingerprint.caches.push_back(
        {.id = info.cache_id(),
         .cache_id = info.cache_id(),
         .offsets = {info.layer_offsets().begin(), info.layer_offsets().end()},
         .layers = FetchAllLayers(client, info.cache_id(), "")});
  }
  absl::StatusOr<std::vector<v1::SnapshotInfo>> snapshots = client.ListSnapshots();
  EXPECT_TRUE(snapshots.ok()) << snapshots.status();
  for (const v1::SnapshotInfo& info : snapshots.value_or(std::vector<v1::SnapshotInfo>{})) {
    fingerprint.snapshots.push_back({.id = info.snapshot_id(),
                                     .cache_id = info.cache_id(),
                                     .offsets = {info.from_offset(), info.to_offset()},
                                     .layers = FetchAllLayers(client, "", info.snapshot_id())});
  }
  auto by_id = [](const auto& a, const auto& b) { return a.id < b.id; };
  std::sort(fingerprint.caches.begin(), fingerprint.caches.end(), by_id);
  std::sort(fingerprint.snapshots.begin(), fingerprint.snapshots.end(), by_id);
  absl::StatusOr<v1::Stats> stats = client.GetStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  fingerprint.used_pages = stats.ok() ? stats->pages_used() : UINT32_MAX;
  return fingerprint;
}

}  // namespace kvcache::testing
