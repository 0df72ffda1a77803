// Connections: clients that cancel or lose their connection mid-stream (the
// server stays healthy and keeps what it acknowledged), a cancelled Fetch, and
// messages above gRPC's default 4 MiB limit.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>

#include "absl/time/clock.h"
#include "e2e_test_util.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "loopback_proxy.h"
#include "service_test_util.h"

namespace kvcache::testing {
namespace {

using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;

class E2eLifecycleTest : public E2eTest {
 protected:
  // A cache of `layers` standard layers with 8 heads of 64 dims (2 KiB a token).
  std::string CreateCache(uint32_t layers = 2) {
    spec_ = ProtoSpec(layers, 8, 64);
    reference_ = std::make_unique<RefCache>(
        MakeSpec(std::vector<engine::LayerSpec>(layers, StandardLayerSpec(8, 64))));
    absl::StatusOr<v1::CacheInfo> info = client().CreateCache(spec_);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->cache_id() : "";
  }

  // A random update of `layer`; Mirror applies one to the reference.
  v1::UpdateRequest NewUpdate(const std::string& cache_id, uint32_t layer, uint64_t tokens) {
    return RandomUpdate(cache_id, spec_, layer, tokens, rng_);
  }
  void Mirror(const v1::UpdateRequest& request) {
    const RefShape shape = ShapeOf(reference_->spec(), request.layer());
    reference_->Update(request.layer(), TokensFromTensors(shape, BytesOf(request.keys().data()),
                                                          BytesOf(request.values().data()),
                                                          request.keys().shape(2)));
  }

  // Offsets and every layer's bytes equal the reference's.
  void ExpectCacheMatches(const std::string& cache_id) {
    absl::StatusOr<v1::CacheInfo> info = client().GetCache(cache_id);
    ASSERT_TRUE(info.ok()) << info.status();
    const std::vector<uint64_t> offsets(info->layer_offsets().begin(), info->layer_offsets().end());
    EXPECT_EQ(offsets, reference_->layer_offsets());
    for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
      EXPECT_TRUE(HistoryMatches(reference_->layer(layer).Fetch(),
                                 client().FetchLayer(cache_id, "", layer),
                                 ShapeOf(reference_->spec(), layer)))
          << "layer " << layer;
    }
  }

  // The standard health service says SERVING, and a new client can work.
  void ExpectHealthy() {
    auto channel =
        grpc::CreateChannel(server_->server().address(), grpc::InsecureChannelCredentials());
    auto health = grpc::health::v1::Health::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    HealthCheckResponse response;
    const grpc::Status status = health->Check(&context, HealthCheckRequest(), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);

    std::unique_ptr<Client> fresh = server_->Connect(/*dedicated=*/true);
    absl::StatusOr<v1::CacheInfo> info = fresh->CreateCache(ProtoSpec(1, 1, 4));
    ASSERT_TRUE(info.ok()) << info.status();
    std::mt19937_64 rng(3);
    const v1::UpdateRequest update = RandomUpdate(info->cache_id(), info->spec(), 0, 2, rng);
    const LayerUpdate layer_update = ToLayerUpdate(update);
    absl::StatusOr<std::vector<v1::UpdateResponse>> acks =
        fresh->Update(info->cache_id(), {&layer_update, 1});
    ASSERT_TRUE(acks.ok()) << acks.status();
    absl::StatusOr<LayerHistory> history = fresh->FetchLayer(info->cache_id(), "", 0);
    ASSERT_TRUE(history.ok()) << history.status();
    EXPECT_EQ(history->tokens, 2u);
    EXPECT_TRUE(fresh->DeleteCache(info->cache_id()).ok());
  }

  // Writes three updates on a raw stream and waits for each acknowledgement.
  void WriteAcknowledged(grpc::ClientReaderWriter<v1::UpdateRequest, v1::UpdateResponse>& stream,
                         const std::string& cache_id) {
    for (uint32_t layer : {0, 1, 0}) {
      const v1::UpdateRequest request = NewUpdate(cache_id, layer, 3);
      ASSERT_TRUE(stream.Write(request));
      v1::UpdateResponse ack;
      ASSERT_TRUE(stream.Read(&ack));
      Mirror(request);
      EXPECT_EQ(ack.offset(), reference_->layer(layer).offset());
    }
  }

  v1::CacheSpec spec_;
  std::unique_ptr<RefCache> reference_;
  std::mt19937_64 rng_{11};
};

TEST_P(E2eLifecycleTest, ClientCancelsMidStream) {
  const std::string cache_id = CreateCache();
  std::unique_ptr<Client> worker = server_->Connect(/*dedicated=*/true);
  grpc::ClientContext context;
  auto stream = worker->stub().Update(&context);
  WriteAcknowledged(*stream, cache_id);
  context.TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  stream.reset();
  worker.reset();
  ExpectHealthy();
  ExpectCacheMatches(cache_id);  // the acknowledged updates stay applied
}

TEST_P(E2eLifecycleTest, ClientConnectionDropsMidStream) {
  const std::string cache_id = CreateCache();
  std::unique_ptr<LoopbackProxy> proxy = LoopbackProxy::Start(server_->server().port());
  ASSERT_NE(proxy, nullptr);
  std::unique_ptr<Client> worker = server_->ConnectTo(proxy->address());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = worker->stub().Update(&context);
  WriteAcknowledged(*stream, cache_id);
  proxy->CutConnections();
  v1::UpdateResponse ack;
  EXPECT_FALSE(stream->Read(&ack));
  EXPECT_FALSE(stream->Finish().ok());
  stream.reset();
  worker.reset();
  ExpectHealthy();
  ExpectCacheMatches(cache_id);
  // The cache is not left locked or half-written: updates go on.
  const v1::UpdateRequest next = NewUpdate(cache_id, 1, 3);
  std::unique_ptr<UpdateStream> again = client().OpenUpdate(cache_id);
  ASSERT_TRUE(again->Write(ToLayerUpdate(next)));
  ASSERT_TRUE(again->Finish().ok());
  Mirror(next);
  ExpectCacheMatches(cache_id);
}

// WriteShared sends the caller's buffers without copying them: the bytes that
// arrive are the buffers' bytes, and gRPC lets go of the owner afterwards.
TEST_P(E2eLifecycleTest, WriteSharedSendsTheCallersBuffers) {
  const std::string cache_id = CreateCache();
  std::weak_ptr<const void> watched;
  {
    auto stream = client().OpenUpdate(cache_id);
    for (uint32_t layer : {0, 1}) {
      auto request = std::make_shared<v1::UpdateRequest>(NewUpdate(cache_id, layer, 5));
      Mirror(*request);
      watched = request;
      ASSERT_TRUE(stream->WriteShared(ToLayerUpdate(*request), request));
    }
    absl::StatusOr<std::vector<v1::UpdateResponse>> acks = stream->Finish();
    ASSERT_TRUE(acks.ok()) << acks.status();
    EXPECT_EQ(acks->size(), 2u);
  }
  ExpectCacheMatches(cache_id);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (!watched.expired() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(watched.expired()) << "gRPC still holds the caller's buffers";
}

// Destroying a server with a stream still open cancels it instead of waiting
// for the client (KvCacheServer's destructor has no grace).
TEST(E2eServerTest, DestructorDoesNotWaitForOpenStreams) {
  std::unique_ptr<TestServer> server = TestServer::Start(ServerSetup{});
  ASSERT_NE(server, nullptr);
  std::unique_ptr<Client> client = server->Connect(/*dedicated=*/true);
  absl::StatusOr<v1::CacheInfo> info = client->CreateCache(ProtoSpec(1, 1, 4));
  ASSERT_TRUE(info.ok()) << info.status();
  grpc::ClientContext context;
  auto stream = client->stub().Update(&context);
  std::mt19937_64 rng(5);
  ASSERT_TRUE(stream->Write(RandomUpdate(info->cache_id(), info->spec(), 0, 2, rng)));
  v1::UpdateResponse ack;
  ASSERT_TRUE(stream->Read(&ack));
  const absl::Time start = absl::Now();
  server.reset();  // the stream is still open
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_FALSE(stream->Finish().ok());
}

TEST_P(E2eLifecycleTest, CancelledFetchReleasesItsView) {
  const std::string cache_id = CreateCache(1);
  std::unique_ptr<UpdateStream> stream = client().OpenUpdate(cache_id);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(stream->Write(ToLayerUpdate(NewUpdate(cache_id, 0, 200))));
  }
  ASSERT_TRUE(stream->Finish().ok());
  v1::FetchRequest request;
  request.set_cache_id(cache_id);
  request.set_max_chunk_tokens(4);
  int chunks = 0;
  const absl::Status status = client().Fetch(request, [&](const v1::FetchResponse&) {
    return ++chunks == 2 ? absl::CancelledError("enough") : absl::OkStatus();
  });
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  ASSERT_TRUE(client().DeleteCache(cache_id).ok());
  // The server drops the view's page references once it sees the cancel.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  uint64_t used = 1;
  while (absl::Now() < deadline && (used = client().GetStats()->pages_used()) != 0) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(used, 0u) << "a cancelled Fetch kept its pages";
}

INSTANTIATE_TEST_SUITE_P(Paths, E2eLifecycleTest, ::testing::ValuesIn(kE2ePaths), PathTestName);

// Both sides raise gRPC's 4 MiB default: a 256-token update of 16 KiB tokens
// (4 MiB of K and V plus the message's own fields) and a fetch of it in one
// chunk pass.
TEST(E2eMessageSizeTest, MessagesAboveFourMiBPass) {
  std::unique_ptr<TestServer> server = TestServer::Start({.page_bytes = 1 << 20});
  ASSERT_NE(server, nullptr);
  const engine::CacheSpec spec = MakeSpec({StandardLayerSpec(16, 128)}, DType::kFloat32);
  absl::StatusOr<v1::CacheInfo> info = server->client().CreateCache(ToWireSpec(spec));
  ASSERT_TRUE(info.ok()) << info.status();
  std::mt19937_64 rng(13);
  const KvTensors kv = RandomKv(spec, 0, 256, rng);
  ASSERT_GE(kv.keys.size() + kv.values.size(), 4u << 20);  // and the fields on top
  const LayerUpdate update = MakeLayerUpdate(spec, 0, kv);
  absl::StatusOr<std::vector<v1::UpdateResponse>> acks =
      server->client().Update(info->cache_id(), {&update, 1});
  ASSERT_TRUE(acks.ok()) << acks.status();
  RefCache reference(spec);
  reference.Update(0, TokensFromTensors(ShapeOf(spec, 0), kv.keys, kv.values, 256));
  v1::FetchRequest request;
  request.set_cache_id(info->cache_id());
  request.set_max_chunk_tokens(256);
  std::vector<v1::FetchResponse> chunks;
  const absl::Status status = server->client().Fetch(request, [&](const v1::FetchResponse& chunk) {
    chunks.push_back(chunk);
    return absl::OkStatus();
  });
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(chunks.size(), 1u);
  EXPECT_TRUE(
      HistoryMatches(reference.layer(0).Fetch(), AssembleHistory(chunks), ShapeOf(spec, 0)));
  server->CleanUpAndCheck();
}

}  // namespace
}  // namespace kvcache::testing
