// A reload of the tokens file reaches what is under way (service/tenants.h):
// a token dropped or moved to another tenant gets nothing more on either
// transport from that moment, not the next message of an open Update stream,
// not the next chunk of a Fetch, not another frame of a lane connection
// (which is then closed); nothing it sends after is applied. And a lane
// connection that has not authenticated is held to one small AUTH frame,
// refused from its header, so strangers cannot make the server hold memory.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "wire/lane/frame.h"
#include "wire/lane/frame_reader.h"
#include "wire/lane/frame_writer.h"
#include "wire/lane/socket.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;


// The server's resident memory in bytes (it runs in this process).
uint64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

// A server of two tenants, alice and bob, whose file the tests re-read.
// `Base`: gtest's Test, or TestWithParam for the tests run on each transport.
template <typename Base>
class RevocationTest : public Base {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("kvcached-revocation-" + std::to_string(std::random_device()()));
    std::filesystem::create_directories(dir_);
    WriteTokens(absl::StrCat("tenant=alice token=", kAlice, "\ntenant=bob token=", kBob, "\n"));
    server_ = TestServer::Start({.page_bytes = 64 << 10,
                                 .budget_bytes = 128 << 20,
                                 .tokens_file = tokens_file(),
                                 .token = kAlice});
    ASSERT_NE(server_, nullptr);
  }

  void TearDown() override {
    if (server_ != nullptr) {
      RestoreBob();
      ReleaseAll(*server_->ConnectAs(kBob));
      server_->CleanUpAndCheck();
    }
    server_.reset();
    std::filesystem::remove_all(dir_);
  }

  // Bob's client, its Update and Fetch on the lane or on gRPC.
  std::unique_ptr<Client> Bob(bool on_lane) {
    auto bob = server_->ConnectAs(kBob, on_lane ? server_->server().data_lane_address() : "");
    EXPECT_EQ(bob->uses_data_lane(), on_lane);
    return bob;
  }
  std::string tokens_file() const { return (dir_ / "tokens").string(); }
  void WriteTokens(const std::string& text) { std::ofstream(tokens_file()) << text; }
  void Reload(const std::string& text) {
    WriteTokens(text);
    const absl::Status reloaded = server_->server().ReloadTokens();
    ASSERT_TRUE(reloaded.ok()) << reloaded;
  }
  // Bob is left out of the file; alice stays.
  void RevokeBob() { Reload(absl::StrCat("tenant=alice token=", kAlice, "\n")); }
  void RestoreBob() {
    Reload(absl::StrCat("tenant=alice token=", kAlice, "\ntenant=bob token=", kBob, "\n"));
  }
  static void ReleaseAll(Client& client) {
    for (const v1::SnapshotInfo& info : client.ListSnapshots().value_or(std::vector<v1::SnapshotInfo>())) {
      EXPECT_TRUE(client.ReleaseSnapshot(info.snapshot_id()).ok());
    }
    for (const v1::CacheInfo& info : client.ListCaches().value_or(std::vector<v1::CacheInfo>())) {
      EXPECT_TRUE(client.DeleteCache(info.cache_id()).ok());
    }
  }
  // Bob's cache of `tokens` tokens in each layer, written over gRPC.
  std::string BobsCache(uint64_t tokens) {
    auto bob = server_->ConnectAs(kBob);
    absl::StatusOr<v1::CacheInfo> cache = bob->CreateCache(ToWireSpec(spec_));
    EXPECT_TRUE(cache.ok()) << cache.status();
    RefCache reference(spec_);
    for (uint64_t done = 0; done < tokens; done += 256) {
      const absl::Status stepped = StepBoth(*bob, cache->cache_id(), reference,
                                            std::min<uint64_t>(256, tokens - done), rng_);
      EXPECT_TRUE(stepped.ok()) << stepped;
    }
    return cache.ok() ? cache->cache_id() : "";
  }
  std::vector<uint64_t> BobsOffsets(const std::string& cache) {
    absl::StatusOr<v1::CacheInfo> info = server_->ConnectAs(kBob)->GetCache(cache);
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return {};
    return {info->layer_offsets().begin(), info->layer_offsets().end()};
  }

  std::filesystem::path dir_;
  // 4 KiB of keys and values per token and layer (8 heads of 64 floats).
  const engine::CacheSpec spec_ =
      MakeSpec({StandardLayerSpec(8, 64), StandardLayerSpec(8, 64)}, DType::kFloat32);
  std::mt19937_64 rng_{3};
  std::unique_ptr<TestServer> server_;
};

// Run on gRPC (false) and on the data lane (true).
class E2eRevocationTest : public RevocationTest<::testing::TestWithParam<bool>> {};
// The lane's own connections and framing.
using E2eLaneRevocationTest = RevocationTest<::testing::Test>;

// An Update stream open across the reload: its next message is refused
// UNAUTHENTICATED and not applied; those before it stay.
TEST_P(E2eRevocationTest, AnUpdateStreamOpenAcrossTheReloadAppliesNothingMore) {
  const std::string cache = BobsCache(0);
  auto bob = Bob(GetParam());
  std::unique_ptr<UpdateStream> stream = bob->OpenUpdate(cache);
  const KvTensors before = RandomKv(spec_, 0, 4, rng_);
  ASSERT_TRUE(stream->Write(MakeLayerUpdate(spec_, 0, before)));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (stream->acknowledged_count() < 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_EQ(stream->acknowledged_count(), 1u);
  RevokeBob();
  const KvTensors after = RandomKv(spec_, 1, 4, rng_);
  (void)stream->Write(MakeLayerUpdate(spec_, 1, after));  // may fail already: the lane closed
  const absl::Status finished = stream->Finish().status();
  EXPECT_EQ(finished.code(), Code::kUnauthenticated) << finished;
  EXPECT_THAT(finished.message(), HasSubstr("revoked"));
  EXPECT_EQ(stream->acknowledged().size(), 1u);
  // The connection (lane) or channel (gRPC) refuses every later call too.
  EXPECT_EQ(bob->FetchLayer(cache, "", 0).status().code(), Code::kUnauthenticated);
  RestoreBob();
  EXPECT_THAT(BobsOffsets(cache), ::testing::ElementsAre(4, 0));
}

// A Fetch under way when the reload lands sends no chunk after it: the
// call ends UNAUTHENTICATED long before its 64 MiB are through (the
// client holds its first chunk until the reload is done; what gRPC's
// flow-control window and the sockets hold by then, up to about 20 MiB
// on loopback, was sent before it).
TEST_P(E2eRevocationTest, AFetchUnderWayStopsAtItsNextChunk) {
  const uint64_t tokens = 8192;  // 32 MiB a layer
  const std::string cache = BobsCache(tokens);
  auto bob = Bob(GetParam());
  v1::FetchRequest request;
  request.set_cache_id(cache);
  request.set_max_chunk_tokens(16);  // 64 KiB chunks, 256 of them
  uint64_t chunks = 0;
  const absl::Status fetched = bob->Fetch(request, [&](const v1::FetchResponse&) {
    if (chunks++ == 0) RevokeBob();
    return absl::OkStatus();
  });
  EXPECT_EQ(fetched.code(), Code::kUnauthenticated) << fetched;
  EXPECT_LT(chunks, tokens / 16) << "more than half of the chunks came after the reload";
}

// On a raw lane connection: the frame after the reload, whatever it is, is
// answered UNAUTHENTICATED and the server closes the connection; the same
// where the token now names another tenant, which sees nothing of bob's.
TEST_F(E2eLaneRevocationTest, ALaneConnectionOfARevokedTokenIsClosed) {
  const std::string cache = BobsCache(8);
  for (const bool moved : {false, true}) {
    SCOPED_TRACE(moved ? "bob's token moved to carol" : "bob left out");
    absl::StatusOr<int> fd = lane::Connect(server_->server().data_lane_address(),
                                           absl::Seconds(5), {lane::kMagic, sizeof(lane::kMagic)});
    ASSERT_TRUE(fd.ok()) << fd.status();
    lane::OwnedFd owned(*fd);
    lane::FrameReader reader(*fd, 64 << 20);
    lane::FrameWriter writer(*fd);
    ASSERT_TRUE(reader.ReadRaw(sizeof(lane::kMagic)).ok());
    v1::LaneAuth auth;
    auth.set_token(kBob);
    writer.AddMessage(v1::LANE_FRAME_AUTH, auth);
    ASSERT_TRUE(writer.Send().ok());
    absl::StatusOr<lane::Frame> admitted = reader.Next();
    ASSERT_TRUE(admitted.ok()) << admitted.status();
    if (moved) {
      Reload(absl::StrCat("tenant=alice token=", kAlice, "\ntenant=carol token=", kBob, "\n"));
    } else {
      RevokeBob();
    }
    v1::FetchRequest fetch;
    fetch.set_cache_id(cache);
    writer.AddMessage(v1::LANE_FRAME_FETCH, fetch);
    ASSERT_TRUE(writer.Send().ok());
    absl::StatusOr<lane::Frame> answer = reader.Next();
    ASSERT_TRUE(answer.ok()) << answer.status();
    ASSERT_EQ(answer->header.kind, v1::LANE_FRAME_STATUS);
    v1::LaneStatus status;
    ASSERT_TRUE(status.ParseFromArray(answer->payload.data(), answer->payload.size()));
    EXPECT_EQ(status.code(), static_cast<int>(Code::kUnauthenticated)) << status.message();
    EXPECT_FALSE(reader.Next().ok()) << "the connection stays open";
    if (moved) {
      // Carol (bob's old token) has a tenant of her own, without bob's cache.
      auto carol = server_->ConnectAs(kBob, server_->server().data_lane_address());
      EXPECT_EQ(carol->FetchLayer(cache, "", 0).status().code(), Code::kNotFound);
    }
    RestoreBob();
  }
}

// Strangers' first frames, each announcing 32 MiB (an UPDATE, or an AUTH
// far past a token's size), are refused from their headers: the server
// reads none of the megabytes they push, and a worker still gets in.
TEST_F(E2eLaneRevocationTest, UnauthenticatedLargeFramesAreRefusedFromTheirHeaders) {
  constexpr int kStrangers = 8;
  constexpr size_t kPushed = 8 << 20;  // each, of the 32 MiB announced
  const std::string body(kPushed, 'x');
  const uint64_t resident_before = ResidentBytes();
  std::vector<std::thread> strangers;
  std::atomic<size_t> pushed{0};
  // Each stranger keeps its connection open until memory is measured: a
  // server that read its frame holds the bytes until the connection ends.
  std::atomic<int> done_pushing{0};
  absl::Notification measured;
  for (int i = 0; i < kStrangers; ++i) {
    strangers.emplace_back([&, i] {
      lane::OwnedFd owned;  // closed only after the measurement
      const auto finish = absl::MakeCleanup([&] {
        ++done_pushing;
        measured.WaitForNotification();
      });
      absl::StatusOr<int> fd = lane::Connect(server_->server().data_lane_address(),
                                             absl::Seconds(5), {lane::kMagic, sizeof(lane::kMagic)});
      if (!fd.ok()) return;
      owned = lane::OwnedFd(*fd);
      const timeval timeout{.tv_sec = 1, .tv_usec = 0};
      setsockopt(*fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
      std::byte header[lane::kHeaderBytes];
      lane::EncodeHeader(
          {.length = 32 << 20, .kind = i % 2 == 0 ? v1::LANE_FRAME_UPDATE : v1::LANE_FRAME_AUTH},
          header);
      if (send(*fd, header, sizeof(header), MSG_NOSIGNAL) != sizeof(header)) return;
      for (size_t sent = 0; sent < body.size();) {
        const ssize_t n = send(*fd, body.data() + sent, body.size() - sent, MSG_NOSIGNAL);
        if (n <= 0) break;  // refused and closed, or the socket's buffers are full
        sent += n;
        pushed += n;
      }
    });
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (done_pushing < kStrangers && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  const int64_t grown = static_cast<int64_t>(ResidentBytes()) - static_cast<int64_t>(resident_before);
  measured.Notify();
  for (std::thread& stranger : strangers) stranger.join();
  EXPECT_LT(grown, 8 << 20) << "the server read strangers' frames (" << pushed << " bytes pushed)";
  auto alice = server_->ConnectAs(kAlice, server_->server().data_lane_address());
  absl::StatusOr<v1::CacheInfo> cache = alice->CreateCache(ToWireSpec(spec_));
  ASSERT_TRUE(cache.ok()) << cache.status();
  RefCache reference(spec_);
  ASSERT_TRUE(StepBoth(*alice, cache->cache_id(), reference, 8, rng_).ok());
  absl::StatusOr<LayerHistory> history = alice->FetchLayer(cache->cache_id(), "", 1);
  ASSERT_TRUE(history.ok()) << history.status();
  EXPECT_EQ(history->tokens, 8u);
  EXPECT_TRUE(alice->DeleteCache(cache->cache_id()).ok());
}

INSTANTIATE_TEST_SUITE_P(Transports, E2eRevocationTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("Lane") : std::string("Grpc");
                         });

}  // namespace
}  // namespace kvcache::testing
