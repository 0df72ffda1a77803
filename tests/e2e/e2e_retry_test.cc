// A retried call is answered once, end to end: the client stamps each call
// that changes something with a fresh request_id and retries UNAVAILABLE with
// it (gRPC's retry policy); a proxy in front of kvcached throws away the
// server's answers, as a connection that drops after the server did the work;
// the server answers the retry from its request log. So a lost answer never
// makes a second cache or trims twice. Tenants' ids never meet.
#include <grpcpp/grpcpp.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service_test_util.h"
#include "tools/http_get.h"

namespace kvcache::testing {
namespace {

using ::testing::Each;
using ::testing::SizeIs;
using Code = absl::StatusCode;

// Forwards CreateCache, Trim and ImportSnapshot to kvcached; while answers
// are to be lost, drops the answer of each that the server did and says
// UNAVAILABLE instead.
class AnswerLosingProxy final : public v1::KvCacheService::Service {
 public:
  explicit AnswerLosingProxy(const std::string& backend)
      : backend_(v1::KvCacheService::NewStub(
            grpc::CreateChannel(backend, grpc::InsecureChannelCredentials()))) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~AnswerLosingProxy() override { server_->Shutdown(); }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  void LoseAnswers(int count) {
    absl::MutexLock lock(&mutex_);
    answers_to_lose_ = count;
  }
  // The request_id of every request that reached the proxy, in order.
  std::vector<std::string> ids_seen() {
    absl::MutexLock lock(&mutex_);
    return ids_seen_;
  }

  grpc::Status CreateCache(grpc::ServerContext*, const v1::CreateCacheRequest* request,
                           v1::CacheInfo* response) override {
    return Forward(request->request_id(), [&](grpc::ClientContext* context) {
      return backend_->CreateCache(context, *request, response);
    });
  }
  grpc::Status Trim(grpc::ServerContext*, const v1::TrimRequest* request,
                    v1::TrimResponse* response) override {
    return Forward(request->request_id(), [&](grpc::ClientContext* context) {
      return backend_->Trim(context, *request, response);
    });
  }
  grpc::Status ImportSnapshot(grpc::ServerContext*,
                              grpc::ServerReader<v1::ImportSnapshotRequest>* reader,
                              v1::LoadSnapshotResponse* response) override {
    v1::ImportSnapshotRequest message;
    std::vector<v1::ImportSnapshotRequest> messages;
    while (reader->Read(&message)) messages.push_back(message);
    if (messages.empty()) return grpc::Status(grpc::StatusCode::INTERNAL, "no message");
    return Forward(messages.front().request_id(), [&](grpc::ClientContext* context) {
      std::unique_ptr<grpc::ClientWriter<v1::ImportSnapshotRequest>> writer =
          backend_->ImportSnapshot(context, response);
      for (const v1::ImportSnapshotRequest& each : messages) {
        if (!writer->Write(each)) break;
      }
      writer->WritesDone();
      return writer->Finish();
    });
  }

 private:
  template <typename Call>
  grpc::Status Forward(const std::string& request_id, Call call) {
    {
      absl::MutexLock lock(&mutex_);
      ids_seen_.push_back(request_id);
    }
    grpc::ClientContext context;
    const grpc::Status status = call(&context);
    absl::MutexLock lock(&mutex_);
    if (status.ok() && answers_to_lose_ > 0) {
      --answers_to_lose_;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the answer was lost on the way");
    }
    return status;
  }

  std::unique_ptr<v1::KvCacheService::Stub> backend_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  absl::Mutex mutex_;
  int answers_to_lose_ ABSL_GUARDED_BY(mutex_) = 0;
  std::vector<std::string> ids_seen_ ABSL_GUARDED_BY(mutex_);
};

engine::CacheSpec TwoLayers() {
  return MakeSpec({StandardLayerSpec(2, 8), StandardLayerSpec(2, 8)});
}

class E2eRetryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = TestServer::Start({.data_lane = false, .metrics_listen = "127.0.0.1:0"});
    ASSERT_NE(server_, nullptr);
    proxy_ = std::make_unique<AnswerLosingProxy>(server_->server().address());
    through_proxy_ = server_->ConnectTo(proxy_->address());
  }
  void TearDown() override {
    through_proxy_.reset();
    proxy_.reset();
    if (server_ != nullptr) server_->CleanUpAndCheck();
  }

  size_t CachesOnServer() {
    absl::StatusOr<std::vector<v1::CacheInfo>> caches = server_->client().ListCaches();
    EXPECT_TRUE(caches.ok()) << caches.status();
    return caches.ok() ? caches->size() : 0;
  }

  std::unique_ptr<TestServer> server_;
  std::unique_ptr<AnswerLosingProxy> proxy_;
  std::unique_ptr<Client> through_proxy_;
};

TEST_F(E2eRetryTest, ALostCreateAnswerIsRetriedAndMakesOneCache) {
  proxy_->LoseAnswers(1);
  const absl::StatusOr<v1::CacheInfo> cache = through_proxy_->CreateCache(ToWireSpec(TwoLayers()));
  ASSERT_TRUE(cache.ok()) << cache.status();
  const std::vector<std::string> ids = proxy_->ids_seen();
  ASSERT_THAT(ids, SizeIs(2));
  EXPECT_EQ(ids[0].size(), 32u);
  EXPECT_EQ(ids[1], ids[0]);
  const absl::StatusOr<std::vector<v1::CacheInfo>> caches = server_->client().ListCaches();
  ASSERT_TRUE(caches.ok()) << caches.status();
  ASSERT_THAT(*caches, SizeIs(1));
  EXPECT_EQ(caches->front().cache_id(), cache->cache_id());
  const absl::StatusOr<v1::Stats> stats = server_->client().GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->requests_replayed(), 1u);
  EXPECT_EQ(stats->request_log_entries(), 1u);
  const absl::StatusOr<std::string> metrics =
      HttpGet(server_->server().metrics_address(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_TRUE(absl::StrContains(*metrics, "kvcached_requests_replayed_total{tenant=\"anonymous\"} 1"))
      << *metrics;
}

TEST_F(E2eRetryTest, ALostTrimAnswerDropsItsTokensOnce) {
  absl::StatusOr<v1::CacheInfo> cache = server_->client().CreateCache(ToWireSpec(TwoLayers()));
  ASSERT_TRUE(cache.ok()) << cache.status();
  RefCache reference(TwoLayers());
  std::mt19937_64 rng(7);
  ASSERT_TRUE(StepBoth(server_->client(), cache->cache_id(), reference, 10, rng).ok());
  proxy_->LoseAnswers(2);
  const absl::StatusOr<v1::TrimResponse> trimmed = through_proxy_->Trim(cache->cache_id(), 3);
  ASSERT_TRUE(trimmed.ok()) << trimmed.status();
  EXPECT_EQ(trimmed->trimmed(), 3u);
  EXPECT_THAT(proxy_->ids_seen(), SizeIs(3));
  ASSERT_EQ(reference.Trim(3), 3u);
  EXPECT_TRUE(CacheMatchesReference(server_->client(), cache->cache_id(), reference));
}

TEST_F(E2eRetryTest, EachCallCarriesAnIdOfItsOwn) {
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(through_proxy_->CreateCache(ToWireSpec(TwoLayers())).ok());
  const std::vector<std::string> ids = proxy_->ids_seen();
  ASSERT_THAT(ids, SizeIs(3));
  EXPECT_NE(ids[0], ids[1]);
  EXPECT_NE(ids[1], ids[2]);
  EXPECT_NE(ids[0], ids[2]);
  EXPECT_EQ(CachesOnServer(), 3u);
}

TEST_F(E2eRetryTest, WhenEveryAnswerIsLostTheCallFailsAfterItsAttemptsHavingMadeOneCache) {
  proxy_->LoseAnswers(100);
  const absl::StatusOr<v1::CacheInfo> cache = through_proxy_->CreateCache(ToWireSpec(TwoLayers()));
  EXPECT_EQ(cache.status().code(), Code::kUnavailable);
  const std::vector<std::string> ids = proxy_->ids_seen();
  ASSERT_THAT(ids, SizeIs(4));  // the client's policy: four attempts
  EXPECT_THAT(ids, Each(ids[0]));
  EXPECT_EQ(CachesOnServer(), 1u);  // made once; the caller may find it by listing
}

// A file of a snapshot of a cache with a few tokens, and that snapshot's id.
std::pair<std::string, std::string> ExportedFile(Client& client) {
  absl::StatusOr<v1::CacheInfo> cache = client.CreateCache(ToWireSpec(TwoLayers()));
  EXPECT_TRUE(cache.ok()) << cache.status();
  RefCache reference(TwoLayers());
  std::mt19937_64 rng(11);
  EXPECT_TRUE(StepBoth(client, cache->cache_id(), reference, 6, rng).ok());
  absl::StatusOr<v1::SnapshotInfo> snapshot = client.Snapshot(cache->cache_id());
  EXPECT_TRUE(snapshot.ok()) << snapshot.status();
  EXPECT_TRUE(client.DeleteCache(cache->cache_id()).ok());
  v1::ExportSnapshotRequest request;
  request.set_snapshot_id(snapshot->snapshot_id());
  absl::StatusOr<std::string> file = client.ExportSnapshot(request);
  EXPECT_TRUE(file.ok()) << file.status();
  return {file.value_or(""), snapshot->snapshot_id()};
}

size_t SnapshotsOn(Client& client) {
  absl::StatusOr<std::vector<v1::SnapshotInfo>> snapshots = client.ListSnapshots();
  EXPECT_TRUE(snapshots.ok()) << snapshots.status();
  return snapshots.ok() ? snapshots->size() : 0;
}

// After two lost answers of an import: three attempts under one id, one
// snapshot imported beside `exported`, two answers replayed; releases both.
void ExpectImportedOnce(TestServer& server, AnswerLosingProxy& proxy,
                        const absl::StatusOr<v1::LoadSnapshotResponse>& imported,
                        const std::string& exported) {
  ASSERT_TRUE(imported.ok()) << imported.status();
  const std::vector<std::string> ids = proxy.ids_seen();
  ASSERT_THAT(ids, SizeIs(3));
  EXPECT_EQ(ids[0].size(), 32u);
  EXPECT_THAT(ids, Each(ids[0]));
  EXPECT_EQ(SnapshotsOn(server.client()), 2u);  // the exported one and one import
  const absl::StatusOr<v1::Stats> stats = server.client().GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->requests_replayed(), 2u);
  ASSERT_TRUE(server.client().ReleaseSnapshot(imported->snapshot().snapshot_id()).ok());
  ASSERT_TRUE(server.client().ReleaseSnapshot(exported).ok());
}

TEST_F(E2eRetryTest, ALostImportAnswerIsSentAgainAndMakesOneSnapshot) {
  const auto [file, exported] = ExportedFile(server_->client());
  proxy_->LoseAnswers(2);
  ExpectImportedOnce(*server_, *proxy_, through_proxy_->ImportSnapshot(file), exported);
}

// A copy streams the export into the import again from the start, with the
// import's first request_id.
TEST_F(E2eRetryTest, ACopyWhoseImportAnswerIsLostRunsAgainAndMakesOneSnapshot) {
  const auto [file, exported] = ExportedFile(server_->client());
  proxy_->LoseAnswers(2);
  v1::ExportSnapshotRequest request;
  request.set_snapshot_id(exported);
  ExpectImportedOnce(*server_, *proxy_, CopySnapshot(server_->client(), request, *through_proxy_, {}),
                     exported);
}

TEST_F(E2eRetryTest, AnImportsIdNamesItsBytesAndOptions) {
  const auto [file, exported] = ExportedFile(server_->client());
  v1::ImportSnapshotRequest options;
  options.set_request_id("import-1");
  absl::StatusOr<v1::LoadSnapshotResponse> first = server_->client().ImportSnapshot(file, options);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<v1::LoadSnapshotResponse> again = server_->client().ImportSnapshot(file, options);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->snapshot().snapshot_id(), first->snapshot().snapshot_id());
  std::string other_bytes = file;
  other_bytes.back() ^= 1;  // the same length, another file
  const absl::StatusOr<v1::LoadSnapshotResponse> other =
      server_->client().ImportSnapshot(other_bytes, options);
  EXPECT_EQ(other.status().code(), Code::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(other.status().message(), "request_id")) << other.status();
  v1::ImportSnapshotRequest pinned = options;
  pinned.set_pinned(true);
  const absl::StatusOr<v1::LoadSnapshotResponse> other_options =
      server_->client().ImportSnapshot(file, pinned);
  EXPECT_EQ(other_options.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(SnapshotsOn(server_->client()), 2u);  // neither refusal made one
  ASSERT_TRUE(server_->client().ReleaseSnapshot(first->snapshot().snapshot_id()).ok());
  ASSERT_TRUE(server_->client().ReleaseSnapshot(exported).ok());
}

TEST_F(E2eRetryTest, AFailedImportRunsAgainWhenSentAgain) {
  const auto [file, exported] = ExportedFile(server_->client());
  v1::ImportSnapshotRequest options;
  options.set_request_id("import-2");
  const absl::StatusOr<v1::LoadSnapshotResponse> truncated =
      server_->client().ImportSnapshot(absl::string_view(file).substr(0, file.size() / 2), options);
  EXPECT_EQ(truncated.status().code(), Code::kDataLoss) << truncated.status();
  EXPECT_EQ(SnapshotsOn(server_->client()), 1u);
  // Only successes are kept, so the id is free for the whole file.
  const absl::StatusOr<v1::LoadSnapshotResponse> whole =
      server_->client().ImportSnapshot(file, options);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(SnapshotsOn(server_->client()), 2u);
  ASSERT_TRUE(server_->client().ReleaseSnapshot(whole->snapshot().snapshot_id()).ok());
  ASSERT_TRUE(server_->client().ReleaseSnapshot(exported).ok());
}


TEST(E2eRetryTenantsTest, TenantsUsingTheSameIdGetTheirOwnAnswers) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    ("kvcached-retry-" + std::to_string(std::random_device()()));
  std::filesystem::create_directories(dir);
  const std::string tokens = (dir / "tokens").string();
  std::ofstream(tokens) << "tenant=alice token=" << kAlice << "\ntenant=bob token=" << kBob
                        << "\n";
  std::unique_ptr<TestServer> server =
      TestServer::Start({.data_lane = false, .tokens_file = tokens, .token = kAlice});
  ASSERT_NE(server, nullptr);
  std::unique_ptr<Client> bob = server->ConnectAs(kBob);
  v1::CreateCacheRequest request;
  *request.mutable_spec() = ToWireSpec(TwoLayers());
  request.set_request_id("the-same-id");
  const auto create = [&](Client& client) {
    grpc::ClientContext context;
    v1::CacheInfo info;
    const grpc::Status status = client.stub().CreateCache(&context, request, &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info.cache_id();
  };
  const std::string alices = create(server->client());
  const std::string bobs = create(*bob);
  EXPECT_NE(alices, bobs);
  EXPECT_EQ(create(*bob), bobs);  // bob's own retry is replayed
  EXPECT_EQ(server->client().GetCache(bobs).status().code(), Code::kNotFound);
  const absl::StatusOr<v1::Stats> alice_stats = server->client().GetStats();
  ASSERT_TRUE(alice_stats.ok()) << alice_stats.status();
  EXPECT_EQ(alice_stats->requests_replayed(), 0u);
  ASSERT_TRUE(bob->DeleteCache(bobs).ok());
  bob.reset();
  server->CleanUpAndCheck();
  server.reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvcache::testing
