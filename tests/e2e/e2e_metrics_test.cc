// Operability over the wire: the Prometheus endpoint (--metrics_listen)
// counts every gRPC call by method and status code with its latency, the
// bytes of each transport per tenant, and what the pool and each tenant hold;
// the standard health service answers for the cache service by name; a
// metrics address that cannot be used stops the server from starting; every
// call has a request id (the client's when it is safe to echo) that comes
// back in its trailers and names its access-log line, in text or JSON.
#include <sys/socket.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/log.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "service_test_util.h"
#include "tools/http_get.h"
#include "wire/lane/socket.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;


// The value of `series` (name and labels as exposed: sorted by name, a
// histogram bucket's "le" last)
// in Prometheus text, or -1 when it is absent.
double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, series) || !absl::ConsumePrefix(&line, " ")) continue;
    double value = 0;
    return absl::SimpleAtod(line, &value) ? value : -2;
  }
  return -1;
}

class E2eMetricsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (server_ != nullptr) server_->CleanUpAndCheck();
    server_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  void Start(ServerSetup setup) {
    setup.metrics_listen = "127.0.0.1:0";
    server_ = TestServer::Start(setup);
    ASSERT_NE(server_, nullptr);
    ASSERT_THAT(server_->server().metrics_address(), HasSubstr("127.0.0.1:"));
  }

  std::string Scrape() {
    absl::StatusOr<std::string> text = HttpGet(server_->server().metrics_address(), "/metrics");
    EXPECT_TRUE(text.ok()) << text.status();
    return text.value_or("");
  }

  // One step of `tokens` tokens into a new two-layer cache, and its fetch.
  std::string StepAndFetch(Client& client, uint64_t tokens) {
    const engine::CacheSpec spec = MakeSpec({StandardLayerSpec(2, 8), StandardLayerSpec(2, 8)});
    absl::StatusOr<v1::CacheInfo> cache = client.CreateCache(ToWireSpec(spec));
    EXPECT_TRUE(cache.ok()) << cache.status();
    if (!cache.ok()) return "";
    RefCache reference(spec);
    std::mt19937_64 rng(5);
    EXPECT_TRUE(StepBoth(client, cache->cache_id(), reference, tokens, rng).ok());
    EXPECT_TRUE(CacheMatchesReference(client, cache->cache_id(), reference));
    return cache->cache_id();
  }

  std::unique_ptr<TestServer> server_;
  std::filesystem::path dir_;
};

TEST_F(E2eMetricsTest, CountsEveryCallByMethodAndCodeWithItsLatency) {
  ASSERT_NO_FATAL_FAILURE(Start({}));
  ASSERT_TRUE(server_->client().CreateCache(ProtoSpec(1, 2, 8)).ok());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(server_->client().GetCache("no-such-cache").status().code(),
              absl::StatusCode::kNotFound);
  }
  // A method the server does not have is counted under "unknown", so that a
  // client cannot add series.
  EXPECT_EQ(CallWithEmptyMessage(server_->server().address(), "/kvcache.v1.KvCacheService/Nope"),
            grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(CallWithEmptyMessage(server_->server().address(), "/made.Up/Method"),
            grpc::StatusCode::UNIMPLEMENTED);

  const std::string text = Scrape();
  EXPECT_EQ(Sample(text, R"(kvcached_rpc_handled_total{code="OK",method="CreateCache"})"), 1);
  EXPECT_EQ(Sample(text, R"(kvcached_rpc_handled_total{code="NOT_FOUND",method="GetCache"})"), 3);
  EXPECT_EQ(Sample(text, R"(kvcached_rpc_handled_total{code="OK",method="GetCache"})"), -1);
  EXPECT_EQ(
      Sample(text, R"(kvcached_rpc_duration_seconds_count{code="NOT_FOUND",method="GetCache"})"),
      3);
  EXPECT_EQ(
      Sample(
          text,
          R"(kvcached_rpc_duration_seconds_bucket{code="NOT_FOUND",method="GetCache",le="+Inf"})"),
      3);
  const double seconds =
      Sample(text, R"(kvcached_rpc_duration_seconds_sum{code="NOT_FOUND",method="GetCache"})");
  EXPECT_GT(seconds, 0);
  EXPECT_LT(seconds, 30);
  const double unknown =
      Sample(text, R"(kvcached_rpc_handled_total{code="UNIMPLEMENTED",method="unknown"})");
  EXPECT_EQ(unknown, 2);
  EXPECT_THAT(text, ::testing::Not(HasSubstr("Nope")));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("made.Up")));
}

TEST_F(E2eMetricsTest, BytesOfEachTransportAndWhatThePoolHolds) {
  ASSERT_NO_FATAL_FAILURE(Start({}));
  const std::string over_grpc = StepAndFetch(server_->client(), 40);
  std::unique_ptr<Client> lane_client = server_->Connect(/*dedicated=*/true, "auto");
  const std::string over_lane = StepAndFetch(*lane_client, 40);
  ASSERT_TRUE(lane_client->uses_data_lane());

  const std::string text = Scrape();
  // 40 tokens of K and V, 2 layers of 2 heads of 8 float16 each way.
  constexpr double kPayload = 2 * 40 * 2 * 8 * 2 * 2;
  for (const char* transport : {"grpc", "lane"}) {
    const std::string labels = absl::StrCat(R"({tenant="anonymous",transport=")", transport, "\"}");
    const double received = Sample(text, "kvcached_received_bytes_total" + labels);
    const double sent = Sample(text, "kvcached_sent_bytes_total" + labels);
    EXPECT_GE(received, kPayload) << transport;
    EXPECT_LT(received, 4 * kPayload) << transport;
    EXPECT_GE(sent, kPayload) << transport;
    EXPECT_LT(sent, 4 * kPayload) << transport;
  }
  EXPECT_EQ(Sample(text, R"(kvcached_caches{tenant="anonymous"})"), 2);
  EXPECT_EQ(Sample(text, R"(kvcached_lane_connections_total{tenant="anonymous"})"), 1);
  EXPECT_EQ(Sample(text, R"(kvcached_lane_connections{tenant="anonymous"})"), 1);
  const gpu::PoolStats pool = server_->server().pool().stats();
  EXPECT_EQ(Sample(text, R"(kvcached_tier_pages{tier="device"})"), pool.used_pages);
  EXPECT_GT(pool.used_pages, 0u);
  EXPECT_EQ(Sample(text, R"(kvcached_tier_bytes_capacity{tier="device"})"),
            double(pool.max_pages) * pool.page_bytes);

  lane_client.reset();  // its connection closes: the gauge goes back to 0
  server_->client().DeleteCache(over_lane).IgnoreError();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::string after = Scrape();
  while (Sample(after, R"(kvcached_lane_connections{tenant="anonymous"})") != 0 &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
    after = Scrape();
  }
  EXPECT_EQ(Sample(after, R"(kvcached_lane_connections{tenant="anonymous"})"), 0);
  EXPECT_EQ(Sample(after, R"(kvcached_caches{tenant="anonymous"})"), 1);
}

// Connections that never open show as the lane's, not any tenant's: the
// ones opening now, and those cut or refused by reason.
TEST_F(E2eMetricsTest, TheLaneCountsConnectionsThatDidNotOpen) {
  ASSERT_NO_FATAL_FAILURE(Start({.lane_limits = {.max_connections = 3,
                                                 .max_opening = 2,
                                                 .opening_timeout = absl::Seconds(2)}}));
  std::string text = Scrape();
  EXPECT_EQ(Sample(text, "kvcached_lane_connections_opening"), 0);
  for (const char* reason : {"busy", "opening_timeout", "displaced"}) {
    EXPECT_EQ(Sample(text, absl::StrCat(R"(kvcached_lane_connections_refused_total{reason=")",
                                        reason, "\"}")),
              0)
        << reason;
  }
  // Three that send nothing: one is cut for room, two wait out their 2 s.
  std::vector<lane::OwnedFd> silent;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<int> fd = lane::Connect(server_->server().data_lane_address(),
                                           absl::Seconds(5), /*preamble=*/"");
    ASSERT_TRUE(fd.ok()) << fd.status();
    silent.emplace_back(*fd);
  }
  for (int i = 0; i < 200 && (Sample(text, "kvcached_lane_connections_opening") != 2 ||
                              Sample(text, R"(kvcached_lane_connections_refused_total{reason="displaced"})") != 1);
       ++i) {
    absl::SleepFor(absl::Milliseconds(5));
    text = Scrape();
  }
  EXPECT_EQ(Sample(text, "kvcached_lane_connections_opening"), 2);
  EXPECT_EQ(Sample(text, R"(kvcached_lane_connections_refused_total{reason="displaced"})"), 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (Sample(text, R"(kvcached_lane_connections_refused_total{reason="opening_timeout"})") <
             2 &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
    text = Scrape();
  }
  EXPECT_EQ(Sample(text, R"(kvcached_lane_connections_refused_total{reason="opening_timeout"})"),
            2);
  EXPECT_EQ(Sample(text, "kvcached_lane_connections_opening"), 0);
  EXPECT_EQ(Sample(text, R"(kvcached_lane_connections_refused_total{reason="busy"})"), 0);
}

TEST_F(E2eMetricsTest, EachTenantHasItsOwnSeries) {
  dir_ = std::filesystem::path(::testing::TempDir()) /
         ("kvcached-metrics-" + std::to_string(std::random_device()()));
  std::filesystem::create_directories(dir_);
  const std::string tokens = (dir_ / "tokens").string();
  std::ofstream(tokens) << "tenant=alice token=" << kAlice << "\ntenant=bob token=" << kBob << "\n";
  ASSERT_NO_FATAL_FAILURE(Start({.tokens_file = tokens, .token = kAlice}));
  std::unique_ptr<Client> bob = server_->ConnectAs(kBob);
  ASSERT_TRUE(server_->client().CreateCache(ProtoSpec(1, 2, 8)).ok());
  ASSERT_TRUE(server_->client().CreateCache(ProtoSpec(1, 2, 8)).ok());
  absl::StatusOr<v1::CacheInfo> bobs = bob->CreateCache(ProtoSpec(1, 2, 8));
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_EQ(
      CallWithEmptyMessage(server_->server().address(), "/kvcache.v1.KvCacheService/GetStats"),
      grpc::StatusCode::UNAUTHENTICATED);

  const std::string text = Scrape();
  EXPECT_EQ(Sample(text, R"(kvcached_caches{tenant="alice"})"), 2);
  EXPECT_EQ(Sample(text, R"(kvcached_caches{tenant="bob"})"), 1);
  EXPECT_EQ(Sample(text, R"(kvcached_calls_admitted_total{tenant="bob"})"), 1);
  EXPECT_EQ(Sample(text, R"(kvcached_rpc_handled_total{code="UNAUTHENTICATED",method="GetStats"})"),
            1);
  EXPECT_EQ(Sample(text, R"(kvcached_caches{tenant="anonymous"})"), -1);
  EXPECT_THAT(text, ::testing::Not(HasSubstr(kAlice)));
  EXPECT_THAT(text, ::testing::Not(HasSubstr(bobs->cache_id())));
  EXPECT_TRUE(bob->DeleteCache(bobs->cache_id()).ok());
}

TEST_F(E2eMetricsTest, HealthAnswersForTheCacheServiceByName) {
  ASSERT_NO_FATAL_FAILURE(Start({}));
  for (const char* service : {"kvcache.v1.KvCacheService", ""}) {
    absl::StatusOr<bool> serving = server_->client().Serving(service);
    ASSERT_TRUE(serving.ok()) << serving.status();
    EXPECT_TRUE(*serving) << service;
  }
  EXPECT_EQ(server_->client().Serving("no.Such").status().code(), absl::StatusCode::kNotFound);
  const std::string text = Scrape();
  EXPECT_EQ(
      Sample(text, R"(kvcached_rpc_handled_total{code="OK",method="grpc.health.v1.Health/Check"})"),
      2);
  EXPECT_EQ(
      Sample(
          text,
          R"(kvcached_rpc_handled_total{code="NOT_FOUND",method="grpc.health.v1.Health/Check"})"),
      1);
  // Only /metrics answers.
  EXPECT_EQ(HttpGet(server_->server().metrics_address(), "/other").status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(E2eMetricsTest, AMetricsAddressThatCannotBeUsedStopsTheStart) {
  int port = 0;
  absl::StatusOr<int> taken = lane::Listen("127.0.0.1:0", port);
  ASSERT_TRUE(taken.ok()) << taken.status();
  lane::OwnedFd holder(*taken);
  ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.pool.budget_bytes = 8 << 20;
  config.metrics_listen = absl::StrCat("127.0.0.1:", port);
  absl::StatusOr<std::unique_ptr<KvCacheServer>> server = KvCacheServer::Start(config);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable) << server.status();
  EXPECT_THAT(server.status().message(), HasSubstr("metrics_listen"));
  config.metrics_listen = "no-port";
  server = KvCacheServer::Start(config);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
  EXPECT_THAT(server.status().message(), HasSubstr("metrics_listen"));
}

// GetStats through the generated stub with `request_id` as x-request-id
// (none when empty); the id the server sent back.
std::string GetStatsWithRequestId(Client& client, const std::string& request_id) {
  grpc::ClientContext context;
  if (!request_id.empty()) context.AddMetadata("x-request-id", request_id);
  v1::Stats stats;
  const grpc::Status status = client.stub().GetStats(&context, v1::GetStatsRequest(), &stats);
  EXPECT_TRUE(status.ok()) << status.error_message();
  const auto found = context.GetServerTrailingMetadata().find("x-request-id");
  if (found == context.GetServerTrailingMetadata().end()) return "";
  return std::string(found->second.data(), found->second.size());
}

std::vector<std::string> LinesWith(const std::string& text, absl::string_view part) {
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StrContains(line, part)) lines.emplace_back(line);
  }
  return lines;
}

TEST_F(E2eMetricsTest, RequestIdsComeBackAndNameTheAccessLogLine) {
  server_ = TestServer::Start({.access_log = true});
  ASSERT_NE(server_, nullptr);
  ::testing::internal::CaptureStderr();
  const std::string echoed = GetStatsWithRequestId(server_->client(), "worker-7.req:42");
  // Printable (gRPC refuses others on the client) but spaces and quotes.
  const std::string unsafe = std::string("bad id \"quoted\" ") + std::string(80, 'x');
  const std::string replaced = GetStatsWithRequestId(server_->client(), unsafe);
  const std::string made = GetStatsWithRequestId(server_->client(), "");
  const std::string log = ::testing::internal::GetCapturedStderr();

  EXPECT_EQ(echoed, "worker-7.req:42");
  for (const std::string& id : {replaced, made}) {
    EXPECT_THAT(id, ::testing::MatchesRegex("[0-9a-f]{16}"));
  }
  EXPECT_NE(replaced, made);
  const std::vector<std::string> lines = LinesWith(log, "] rpc ");
  ASSERT_EQ(lines.size(), 3u) << log;
  EXPECT_THAT(lines[0], HasSubstr("rpc request_id=worker-7.req:42 method=GetStats code=OK "));
  EXPECT_THAT(lines[0], ::testing::ContainsRegex("duration_ms=[0-9]+\\.[0-9]{3} peer=ipv4:127"));
  EXPECT_THAT(lines[1], HasSubstr("request_id=" + replaced));
  EXPECT_THAT(log, ::testing::Not(HasSubstr("bad id")));
}

TEST_F(E2eMetricsTest, JsonLogLinesAreOneObjectEach) {
  server_ = TestServer::Start({.access_log = true});
  ASSERT_NE(server_, nullptr);
  SetLogFormat(LogFormat::kJson);
  ::testing::internal::CaptureStderr();
  GetStatsWithRequestId(server_->client(), "json-1");
  EXPECT_EQ(server_->client().GetCache("no-such-cache").status().code(),
            absl::StatusCode::kNotFound);
  const std::string log = ::testing::internal::GetCapturedStderr();
  SetLogFormat(LogFormat::kText);

  int rpcs = 0;
  for (const std::string& line : LinesWith(log, "\"event\":\"rpc\"")) {
    const nlohmann::json object = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(object.is_object()) << line;
    EXPECT_EQ(object["level"], "info");
    EXPECT_TRUE(object["time"].is_string());
    if (object["method"] == "GetStats") {
      EXPECT_EQ(object["request_id"], "json-1");
      EXPECT_EQ(object["code"], "OK");
    } else {
      EXPECT_EQ(object["method"], "GetCache");
      EXPECT_EQ(object["code"], "NOT_FOUND");
    }
    ++rpcs;
  }
  EXPECT_EQ(rpcs, 2) << log;
}

TEST_F(E2eMetricsTest, NoAccessLogUnlessAskedFor) {
  ASSERT_NO_FATAL_FAILURE(Start({}));
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(GetStatsWithRequestId(server_->client(), "quiet-1"), "quiet-1");
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, ::testing::Not(HasSubstr("quiet-1")));
}

}  // namespace
}  // namespace kvcache::testing
