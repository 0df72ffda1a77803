// Connections whose peer went away, and connections that never speak
// (ServerConfig::keepalive, grpc_handshake_timeout): a worker whose host
// vanished mid-stream is dropped by the server's pings, its stream ends and
// its tenant's in-flight quota comes back, keeping what was acknowledged; a
// TCP connection that never sends HTTP/2 is closed after the handshake
// timeout; one connection's calls past grpc_max_streams_per_connection wait
// for one of its others to end; bad values refuse the start naming the flag.
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "loopback_proxy.h"
#include "wire/lane/socket.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;


class E2eKeepaliveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("kvcached-keepalive-" + std::to_string(std::random_device()()));
    std::filesystem::create_directories(dir_);
    std::ofstream(tokens_file()) << "tenant=alice token=" << kAlice
                                 << " max_requests_in_flight=1\n";
  }
  void TearDown() override {
    if (server_ != nullptr) server_->CleanUpAndCheck();
    server_.reset();
    std::filesystem::remove_all(dir_);
  }
  std::string tokens_file() const { return (dir_ / "tokens").string(); }

  std::filesystem::path dir_;
  std::unique_ptr<TestServer> server_;
};

TEST_F(E2eKeepaliveTest, AWorkerWhoseHostWentAwayIsDroppedAndItsQuotaComesBack) {
  server_ = TestServer::Start(
      {.tokens_file = tokens_file(),
       .token = kAlice,
       .keepalive = {.time = absl::Milliseconds(500), .timeout = absl::Milliseconds(500)}});
  ASSERT_NE(server_, nullptr);
  Client& alice = server_->client();
  const engine::CacheSpec spec = MakeSpec({StandardLayerSpec(1, 8)});
  absl::StatusOr<v1::CacheInfo> cache = alice.CreateCache(ToWireSpec(spec));
  ASSERT_TRUE(cache.ok()) << cache.status();

  // The worker's stream, through a link that will go silent, holds alice's one call.
  std::unique_ptr<LoopbackProxy> proxy = LoopbackProxy::Start(server_->server().port());
  ASSERT_NE(proxy, nullptr);
  std::unique_ptr<Client> worker = Client::Connect({.address = proxy->address(),
                                                    .deadline = absl::Seconds(60),
                                                    .dedicated_connection = true,
                                                    .token = kAlice});
  std::unique_ptr<UpdateStream> stream = worker->OpenUpdate(cache->cache_id());
  RefCache reference(spec);
  std::mt19937_64 rng(7);
  const KvTensors kv = RandomKv(spec, 0, 3, rng);
  ASSERT_TRUE(stream->Write(MakeLayerUpdate(spec, 0, kv)));
  for (int i = 0; i < 500 && stream->acknowledged_count() < 1; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(stream->acknowledged_count(), 1u);
  reference.Update(0, TokensFromTensors(ShapeOf(spec, 0), kv.keys, kv.values, 3));
  const absl::Status busy = alice.GetStats().status();
  EXPECT_EQ(busy.code(), absl::StatusCode::kResourceExhausted) << busy;
  EXPECT_THAT(busy.message(), HasSubstr("max_requests_in_flight"));

  // The worker's host goes away: nothing closes the connection, nothing answers.
  proxy->Freeze();
  const absl::Time frozen = absl::Now();
  absl::Status admitted = busy;
  while (!admitted.ok() && absl::Now() - frozen < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(50));
    admitted = alice.GetStats().status();
  }
  ASSERT_TRUE(admitted.ok()) << "the dead worker's stream still holds the quota: " << admitted;
  // Pinged after 0.5 s of silence, closed 0.5 s later.
  EXPECT_GE(absl::Now() - frozen, absl::Milliseconds(500));
  EXPECT_LT(absl::Now() - frozen, absl::Seconds(5));
  EXPECT_TRUE(CacheMatchesReference(alice, cache->cache_id(), reference))
      << "what was acknowledged stays";
  proxy.reset();  // the worker's end is cut
  EXPECT_FALSE(stream->Finish().ok());
  EXPECT_TRUE(alice.DeleteCache(cache->cache_id()).ok());
}

TEST_F(E2eKeepaliveTest, AClientNoticesThatItsServerWentAwayWithoutMakingACall) {
  server_ = TestServer::Start(
      {.data_lane = false,
       .keepalive = {.time = absl::Milliseconds(500), .timeout = absl::Milliseconds(500)}});
  ASSERT_NE(server_, nullptr);
  std::unique_ptr<LoopbackProxy> proxy = LoopbackProxy::Start(server_->server().port());
  ASSERT_NE(proxy, nullptr);
  std::unique_ptr<Client> pinging = Client::Connect({.address = proxy->address(),
                                                     .dedicated_connection = true,
                                                     .keepalive_time = absl::Seconds(1),
                                                     .keepalive_timeout = absl::Milliseconds(500)});
  std::unique_ptr<Client> silent = Client::Connect({.address = proxy->address(),
                                                    .dedicated_connection = true,
                                                    .keepalive_time = absl::ZeroDuration()});
  ASSERT_TRUE(pinging->GetStats().ok());
  ASSERT_TRUE(silent->GetStats().ok());
  // Idle pings the server answers keep the connection (it allows them this often).
  absl::SleepFor(absl::Milliseconds(2500));
  ASSERT_EQ(pinging->channel()->GetState(false), GRPC_CHANNEL_READY);

  // The server's host goes away: no reset, no answer.
  proxy->Freeze();
  const absl::Time frozen = absl::Now();
  while (pinging->channel()->GetState(false) == GRPC_CHANNEL_READY &&
         absl::Now() - frozen < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  const absl::Duration noticed_after = absl::Now() - frozen;
  EXPECT_NE(pinging->channel()->GetState(false), GRPC_CHANNEL_READY)
      << "a client that pings did not notice in 10 s";
  // Pinged within 1 s of the last bytes, dropped 0.5 s later.
  EXPECT_GE(noticed_after, absl::Milliseconds(400));
  EXPECT_LT(noticed_after, absl::Seconds(5));
  // One without pings has nothing to tell it.
  EXPECT_EQ(silent->channel()->GetState(false), GRPC_CHANNEL_READY);
}

TEST(E2eKeepaliveClientTest, KeepaliveValuesTheKernelCannotTakeRefuseEachLaneConnection) {
  std::unique_ptr<TestServer> server = TestServer::Start({});
  ASSERT_NE(server, nullptr);
  const engine::CacheSpec spec = MakeSpec({StandardLayerSpec(1, 8)});
  absl::StatusOr<v1::CacheInfo> cache = server->client().CreateCache(ToWireSpec(spec));
  ASSERT_TRUE(cache.ok()) << cache.status();
  std::unique_ptr<Client> bad = Client::Connect({.address = server->server().address(),
                                                 .data_lane = server->server().data_lane_address(),
                                                 .keepalive_time = absl::Seconds(40000)});
  v1::FetchRequest fetch;
  fetch.set_cache_id(cache->cache_id());
  const absl::Status fetched = bad->FetchAll(fetch).status();
  EXPECT_EQ(fetched.code(), absl::StatusCode::kInvalidArgument) << fetched;
  EXPECT_THAT(fetched.message(), HasSubstr("keepalive_time"));
  EXPECT_TRUE(bad->GetStats().ok());  // gRPC takes them
  ASSERT_TRUE(server->client().DeleteCache(cache->cache_id()).ok());
  server->CleanUpAndCheck();
}

TEST_F(E2eKeepaliveTest, AConnectionThatNeverSpeaksHttp2IsClosedAfterTheHandshakeTimeout) {
  server_ = TestServer::Start({.grpc_handshake_timeout = absl::Milliseconds(500)});
  ASSERT_NE(server_, nullptr);
  absl::StatusOr<int> fd =
      lane::Connect(server_->server().address(), absl::Seconds(5), /*preamble=*/"");
  ASSERT_TRUE(fd.ok()) << fd.status();
  lane::OwnedFd silent(*fd);
  const absl::Time start = absl::Now();
  // The server's own SETTINGS come at once; then nothing until it closes.
  char bytes[256];
  ssize_t got;
  while ((got = recv(silent.get(), bytes, sizeof(bytes), 0)) > 0) {
  }
  const absl::Duration closed_after = absl::Now() - start;
  EXPECT_TRUE(got == 0 || errno == ECONNRESET) << "not closed within the socket's 5 s";
  EXPECT_GE(closed_after, absl::Milliseconds(400));
  EXPECT_LT(closed_after, absl::Seconds(4));
  // The server serves on.
  EXPECT_TRUE(server_->client().GetStats().ok());
}

TEST(E2eStreamLimitTest, ACallPastItsConnectionsStreamLimitWaitsForAnotherToEnd) {
  std::unique_ptr<TestServer> server =
      TestServer::Start({.data_lane = false, .grpc_max_streams_per_connection = 2});
  ASSERT_NE(server, nullptr);
  std::unique_ptr<Client> client = server->ConnectTo(server->server().address());
  ASSERT_TRUE(client->GetStats().ok());  // connected: the server's settings are known
  const auto stats_within = [&](absl::Duration wait) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + wait));
    v1::Stats stats;
    return client->stub().GetStats(&context, v1::GetStatsRequest(), &stats).error_code();
  };
  grpc::ClientContext first_context, second_context;
  auto first = client->stub().Update(&first_context);
  auto second = client->stub().Update(&second_context);
  // Neither writes: each stays open, waiting for its first message.
  EXPECT_EQ(stats_within(absl::Milliseconds(500)), grpc::StatusCode::DEADLINE_EXCEEDED);
  // Another connection is not held back by this one's streams.
  EXPECT_TRUE(server->client().GetStats().ok());
  EXPECT_TRUE(second->WritesDone());
  EXPECT_TRUE(second->Finish().ok());
  EXPECT_EQ(stats_within(absl::Seconds(5)), grpc::StatusCode::OK);
  EXPECT_TRUE(first->WritesDone());
  EXPECT_TRUE(first->Finish().ok());
  client.reset();
  server->CleanUpAndCheck();
}

TEST(E2eKeepaliveStartTest, BadValuesRefuseTheStartNamingTheFlag) {
  struct Bad {
    lane::Keepalive keepalive;
    absl::Duration handshake;
    const char* field;
  };
  for (const Bad& bad :
       {Bad{{.time = absl::ZeroDuration()}, absl::Seconds(1), "keepalive_time"},
        Bad{{.timeout = absl::Seconds(-1)}, absl::Seconds(1), "keepalive_timeout"},
        Bad{{}, absl::ZeroDuration(), "grpc_handshake_timeout"}}) {
    ServerConfig config;
    config.keepalive = bad.keepalive;
    config.grpc_handshake_timeout = bad.handshake;
    ExpectStartRefused(config, bad.field);
  }
  ServerConfig no_streams;
  no_streams.grpc_max_streams_per_connection = 0;
  ExpectStartRefused(no_streams, "grpc_max_streams_per_connection");
}

}  // namespace
}  // namespace kvcache::testing
