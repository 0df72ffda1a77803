// Tenants over the wire (service/tenants.h): a server with a tokens file
// refuses every RPC and the data lane without a known token; each tenant sees
// only its own caches, snapshots, saved files and prefixes, and another
// tenant's id is answered exactly as an unknown id is; quotas refuse past
// their limit; a reload changes tokens without losing what a tenant holds.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/notification.h"
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

constexpr char kOps[] = "ops-token-0123456789abcdef";
constexpr char kCarol[] = "carol-token-0123456789abcdef";
constexpr char kErin[] = "erin-token-0123456789abcdef";

class E2eTenantsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("kvcached-tenants-" + std::to_string(std::random_device()()));
    std::filesystem::create_directories(dir_);
    WriteTokens(absl::StrCat("# a comment\n", "tenant=alice token=", kAlice,
                             " max_requests_in_flight=2 max_lane_connections=2\n",
                             "tenant=bob token=", kBob, "\n", "tenant=ops token=", kOps,
                             " admin\n"));
    server_ = TestServer::Start(
        {.data_dir = (dir_ / "data").string(), .tokens_file = tokens_file(), .token = kAlice});
    ASSERT_NE(server_, nullptr);
    alice_ = server_->ConnectAs(kAlice);
    bob_ = server_->ConnectAs(kBob);
  }

  void TearDown() override {
    alice_.reset();
    bob_.reset();
    if (server_ != nullptr) {
      for (const char* token : {kBob, kOps}) ReleaseAll(*server_->ConnectAs(token));
      server_->CleanUpAndCheck();  // alice's, then the pool's pages
    }
    server_.reset();
    std::filesystem::remove_all(dir_);
  }

  // The server again, on the tokens file as it is now: a device of 128 pages
  // of 8 KiB (16 tokens each), 512 pages of host memory below it.
  void RestartSmallWithAHostTier() {
    alice_.reset();
    bob_.reset();
    server_.reset();
    server_ = TestServer::Start({.budget_bytes = 1 << 20,
                                 .host_bytes = 4 << 20,
                                 .tokens_file = tokens_file(),
                                 .token = kAlice});
    ASSERT_NE(server_, nullptr);
    alice_ = server_->ConnectAs(kAlice);
    bob_ = server_->ConnectAs(kBob);
  }

  std::string tokens_file() const { return (dir_ / "tokens").string(); }
  void WriteTokens(const std::string& text) { std::ofstream(tokens_file()) << text; }

  static void ReleaseAll(Client& client) {
    absl::StatusOr<std::vector<v1::SnapshotInfo>> snapshots = client.ListSnapshots();
    ASSERT_TRUE(snapshots.ok()) << snapshots.status();
    for (const v1::SnapshotInfo& info : *snapshots) {
      EXPECT_TRUE(client.ReleaseSnapshot(info.snapshot_id()).ok());
    }
    absl::StatusOr<std::vector<v1::CacheInfo>> caches = client.ListCaches();
    ASSERT_TRUE(caches.ok()) << caches.status();
    for (const v1::CacheInfo& info : *caches) EXPECT_TRUE(client.DeleteCache(info.cache_id()).ok());
  }

  // A cache of `client`'s with `tokens` tokens in every layer, and a snapshot of it.
  std::pair<std::string, std::string> CacheWithSnapshot(Client& client, uint64_t tokens) {
    absl::StatusOr<v1::CacheInfo> cache = client.CreateCache(ToWireSpec(spec_));
    EXPECT_TRUE(cache.ok()) << cache.status();
    if (!cache.ok()) return {};
    RefCache reference(spec_);
    for (uint64_t done = 0; done < tokens; done += 256) {  // the test server's max_update_tokens
      const absl::Status stepped = StepBoth(client, cache->cache_id(), reference,
                                            std::min<uint64_t>(256, tokens - done), rng_);
      EXPECT_TRUE(stepped.ok()) << stepped;
    }
    absl::StatusOr<v1::SnapshotInfo> snapshot = client.Snapshot(cache->cache_id());
    EXPECT_TRUE(snapshot.ok()) << snapshot.status();
    return {cache->cache_id(), snapshot.ok() ? snapshot->snapshot_id() : ""};
  }

  std::filesystem::path dir_;
  const engine::CacheSpec spec_ = MakeSpec({StandardLayerSpec(2, 8), StandardLayerSpec(2, 8)});
  std::mt19937_64 rng_{11};
  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Client> alice_;
  std::unique_ptr<Client> bob_;
};

TEST_F(E2eTenantsTest, EveryRpcRefusesCallsWithoutAKnownToken) {
  const std::string address = server_->server().address();
  for (const std::string& authorization :
       {std::string(), std::string("Bearer wrong-token-0123456789"), std::string(kAlice),
        absl::StrCat("Basic ", kAlice)}) {
    SCOPED_TRACE(authorization);
    for (const std::string& method : EveryRpcMethod()) {
      EXPECT_EQ(CallWithEmptyMessage(address, method, authorization),
                grpc::StatusCode::UNAUTHENTICATED)
          << method;
    }
  }
  // The same calls with a token reach the handlers (a real answer, mostly a
  // validation error for an empty request).
  for (const std::string& method : EveryRpcMethod()) {
    const grpc::StatusCode code =
        CallWithEmptyMessage(address, method, absl::StrCat("Bearer ", kBob));
    EXPECT_NE(code, grpc::StatusCode::UNAUTHENTICATED) << method;
    EXPECT_NE(code, grpc::StatusCode::UNIMPLEMENTED) << method;
  }
  // And the client library's own calls.
  auto anonymous = server_->ConnectAs("");
  const absl::Status refused = anonymous->ListCaches().status();
  EXPECT_EQ(refused.code(), Code::kUnauthenticated) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("bearer token"));
  EXPECT_EQ(anonymous->CreateCache(ToWireSpec(spec_)).status().code(), Code::kUnauthenticated);
  EXPECT_EQ(anonymous->FetchLayer(std::string(32, 'a'), "", 0).status().code(),
            Code::kUnauthenticated);
}

// Bob names alice's ids on every call that takes one: each answer is the one
// an id nobody holds gets (same code, same message once the id is swapped),
// and alice's state is unchanged.
TEST_F(E2eTenantsTest, AnotherTenantsIdsAreUnknownOnEveryCall) {
  const auto [cache, snapshot] = CacheWithSnapshot(*alice_, 20);
  const EngineFingerprint before = WireFingerprint(*alice_);
  const std::string unknown_cache(cache.size(), 'c'), unknown_snapshot(snapshot.size(), 'd');
  const KvTensors kv = RandomKv(spec_, 0, 1, rng_);
  const LayerUpdate update = MakeLayerUpdate(spec_, 0, kv);
  const auto [bobs_cache, bobs_snapshot] = CacheWithSnapshot(*bob_, 4);
  using Call = std::function<absl::Status(const std::string& cache, const std::string& snap)>;
  const std::vector<std::pair<std::string, Call>> calls = {
      {"GetCache", [&](auto& c, auto&) { return bob_->GetCache(c).status(); }},
      {"DeleteCache", [&](auto& c, auto&) { return bob_->DeleteCache(c); }},
      {"Update",
       [&](auto& c, auto&) {
         return bob_->Update(c, {&update, 1}).status();
       }},
      {"Fetch", [&](auto& c, auto&) { return bob_->FetchLayer(c, "", 0).status(); }},
      {"Fetch snapshot", [&](auto&, auto& s) { return bob_->FetchLayer("", s, 0).status(); }},
      {"Trim", [&](auto& c, auto&) { return bob_->Trim(c, 1).status(); }},
      {"Snapshot", [&](auto& c, auto&) { return bob_->Snapshot(c).status(); }},
      {"Restore into", [&](auto& c, auto& s) { return bob_->Restore(c, s, 0).status(); }},
      {"Restore from", [&](auto&, auto& s) { return bob_->Restore(bobs_cache, s, 0).status(); }},
      {"MergeSnapshots parent",
       [&](auto&, auto& s) { return bob_->MergeSnapshots(s, bobs_snapshot).status(); }},
      {"MergeSnapshots child",
       [&](auto&, auto& s) { return bob_->MergeSnapshots(bobs_snapshot, s).status(); }},
      {"SplitSnapshot", [&](auto&, auto& s) { return bob_->SplitSnapshot(s, 2).status(); }},
      {"ReleaseSnapshot", [&](auto&, auto& s) { return bob_->ReleaseSnapshot(s); }},
      {"ExtractRow", [&](auto& c, auto&) { return bob_->ExtractRow(c, 0).status(); }},
      {"FilterRows", [&](auto& c, auto&) { return bob_->FilterRows(c, {0}).status(); }},
      {"MergeCaches",
       [&](auto& c, auto&) {
         const std::string ids[] = {c};
         return bob_->MergeCaches(ids).status();
       }},
      {"ExtendCache", [&](auto& c, auto&) { return bob_->ExtendCache(bobs_cache, c).status(); }},
      {"BeginSpeculation", [&](auto& c, auto&) { return bob_->BeginSpeculation(c).status(); }},
      {"RenewLease cache",
       [&](auto& c, auto&) {
         const std::string ids[] = {c};
         return bob_->RenewLease(ids, {}).status();
       }},
      {"RenewLease snapshot",
       [&](auto&, auto& s) {
         const std::string ids[] = {s};
         return bob_->RenewLease({}, ids).status();
       }},
      {"SetPinned", [&](auto&, auto& s) { return bob_->SetPinned(s, true).status(); }},
      {"SaveSnapshot", [&](auto&, auto& s) { return bob_->SaveSnapshot(s, "stolen").status(); }},
      {"ExportSnapshot",
       [&](auto&, auto& s) {
         v1::ExportSnapshotRequest request;
         request.set_snapshot_id(s);
         return bob_->ExportSnapshot(request).status();
       }},
      {"PublishPrefix",
       [&](auto&, auto& s) {
         const uint32_t tokens[] = {1, 2, 3};
         return bob_->PublishPrefix(s, tokens).status();
       }},
      {"LookupPrefixCache",
       [&](auto& c, auto&) {
         const uint32_t tokens[] = {1, 2, 3};
         return bob_->LookupPrefixCache(c, tokens).status();
       }},
  };
  for (const auto& [name, call] : calls) {
    SCOPED_TRACE(name);
    const absl::Status theirs = call(cache, snapshot);
    const absl::Status nobodys = call(unknown_cache, unknown_snapshot);
    EXPECT_EQ(theirs.code(), Code::kNotFound) << theirs;
    EXPECT_EQ(theirs.code(), nobodys.code());
    const std::string swapped = absl::StrReplaceAll(
        theirs.message(), {{cache, unknown_cache}, {snapshot, unknown_snapshot}});
    EXPECT_EQ(swapped, nobodys.message());
  }
  // A list by alice's cache id is as empty as one by an id nobody holds.
  absl::StatusOr<std::vector<v1::SnapshotInfo>> listed = bob_->ListSnapshots({.cache_id = cache});
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty());
  EXPECT_TRUE(WireFingerprint(*alice_) == before) << "bob's calls changed alice's state";
  ReleaseAll(*bob_);
}

TEST_F(E2eTenantsTest, ListsAndPrefixesShowOnlyTheCallersOwn) {
  const auto [cache, snapshot] = CacheWithSnapshot(*alice_, 32);
  const uint32_t tokens[] = {5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                             21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36};
  ASSERT_TRUE(alice_->PublishPrefix(snapshot, tokens).ok());
  ASSERT_TRUE(alice_->SaveSnapshot(snapshot, "alices").ok());

  const auto empty = [](const auto& listed) { return listed.ok() && listed->empty(); };
  EXPECT_TRUE(empty(bob_->ListCaches()));
  EXPECT_TRUE(empty(bob_->ListSnapshots()));
  EXPECT_TRUE(empty(bob_->ListPrefixes()));
  EXPECT_TRUE(empty(bob_->ListSaved()));
  EXPECT_EQ(bob_->LoadSnapshot("alices").status().code(), Code::kNotFound);
  EXPECT_EQ(bob_->DeleteSaved("alices").code(), Code::kNotFound);
  // The same tokens in the same layout: a miss for bob, a hit for alice.
  absl::StatusOr<v1::LookupPrefixResponse> bobs = bob_->LookupPrefix(ToWireSpec(spec_), tokens);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_EQ(bobs->matched_tokens(), 0u);
  absl::StatusOr<v1::LookupPrefixResponse> alices = alice_->LookupPrefix(ToWireSpec(spec_), tokens);
  ASSERT_TRUE(alices.ok()) << alices.status();
  EXPECT_EQ(alices->matched_tokens(), 32u);
  // Bob's file of the same name is his own.
  const auto [bob_cache, bob_snapshot] = CacheWithSnapshot(*bob_, 8);
  ASSERT_TRUE(bob_->SaveSnapshot(bob_snapshot, "alices").ok());
  absl::StatusOr<v1::LoadSnapshotResponse> loaded = alice_->LoadSnapshot("alices");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->snapshot().to_offset(), 32u) << "alice loaded bob's file";
  EXPECT_TRUE(std::filesystem::exists(dir_ / "data" / "tenants" / "alice" / "alices.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir_ / "data" / "tenants" / "bob" / "alices.safetensors"));

  const absl::StatusOr<std::vector<v1::CacheInfo>> mine = alice_->ListCaches();
  ASSERT_TRUE(mine.ok());
  ASSERT_EQ(mine->size(), 1u);
  EXPECT_EQ((*mine)[0].cache_id(), cache);
  ASSERT_TRUE(alice_->DeleteSaved("alices").ok());
  ASSERT_TRUE(bob_->DeleteSaved("alices").ok());
  ReleaseAll(*bob_);
}

TEST_F(E2eTenantsTest, StatsAreTheTenantsOwnAndTotalsOnlyForAdmins) {
  CacheWithSnapshot(*alice_, 16);
  CacheWithSnapshot(*alice_, 16);
  CacheWithSnapshot(*bob_, 16);
  absl::StatusOr<v1::Stats> alice = alice_->GetStats();
  ASSERT_TRUE(alice.ok()) << alice.status();
  EXPECT_EQ(alice->tenant(), "alice");
  EXPECT_FALSE(alice->server_wide());
  EXPECT_EQ(alice->caches(), 2u);
  EXPECT_EQ(alice->snapshots(), 2u);
  EXPECT_EQ(alice->pages_used(), 0u) << "the shared pool's use is the server's, not alice's";
  EXPECT_GT(alice->pages_total(), 0u);
  absl::StatusOr<v1::Stats> totals = server_->ConnectAs(kOps)->GetStats();
  ASSERT_TRUE(totals.ok()) << totals.status();
  EXPECT_EQ(totals->tenant(), "ops");
  EXPECT_TRUE(totals->server_wide());
  EXPECT_EQ(totals->caches(), 3u);
  EXPECT_EQ(totals->snapshots(), 3u);
  EXPECT_EQ(totals->pages_used(), server_->server().pool().stats().used_pages);
  EXPECT_GT(totals->pages_used(), 0u);
  ReleaseAll(*bob_);
}

// Alice may have 2 requests in flight: two open Update streams hold both, a
// third call is RESOURCE_EXHAUSTED naming the quota, and once one stream
// ends she may call again. Bob is not affected.
TEST_F(E2eTenantsTest, RequestsInFlightStopAtTheTenantsQuota) {
  const auto [cache, snapshot] = CacheWithSnapshot(*alice_, 4);
  const KvTensors kv = RandomKv(spec_, 0, 1, rng_);
  auto first = alice_->OpenUpdate(cache);
  auto second = alice_->OpenUpdate(cache);
  // A stream is admitted when its first message reaches the server.
  LayerUpdate update = MakeLayerUpdate(spec_, 0, kv);
  ASSERT_TRUE(first->Write(update));
  ASSERT_TRUE(second->Write(update));
  absl::Status refused;
  for (int attempt = 0; attempt < 100; ++attempt) {  // until both streams are admitted
    refused = alice_->GetCache(cache).status();
    if (!refused.ok()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(refused.code(), Code::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("max_requests_in_flight"));
  EXPECT_TRUE(bob_->ListCaches().ok());
  (void)first->Finish();
  (void)second->Finish();
  // A call stops counting as it answers: once a client has its answer the
  // next call is admitted, whatever the server's threads still do.
  const absl::Status again = alice_->GetCache(cache).status();
  EXPECT_TRUE(again.ok()) << again;
  // So a client that makes one call at a time never meets the quota, on
  // unary calls or streams.
  v1::FetchRequest fetch;
  fetch.set_cache_id(cache);
  for (int call = 0; call < 200; ++call) {
    const absl::Status status =
        call % 2 == 0 ? alice_->GetCache(cache).status() : alice_->FetchAll(fetch).status();
    ASSERT_TRUE(status.ok()) << "call " << call << ": " << status;
  }
}

// Past max_caches or max_snapshots a call that would add one is refused,
// naming the quota, and changes nothing: a split that would pass it keeps
// its snapshot; room made by a release or a delete is usable at once.
TEST_F(E2eTenantsTest, CachesAndSnapshotsStopAtTheTenantsQuotas) {
  // Carol comes with a reload, her quotas with her.
  std::ifstream in(tokens_file());
  const std::string tokens((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  WriteTokens(
      absl::StrCat(tokens, "tenant=carol token=", kCarol, " max_caches=2 max_snapshots=3\n"));
  ASSERT_TRUE(server_->server().ReloadTokens().ok());
  std::unique_ptr<Client> carol = server_->ConnectAs(kCarol);
  const auto [cache, first] = CacheWithSnapshot(*carol, 8);
  ASSERT_TRUE(carol->CreateCache(ToWireSpec(spec_)).ok());
  absl::StatusOr<v1::CacheInfo> third = carol->CreateCache(ToWireSpec(spec_));
  EXPECT_EQ(third.status().code(), Code::kResourceExhausted) << third.status();
  EXPECT_THAT(third.status().message(), HasSubstr("max_caches"));
  EXPECT_EQ(carol->ListCaches()->size(), 2u);

  ASSERT_TRUE(carol->Snapshot(cache).ok());
  absl::StatusOr<v1::SnapshotInfo> last = carol->Snapshot(cache, {.from_offset = 4});
  ASSERT_TRUE(last.ok()) << last.status();
  absl::StatusOr<v1::SnapshotInfo> fourth = carol->Snapshot(cache);
  EXPECT_EQ(fourth.status().code(), Code::kResourceExhausted) << fourth.status();
  EXPECT_THAT(fourth.status().message(), HasSubstr("max_snapshots"));
  // A split takes one and gives two: past the quota, so nothing happens.
  absl::StatusOr<v1::SplitSnapshotResponse> split = carol->SplitSnapshot(first, 4);
  EXPECT_EQ(split.status().code(), Code::kResourceExhausted) << split.status();
  EXPECT_EQ(carol->ListSnapshots()->size(), 3u);
  ASSERT_TRUE(carol->ListSnapshots({.cache_id = cache}).ok());
  EXPECT_TRUE(carol->RenewLease({}, {first}).ok()) << "the refused split consumed its snapshot";

  ASSERT_TRUE(carol->ReleaseSnapshot(last->snapshot_id()).ok());
  split = carol->SplitSnapshot(first, 4);
  EXPECT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(carol->ListSnapshots()->size(), 3u);
  const std::vector<v1::CacheInfo> caches = *carol->ListCaches();
  for (const v1::CacheInfo& info : caches) {
    if (info.cache_id() != cache) {
      ASSERT_TRUE(carol->DeleteCache(info.cache_id()).ok());
    }
  }
  EXPECT_TRUE(carol->CreateCache(ToWireSpec(spec_)).ok());
  // Another tenant's counts are its own.
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(bob_->CreateCache(ToWireSpec(spec_)).ok());
  ReleaseAll(*carol);
}

// The data lane authenticates each connection: a token's client works over
// it and sees only its tenant's caches; a connection without an AUTH frame,
// or with a wrong token, is answered UNAUTHENTICATED and closed.
TEST_F(E2eTenantsTest, TheDataLaneAuthenticatesEachConnection) {
  auto alice_lane = server_->ConnectAs(kAlice, "auto");
  ASSERT_TRUE(alice_lane->uses_data_lane());
  const auto [cache, snapshot] = CacheWithSnapshot(*alice_lane, 24);
  absl::StatusOr<LayerHistory> own = alice_lane->FetchLayer(cache, "", 1);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->tokens, 24u);
  auto bob_lane = server_->ConnectAs(kBob, server_->server().data_lane_address());
  const absl::Status theirs = bob_lane->FetchLayer(cache, "", 1).status();
  EXPECT_EQ(theirs.code(), Code::kNotFound) << theirs;

  const std::string lane_address = server_->server().data_lane_address();
  for (const std::string& token : {std::string("wrong-token-0123456789"), std::string()}) {
    auto stranger = server_->ConnectAs(token, lane_address);
    const absl::Status refused = stranger->FetchLayer(cache, "", 1).status();
    EXPECT_EQ(refused.code(), Code::kUnauthenticated) << refused;
  }
  // A raw connection whose first frame is a FETCH.
  absl::StatusOr<int> fd =
      lane::Connect(lane_address, absl::Seconds(5), {lane::kMagic, sizeof(lane::kMagic)});
  ASSERT_TRUE(fd.ok()) << fd.status();
  lane::OwnedFd owned(*fd);
  lane::FrameReader reader(*fd, 1 << 20);
  lane::FrameWriter writer(*fd);
  ASSERT_TRUE(reader.ReadRaw(sizeof(lane::kMagic)).ok());
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
}

// An AUTH frame that is not a LaneAuth, or one after the connection's
// first frame, is INVALID_ARGUMENT naming it, and the connection closes.
TEST_F(E2eTenantsTest, MalformedOrLateLaneAuthIsRefused) {
  const std::string lane_address = server_->server().data_lane_address();
  // The STATUS answering `frames` (kind, payload) on a fresh connection.
  const auto answer = [&](const std::vector<std::pair<int, std::string>>& frames) {
    v1::LaneStatus status;
    absl::StatusOr<int> fd =
        lane::Connect(lane_address, absl::Seconds(5), {lane::kMagic, sizeof(lane::kMagic)});
    if (!fd.ok()) return status;
    lane::OwnedFd owned(*fd);
    lane::FrameReader reader(*fd, 1 << 20);
    lane::FrameWriter writer(*fd);
    if (!reader.ReadRaw(sizeof(lane::kMagic)).ok()) return status;
    for (const auto& [kind, payload] : frames) {
      writer.AddHeader(static_cast<v1::LaneFrameKind>(kind), static_cast<uint32_t>(payload.size()));
      writer.AddCopy({reinterpret_cast<const std::byte*>(payload.data()), payload.size()});
      if (!writer.Send().ok()) return status;
    }
    while (true) {  // the last STATUS before the server closes
      absl::StatusOr<lane::Frame> frame = reader.Next();
      if (!frame.ok()) return status;
      if (frame->header.kind == v1::LANE_FRAME_STATUS) {
        status.ParseFromArray(frame->payload.data(), frame->payload.size());
      }
    }
  };
  const v1::LaneStatus garbage = answer({{v1::LANE_FRAME_AUTH, "\xff\xff\xff"}});
  EXPECT_EQ(garbage.code(), static_cast<int>(Code::kInvalidArgument)) << garbage.message();
  EXPECT_THAT(garbage.message(), HasSubstr("LaneAuth"));
  v1::LaneAuth auth;
  auth.set_token(kAlice);
  const v1::LaneStatus twice = answer({{v1::LANE_FRAME_AUTH, auth.SerializeAsString()},
                                       {v1::LANE_FRAME_AUTH, auth.SerializeAsString()}});
  EXPECT_EQ(twice.code(), static_cast<int>(Code::kInvalidArgument)) << twice.message();
  EXPECT_THAT(twice.message(), HasSubstr("AUTH after"));
}

TEST_F(E2eTenantsTest, LaneConnectionsStopAtTheTenantsQuota) {
  const std::string lane_address = server_->server().data_lane_address();
  const auto [cache, snapshot] = CacheWithSnapshot(*alice_, 8);
  // Each client holds its lane connection between calls.
  auto first = server_->ConnectAs(kAlice, lane_address);
  auto second = server_->ConnectAs(kAlice, lane_address);
  auto third = server_->ConnectAs(kAlice, lane_address);
  ASSERT_TRUE(first->FetchLayer(cache, "", 0).ok());
  ASSERT_TRUE(second->FetchLayer(cache, "", 0).ok());
  const absl::Status refused = third->FetchLayer(cache, "", 0).status();
  EXPECT_EQ(refused.code(), Code::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("max_lane_connections"));
  first.reset();  // closes its connection
  absl::Status again;
  for (int attempt = 0; attempt < 100; ++attempt) {
    again = third->FetchLayer(cache, "", 0).status();
    if (again.ok()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(again.ok()) << again;
}

// The pool is shared: once alice's idle snapshots fill the device, bob's
// work moves them to host memory (alice loses nothing: her bytes come back
// when she reads them), instead of bob being refused.
TEST_F(E2eTenantsTest, OneTenantsIdleSnapshotsMakeRoomForAnothers) {
  ASSERT_NO_FATAL_FAILURE(RestartSmallWithAHostTier());
  std::vector<std::pair<std::string, LayerHistory>> alices;  // snapshot, layer 1 as written
  for (int i = 0; i < 2; ++i) {  // 2 x 2 layers x 32 pages: the whole device
    const auto [cache, snapshot] = CacheWithSnapshot(*alice_, 512);
    absl::StatusOr<LayerHistory> written = alice_->FetchLayer("", snapshot, 1);
    ASSERT_TRUE(written.ok()) << written.status();
    alices.emplace_back(snapshot, *std::move(written));
    ASSERT_TRUE(alice_->DeleteCache(cache).ok());
  }
  const auto [bob_cache, bob_snapshot] = CacheWithSnapshot(*bob_, 256);
  ASSERT_FALSE(bob_cache.empty());
  absl::StatusOr<v1::Stats> totals = server_->ConnectAs(kOps)->GetStats();
  ASSERT_TRUE(totals.ok());
  EXPECT_GT(totals->evictions(), 0u);
  EXPECT_GT(totals->host_pages_used(), 0u);
  ASSERT_TRUE(bob_->ReleaseSnapshot(bob_snapshot).ok());
  ASSERT_TRUE(bob_->DeleteCache(bob_cache).ok());
  for (const auto& [snapshot, written] : alices) {
    absl::StatusOr<LayerHistory> read = alice_->FetchLayer("", snapshot, 1);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->tokens, 512u);
    EXPECT_TRUE(read->keys == written.keys && read->values == written.values)
        << "alice's bytes changed on their way through host memory";
  }
}

// A tenant's tier quotas bound its pages in each tier: past its device share
// its own idle snapshots move down, then its calls are refused naming the
// quota, while the pool still has room for the others.
TEST_F(E2eTenantsTest, TierQuotasBoundATenantsPagesInEachTier) {
  constexpr uint64_t kQuota = 32 * 8192;  // 32 pages: a cache of 256 tokens
  WriteTokens(absl::StrCat("tenant=alice token=", kAlice, "\ntenant=bob token=", kBob,
                           "\ntenant=ops token=", kOps, " admin\ntenant=carol token=", kCarol,
                           " max_device_bytes=", kQuota, " max_host_bytes=", kQuota, "\n"));
  ASSERT_NO_FATAL_FAILURE(RestartSmallWithAHostTier());
  std::unique_ptr<Client> carol = server_->ConnectAs(kCarol);
  const auto usage = [&] {
    absl::StatusOr<v1::Stats> stats = carol->GetStats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    return stats.ok() ? std::make_pair(stats->tenant_device_bytes(), stats->tenant_host_bytes())
                      : std::make_pair(uint64_t{0}, uint64_t{0});
  };

  const auto [first_cache, first] = CacheWithSnapshot(*carol, 256);
  ASSERT_TRUE(carol->DeleteCache(first_cache).ok());
  absl::StatusOr<LayerHistory> first_written = carol->FetchLayer("", first, 1);
  ASSERT_TRUE(first_written.ok()) << first_written.status();
  // The first snapshot fills the device share; the second moves it down.
  const auto [second_cache, second] = CacheWithSnapshot(*carol, 256);
  EXPECT_EQ(usage(), std::make_pair(kQuota, kQuota));
  absl::StatusOr<v1::Stats> stats = carol->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->tenant_max_device_bytes(), kQuota);
  EXPECT_EQ(stats->tenant_max_host_bytes(), kQuota);
  EXPECT_EQ(stats->tenant_max_disk_bytes(), 0u);

  // The pool is not full: another tenant fills 64 pages more, and leaves
  // them idle in a snapshot.
  const auto [bob_cache, bob_snapshot] = CacheWithSnapshot(*bob_, 512);
  ASSERT_FALSE(bob_snapshot.empty());
  ASSERT_TRUE(bob_->DeleteCache(bob_cache).ok());
  // Carol's live cache holds her whole device share: more is refused,
  // nothing changed, and bob's idle pages stay (moving them gives her no room).
  RefCache reference(spec_);
  const absl::Status more = StepBoth(*carol, second_cache, reference, 16, rng_);
  EXPECT_EQ(more.code(), Code::kResourceExhausted) << more;
  EXPECT_THAT(more.message(), HasSubstr("max_device_bytes"));
  EXPECT_EQ(carol->GetCache(second_cache)->offset(), 256u);
  EXPECT_EQ(bob_->GetStats()->tenant_host_bytes(), 0u);

  // Host memory has room, but not in carol's share of it: her idle second
  // snapshot cannot move down for a third.
  ASSERT_TRUE(carol->DeleteCache(second_cache).ok());
  absl::StatusOr<LayerHistory> second_written = carol->FetchLayer("", second, 1);
  ASSERT_TRUE(second_written.ok()) << second_written.status();
  absl::StatusOr<v1::CacheInfo> third = carol->CreateCache(ToWireSpec(spec_));
  ASSERT_TRUE(third.ok());
  const absl::Status refused = StepBoth(*carol, third->cache_id(), reference, 256, rng_);
  EXPECT_EQ(refused.code(), Code::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("max_device_bytes"));
  EXPECT_EQ(carol->GetCache(third->cache_id())->offset(), 0u);
  EXPECT_EQ(usage(), std::make_pair(kQuota, kQuota));
  EXPECT_EQ(bob_->GetStats()->tenant_host_bytes(), 0u);
  // With the first released, the second moves down and the third fits.
  ASSERT_TRUE(carol->ReleaseSnapshot(first).ok());
  RefCache again(spec_);
  EXPECT_TRUE(StepBoth(*carol, third->cache_id(), again, 256, rng_).ok());
  EXPECT_EQ(usage(), std::make_pair(kQuota, kQuota));
  // Reading the second brings it back within the share the third left.
  ASSERT_TRUE(carol->DeleteCache(third->cache_id()).ok());
  absl::StatusOr<LayerHistory> read = carol->FetchLayer("", second, 1);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(read->keys == second_written->keys && read->values == second_written->values);
  ReleaseAll(*carol);
  EXPECT_EQ(usage(), std::make_pair(uint64_t{0}, uint64_t{0}));
  // A quota under one page would read as none: the file is refused naming it.
  std::ifstream in(tokens_file());
  const std::string tokens((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  WriteTokens(absl::StrCat(tokens, "tenant=dave token=dave-token-0123456789abcdef ",
                           "max_host_bytes=4096\n"));
  const absl::Status reloaded = server_->server().ReloadTokens();
  EXPECT_EQ(reloaded.code(), Code::kInvalidArgument) << reloaded;
  EXPECT_THAT(reloaded.message(), HasSubstr("max_host_bytes 4096 is less than one page"));
}
// An admin token lists another tenant's caches and snapshots by its name
// (as the tokens file names it); anyone else naming a tenant other than
// itself is refused the same way whether or not that tenant exists.
TEST_F(E2eTenantsTest, OnlyAnAdminNamesAnotherTenant) {
  const auto [bob_cache, bob_snapshot] = CacheWithSnapshot(*bob_, 32);
  const auto [alice_cache, alice_snapshot] = CacheWithSnapshot(*alice_, 32);
  ASSERT_FALSE(bob_snapshot.empty());
  ASSERT_FALSE(alice_snapshot.empty());
  std::unique_ptr<Client> ops = server_->ConnectAs(kOps);

  absl::StatusOr<std::vector<v1::CacheInfo>> bobs_caches = ops->ListCaches({.tenant = "bob"});
  ASSERT_TRUE(bobs_caches.ok()) << bobs_caches.status();
  ASSERT_EQ(bobs_caches->size(), 1u);
  EXPECT_EQ((*bobs_caches)[0].cache_id(), bob_cache);
  absl::StatusOr<std::vector<v1::SnapshotInfo>> bobs_snapshots =
      ops->ListSnapshots({.tenant = "bob"});
  ASSERT_TRUE(bobs_snapshots.ok()) << bobs_snapshots.status();
  ASSERT_EQ(bobs_snapshots->size(), 1u);
  EXPECT_EQ((*bobs_snapshots)[0].snapshot_id(), bob_snapshot);
  absl::StatusOr<std::vector<v1::CacheInfo>> ops_own = ops->ListCaches();
  ASSERT_TRUE(ops_own.ok()) << ops_own.status();
  EXPECT_TRUE(ops_own->empty()) << "an admin's own list is still its own";
  absl::StatusOr<std::vector<v1::CacheInfo>> alice_by_name =
      alice_->ListCaches({.tenant = "alice"});
  ASSERT_TRUE(alice_by_name.ok()) << alice_by_name.status();
  ASSERT_EQ(alice_by_name->size(), 1u);
  EXPECT_EQ((*alice_by_name)[0].cache_id(), alice_cache);

  absl::StatusOr<std::vector<v1::SnapshotInfo>> ops_by_name = ops->ListSnapshots({.tenant = "ops"});
  ASSERT_TRUE(ops_by_name.ok()) << ops_by_name.status();
  EXPECT_TRUE(ops_by_name->empty());

  for (const char* other : {"bob", "ops", "nobody"}) {
    SCOPED_TRACE(other);
    const absl::Status caches = alice_->ListCaches({.tenant = other}).status();
    EXPECT_EQ(caches.code(), Code::kPermissionDenied);
    EXPECT_THAT(caches.message(), HasSubstr("tenant"));
    EXPECT_EQ(alice_->ListSnapshots({.tenant = other}).status(), caches);
  }
  for (const char* any : {"", "alice", "bob", "nobody"}) {
    const absl::Status evict = alice_->EvictSnapshots({.tenant = any}).status();
    EXPECT_EQ(evict.code(), Code::kPermissionDenied) << any;
    EXPECT_THAT(evict.message(), HasSubstr("admin")) << any;
  }
  for (const absl::Status& unknown : {ops->ListCaches({.tenant = "nobody"}).status(),
                                      ops->ListSnapshots({.tenant = "nobody"}).status(),
                                      ops->EvictSnapshots({.tenant = "nobody"}).status()}) {
    EXPECT_EQ(unknown.code(), Code::kNotFound) << unknown;
    EXPECT_THAT(unknown.message(), HasSubstr("tenant"));
  }
}

// EvictSnapshots (an admin's) moves the named tenant's idle snapshots off
// the device now, no more pages than asked, never a page that a live cache
// or a pinned snapshot holds and never another tenant's. What moved reads
// back byte for byte.
TEST_F(E2eTenantsTest, EvictSnapshotsMovesOnlyTheTenantsIdleSnapshotsDown) {
  ASSERT_NO_FATAL_FAILURE(RestartSmallWithAHostTier());
  const auto [alice_cache, alice_snapshot] = CacheWithSnapshot(*alice_, 64);
  const auto [pinned_cache, pinned_snapshot] = CacheWithSnapshot(*alice_, 64);
  const auto [live_cache, live_snapshot] = CacheWithSnapshot(*alice_, 64);
  const auto [bob_cache, bob_snapshot] = CacheWithSnapshot(*bob_, 64);
  ASSERT_FALSE(bob_snapshot.empty());
  absl::StatusOr<LayerHistory> written = alice_->FetchLayer("", alice_snapshot, 1);
  ASSERT_TRUE(written.ok()) << written.status();
  ASSERT_TRUE(alice_->SetPinned(pinned_snapshot, true).ok());
  for (const std::string& cache : {alice_cache, pinned_cache}) {
    ASSERT_TRUE(alice_->DeleteCache(cache).ok());
  }
  ASSERT_TRUE(alice_->ReleaseSnapshot(live_snapshot).ok());  // the live cache stays
  ASSERT_TRUE(bob_->DeleteCache(bob_cache).ok());
  auto where = [](Client& client, const std::string& snapshot_id) {
    absl::StatusOr<std::vector<v1::SnapshotInfo>> all = client.ListSnapshots();
    EXPECT_TRUE(all.ok()) << all.status();
    for (const v1::SnapshotInfo& info : all.ok() ? *all : std::vector<v1::SnapshotInfo>()) {
      if (info.snapshot_id() == snapshot_id) return info;
    }
    ADD_FAILURE() << "no snapshot " << snapshot_id;
    return v1::SnapshotInfo();
  };
  const uint64_t snapshot_bytes = where(*alice_, alice_snapshot).device_bytes();
  ASSERT_GT(snapshot_bytes, 8192u) << "the snapshot should span several 8 KiB pages";

  std::unique_ptr<Client> ops = server_->ConnectAs(kOps);
  absl::StatusOr<v1::EvictSnapshotsResponse> one =
      ops->EvictSnapshots({.bytes = 1, .tenant = "alice"});
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->pages_moved(), 1u);
  EXPECT_EQ(one->bytes_moved(), 8192u);
  EXPECT_EQ(where(*alice_, alice_snapshot).host_bytes(), 8192u);
  absl::StatusOr<v1::EvictSnapshotsResponse> rest = ops->EvictSnapshots({.tenant = "alice"});
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(rest->bytes_moved() + one->bytes_moved(), snapshot_bytes);
  EXPECT_EQ(where(*alice_, alice_snapshot).device_bytes(), 0u);
  EXPECT_EQ(where(*alice_, pinned_snapshot).host_bytes(), 0u) << "a pinned snapshot moved";
  EXPECT_EQ(where(*bob_, bob_snapshot).host_bytes(), 0u) << "another tenant's snapshot moved";
  absl::StatusOr<v1::EvictSnapshotsResponse> nothing = ops->EvictSnapshots({.tenant = "alice"});
  ASSERT_TRUE(nothing.ok()) << nothing.status();
  EXPECT_EQ(nothing->pages_moved(), 0u) << "a live cache's pages moved";

  // Every byte there is, without wrapping to none.
  absl::StatusOr<v1::EvictSnapshotsResponse> bobs =
      ops->EvictSnapshots({.bytes = std::numeric_limits<uint64_t>::max(), .tenant = "bob"});
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_GT(bobs->pages_moved(), 0u);
  EXPECT_EQ(where(*bob_, bob_snapshot).device_bytes(), 0u);

  absl::StatusOr<LayerHistory> read = alice_->FetchLayer("", alice_snapshot, 1);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(read->keys == written->keys && read->values == written->values)
      << "the evicted snapshot's bytes changed";
  ASSERT_TRUE(alice_->SetPinned(pinned_snapshot, false).ok());
}

// Past the tenant's share of host memory (and with no disk), an eviction
// that has pages to move but nowhere to put them says so.
TEST_F(E2eTenantsTest, EvictSnapshotsIntoFullTiersIsRefusedNamingThem) {
  WriteTokens(absl::StrCat("tenant=alice token=", kAlice, "\ntenant=bob token=", kBob,
                           "\ntenant=ops token=", kOps, " admin\ntenant=carol token=", kCarol,
                           " max_host_bytes=8192\n"));
  ASSERT_NO_FATAL_FAILURE(RestartSmallWithAHostTier());
  std::unique_ptr<Client> carol = server_->ConnectAs(kCarol);
  std::unique_ptr<Client> ops = server_->ConnectAs(kOps);
  const auto [cache, snapshot] = CacheWithSnapshot(*carol, 64);
  ASSERT_TRUE(carol->DeleteCache(cache).ok());
  absl::StatusOr<v1::EvictSnapshotsResponse> first = ops->EvictSnapshots({.tenant = "carol"});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->pages_moved(), 1u) << "carol's host share is one page";
  const absl::Status full = ops->EvictSnapshots({.tenant = "carol"}).status();
  EXPECT_EQ(full.code(), Code::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("host_bytes"));
  ASSERT_TRUE(carol->ReleaseSnapshot(snapshot).ok());
}

// A server with no tier below the device has nowhere to evict to; one
// without a tokens file has one caller, who may evict but name no tenant.
TEST_F(E2eTenantsTest, EvictSnapshotsNeedsALowerTierAndTenantsNeedATokensFile) {
  alice_.reset();
  bob_.reset();
  server_.reset();
  server_ = TestServer::Start({.tokens_file = tokens_file(), .token = kAlice});
  ASSERT_NE(server_, nullptr);
  alice_ = server_->ConnectAs(kAlice);
  bob_ = server_->ConnectAs(kBob);
  const absl::Status refused = server_->ConnectAs(kOps)->EvictSnapshots().status();
  EXPECT_EQ(refused.code(), Code::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("host_bytes"));

  alice_.reset();
  bob_.reset();
  server_.reset();
  server_ = TestServer::Start({.budget_bytes = 1 << 20, .host_bytes = 4 << 20});
  ASSERT_NE(server_, nullptr);
  absl::StatusOr<v1::EvictSnapshotsResponse> anonymous = server_->client().EvictSnapshots();
  ASSERT_TRUE(anonymous.ok()) << anonymous.status();
  EXPECT_EQ(anonymous->pages_moved(), 0u);
  const absl::Status named = server_->client().ListCaches({.tenant = "bob"}).status();
  EXPECT_EQ(named.code(), Code::kFailedPrecondition);
  EXPECT_THAT(named.message(), HasSubstr("tenant"));
  server_->CleanUpAndCheck();  // TearDown's tenants are not this server's
  server_.reset();
}

// A reload rotates alice's token: the old one is refused from the next call,
// the new one finds everything alice held; a tenant left out of the file
// cannot call until it is named again, and keeps its caches meanwhile; a
// file that does not parse changes nothing.
TEST_F(E2eTenantsTest, ReloadRotatesTokensAndKeepsWhatTenantsHold) {
  const auto [cache, snapshot] = CacheWithSnapshot(*alice_, 12);
  const auto [bobs_cache, bobs_snapshot] = CacheWithSnapshot(*bob_, 4);
  const std::string rotated = "alice-rotated-0123456789abcdef";
  WriteTokens(
      absl::StrCat("tenant=alice token=", rotated, "\ntenant=ops token=", kOps, " admin\n"));
  ASSERT_TRUE(server_->server().ReloadTokens().ok());
  EXPECT_EQ(alice_->GetCache(cache).status().code(), Code::kUnauthenticated);
  EXPECT_EQ(bob_->GetCache(bobs_cache).status().code(), Code::kUnauthenticated);
  auto renewed = server_->ConnectAs(rotated);
  EXPECT_TRUE(renewed->GetCache(cache).ok());
  absl::StatusOr<LayerHistory> history = renewed->FetchLayer("", snapshot, 0);
  ASSERT_TRUE(history.ok()) << history.status();
  EXPECT_EQ(history->tokens, 12u);

  WriteTokens("tenant=alice token=tiny\n");
  const absl::Status bad = server_->server().ReloadTokens();
  EXPECT_EQ(bad.code(), Code::kInvalidArgument) << bad;
  EXPECT_THAT(bad.message(), HasSubstr("line 1"));
  EXPECT_THAT(bad.message(), ::testing::Not(HasSubstr("tiny")));
  EXPECT_TRUE(renewed->GetCache(cache).ok()) << "a bad file changed the tokens in force";

  WriteTokens(absl::StrCat("tenant=alice token=", kAlice, "\ntenant=bob token=", kBob,
                           "\ntenant=ops token=", kOps, " admin\n"));
  ASSERT_TRUE(server_->server().ReloadTokens().ok());
  EXPECT_TRUE(bob_->GetCache(bobs_cache).ok()) << "bob's cache did not outlive his absence";
  EXPECT_TRUE(alice_->GetCache(cache).ok());
  ReleaseAll(*bob_);
}

// Saved files: a tenant's stop at its max_saved_bytes, inside the data dir's
// --disk_bytes that every tenant shares; GetStats shows the caller's own. A
// tokens file that fails to start one of its tenants leaves that budget as
// it found it, though the tenants before it had indexed their files.
TEST_F(E2eTenantsTest, SavedFilesStopAtTheTenantsQuotaInsideTheSharedBudget) {
  const auto [probe_cache, probe] = CacheWithSnapshot(*alice_, 12);
  absl::StatusOr<v1::SavedFile> sized = alice_->SaveSnapshot(probe, "probe");
  ASSERT_TRUE(sized.ok()) << sized.status();
  const uint64_t file = sized->size_bytes();
  ASSERT_TRUE(alice_->DeleteSaved("probe").ok());
  ReleaseAll(*alice_);
  const std::string tokens =
      absl::StrCat("tenant=alice token=", kAlice, "\ntenant=bob token=", kBob,
                   "\ntenant=ops token=", kOps, " admin\ntenant=erin token=", kErin,
                   " max_saved_bytes=", file + file / 2, "\n");
  WriteTokens(tokens);
  alice_.reset();
  bob_.reset();
  server_.reset();
  server_ = TestServer::Start({.data_dir = (dir_ / "data").string(),
                               .disk_bytes = 4 * file,
                               .tokens_file = tokens_file(),
                               .token = kAlice});
  ASSERT_NE(server_, nullptr);
  alice_ = server_->ConnectAs(kAlice);
  bob_ = server_->ConnectAs(kBob);
  auto erin = server_->ConnectAs(kErin);

  const auto [erins_cache, erins] = CacheWithSnapshot(*erin, 12);
  ASSERT_TRUE(erin->SaveSnapshot(erins, "one").ok());
  const absl::StatusOr<v1::SavedFile> refused = erin->SaveSnapshot(erins, "two");
  EXPECT_EQ(refused.status().code(), Code::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("max_saved_bytes"));
  EXPECT_EQ(erin->ListSaved()->size(), 1u);
  absl::StatusOr<v1::Stats> erins_stats = erin->GetStats();
  ASSERT_TRUE(erins_stats.ok()) << erins_stats.status();
  EXPECT_EQ(erins_stats->saved_bytes(), file);
  EXPECT_EQ(erins_stats->max_saved_bytes(), file + file / 2);
  absl::StatusOr<v1::Stats> alices_stats = alice_->GetStats();
  ASSERT_TRUE(alices_stats.ok()) << alices_stats.status();
  EXPECT_EQ(alices_stats->saved_bytes(), 0u);
  EXPECT_EQ(alices_stats->max_saved_bytes(), 4 * file);
  EXPECT_EQ(server_->ConnectAs(kOps)->GetStats()->saved_bytes(), file);  // every tenant's

  // frank has a file already; gina's quota cannot be met, so neither starts.
  const std::filesystem::path franks = dir_ / "data" / "tenants" / "frank";
  std::filesystem::create_directories(franks);
  std::filesystem::copy_file(dir_ / "data" / "tenants" / "erin" / "one.safetensors",
                             franks / "old.safetensors");
  WriteTokens(absl::StrCat(tokens, "tenant=frank token=frank-token-0123456789abcdef\n",
                           "tenant=gina token=gina-token-0123456789abcdef max_host_bytes=1\n"));
  for (int attempt = 0; attempt < 2; ++attempt) {
    const absl::Status reloaded = server_->server().ReloadTokens();
    EXPECT_EQ(reloaded.code(), Code::kInvalidArgument) << reloaded;
    EXPECT_THAT(reloaded.message(), HasSubstr("tenant gina"));
  }
  // Three of the four files' room is left: none went to frank's file.
  const auto [alices_cache, alices] = CacheWithSnapshot(*alice_, 12);
  for (const char* name : {"a", "b", "c"}) {
    const absl::StatusOr<v1::SavedFile> saved = alice_->SaveSnapshot(alices, name);
    EXPECT_TRUE(saved.ok()) << name << ": " << saved.status();
  }
  const absl::StatusOr<v1::SavedFile> full = alice_->SaveSnapshot(alices, "d");
  EXPECT_EQ(full.status().code(), Code::kResourceExhausted) << full.status();
  EXPECT_THAT(full.status().message(), HasSubstr("disk_bytes"));
  ReleaseAll(*erin);
}

}  // namespace
}  // namespace kvcache::testing
