// The data lane's bounds on connections (service/lane/lane_limits.h) end to end:
// peers that connect and never authenticate hold at most lane_max_opening
// connections and cannot keep a tenant's worker off the lane; past
// lane_max_connections a new connection is told why; bad limits refuse the
// server's start naming the flag; the metrics count each closing.
#include <sys/socket.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/lane/data_lane.h"
#include "wire/lane/frame.h"
#include "wire/lane/frame_reader.h"
#include "wire/lane/socket.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;


// A TCP connection to host:port that sends nothing.
lane::OwnedFd ConnectSilent(const std::string& address) {
  absl::StatusOr<int> fd = lane::Connect(address, absl::Seconds(10), /*preamble=*/"");
  EXPECT_TRUE(fd.ok()) << fd.status();
  return lane::OwnedFd(fd.value_or(-1));
}

// Whether the server has closed `fd` (its read ends at once), waiting up to 2 s.
bool ClosedByServer(int fd) {
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  while (absl::Now() < deadline) {
    char byte;
    const ssize_t got = recv(fd, &byte, 1, MSG_DONTWAIT);
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

// Waits up to 2 s for the lane's counts to satisfy `done`; returns the last.
template <typename Done>
service::LaneCounts AwaitCounts(service::DataLane& lane, Done done) {
  service::LaneCounts counts = lane.Counts();
  for (int i = 0; i < 400 && !done(counts); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
    counts = lane.Counts();
  }
  return counts;
}

class E2eLaneLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("kvcached-lane-limits-" + std::to_string(std::random_device()()));
    std::filesystem::create_directories(dir_);
    std::ofstream(tokens_file()) << "tenant=alice token=" << kAlice << "\n";
  }
  void TearDown() override {
    if (server_ != nullptr) server_->CleanUpAndCheck();
    server_.reset();
    std::filesystem::remove_all(dir_);
  }

  std::string tokens_file() const { return (dir_ / "tokens").string(); }

  // A cache of the worker's, updated and fetched over the lane against the reference.
  void ExpectTheWorkerServed(Client& worker) {
    ASSERT_TRUE(worker.uses_data_lane());
    const engine::CacheSpec spec = MakeSpec({StandardLayerSpec(1, 8)});
    absl::StatusOr<v1::CacheInfo> cache = worker.CreateCache(ToWireSpec(spec));
    ASSERT_TRUE(cache.ok()) << cache.status();
    RefCache reference(spec);
    std::mt19937_64 rng(3);
    ASSERT_TRUE(StepBoth(worker, cache->cache_id(), reference, 4, rng).ok());
    EXPECT_TRUE(CacheMatchesReference(worker, cache->cache_id(), reference));
    EXPECT_TRUE(worker.DeleteCache(cache->cache_id()).ok());
  }

  std::filesystem::path dir_;
  std::unique_ptr<TestServer> server_;
};

TEST_F(E2eLaneLimitsTest, PeersThatNeverAuthenticateCannotKeepAWorkerOff) {
  constexpr int kMaxOpening = 4;
  constexpr int kSilent = 12;
  server_ = TestServer::Start({.tokens_file = tokens_file(),
                               .token = kAlice,
                               .lane_limits = {.max_opening = kMaxOpening}});
  ASSERT_NE(server_, nullptr);
  service::DataLane& lane = *server_->server().data_lane();

  // Peers that connect and send nothing, more than may be opening at once.
  std::vector<lane::OwnedFd> silent;
  for (int i = 0; i < kSilent; ++i) {
    silent.push_back(ConnectSilent(server_->server().data_lane_address()));
  }
  service::LaneCounts counts = AwaitCounts(
      lane, [](const service::LaneCounts& c) { return c.cut_displaced >= kSilent - kMaxOpening; });
  EXPECT_EQ(counts.cut_displaced, uint64_t{kSilent - kMaxOpening});
  EXPECT_EQ(counts.opening, kMaxOpening);
  EXPECT_EQ(counts.cut_opening_timeout, 0u) << "cut for room, well before their 10 s";
  // The oldest went; the newest wait for their deadline.
  for (int i = 0; i < kSilent - kMaxOpening; ++i) {
    EXPECT_TRUE(ClosedByServer(silent[i].get())) << "connection " << i;
  }
  char byte;
  EXPECT_LT(recv(silent.back().get(), &byte, 1, MSG_DONTWAIT), 0) << "still open";

  // A worker with a token gets in while they hold what they may, and stays.
  std::unique_ptr<Client> worker = server_->ConnectAs(kAlice, "auto");
  ExpectTheWorkerServed(*worker);
  counts = lane.Counts();
  EXPECT_GE(counts.open, 1);
  EXPECT_LE(counts.opening, kMaxOpening);
  // More silent peers displace each other, not the worker's open connection.
  for (int i = 0; i < kSilent; ++i) {
    silent.push_back(ConnectSilent(server_->server().data_lane_address()));
  }
  // The first fill the room left; each after cuts one.
  const uint64_t to_cut = counts.cut_displaced + kSilent - (kMaxOpening - counts.opening);
  const service::LaneCounts after = AwaitCounts(
      lane, [&](const service::LaneCounts& c) { return c.cut_displaced >= to_cut; });
  EXPECT_EQ(after.cut_displaced, to_cut);
  EXPECT_EQ(after.opening, kMaxOpening);
  ExpectTheWorkerServed(*worker);
}

// A full lane makes room by cutting a connection still opening; where all
// have opened a new one is refused, and without TLS it is told why in a
// STATUS frame that names the flag.
TEST_F(E2eLaneLimitsTest, PastMaxConnectionsOneOpeningIsCutOrTheNewOneIsToldWhy) {
  server_ = TestServer::Start({.lane_limits = {.max_connections = 2, .max_opening = 2}});
  ASSERT_NE(server_, nullptr);
  service::DataLane& lane = *server_->server().data_lane();
  std::unique_ptr<Client> first = server_->Connect(/*dedicated=*/true, "auto");
  ExpectTheWorkerServed(*first);
  ASSERT_EQ(lane.open_connections(), 1);
  lane::OwnedFd silent = ConnectSilent(server_->server().data_lane_address());
  AwaitCounts(lane, [](const service::LaneCounts& c) { return c.opening == 1; });

  std::unique_ptr<Client> second = server_->Connect(/*dedicated=*/true, "auto");
  ExpectTheWorkerServed(*second);
  EXPECT_TRUE(ClosedByServer(silent.get()));
  service::LaneCounts counts = lane.Counts();
  EXPECT_EQ(counts.cut_displaced, 1u);
  EXPECT_EQ(counts.open, 2);
  EXPECT_EQ(counts.opening, 0);

  lane::OwnedFd refused = ConnectSilent(server_->server().data_lane_address());
  lane::FrameReader reader(refused.get(), 1 << 20);
  absl::StatusOr<lane::Frame> frame = reader.Next();
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_EQ(frame->header.kind, v1::LANE_FRAME_STATUS);
  v1::LaneStatus said;
  ASSERT_TRUE(said.ParseFromArray(frame->payload.data(), static_cast<int>(frame->payload.size())));
  const absl::Status status = lane::StatusFromLane(said);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(status.message(), HasSubstr("lane_max_connections"));
  EXPECT_EQ(lane.Counts().refused_busy, 1u);
  EXPECT_TRUE(ClosedByServer(refused.get()));
  ExpectTheWorkerServed(*first);
  ExpectTheWorkerServed(*second);
}

TEST(E2eLaneLimitsStartTest, BadLimitsRefuseTheStartNamingTheFlag) {
  struct Bad {
    service::LaneLimits limits;
    const char* field;
  };
  for (const Bad& bad : {Bad{{.max_connections = 0}, "lane_max_connections"},
                         Bad{{.max_opening = 0}, "lane_max_opening"},
                         Bad{{.max_connections = 8, .max_opening = 9}, "lane_max_opening"},
                         Bad{{.opening_timeout = absl::ZeroDuration()}, "lane_opening_timeout"}}) {
    ServerConfig config;
    config.data_lane_listen = "127.0.0.1:0";
    config.lane_limits = bad.limits;
    ExpectStartRefused(config, bad.field);
  }
}

}  // namespace
}  // namespace kvcache::testing
