// Prefix sharing through the engine: PublishPrefix, LookupPrefix and the
// entries' lifecycle, against a reference of plain token sequences.
//
// The K/V of position i is a function of the tokens [0, i] (as a model's
// is), so sequences that share a prefix share its K/V, and every restored
// byte can be checked against what a worker would have computed itself.
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "manual_clock.h"
#include "support/gpu_test_base.h"
#include "support/prefix_kv.h"

namespace kvcache::testing {
namespace {

using engine::Engine;
using ::testing::HasSubstr;

constexpr uint64_t kPageBytes = 8 << 10;
constexpr uint64_t kBudgetBytes = 64 << 20;
constexpr uint32_t kPageTokens = 4;
constexpr uint32_t kHeads = 2;
constexpr uint32_t kDim = 8;

using Tokens = std::vector<uint32_t>;

using prefix_kv::KvByte;
using prefix_kv::PrefixHashes;

// What a worker computes for positions [begin, end): [1, H, L, D] tensors.
KvTensors WorkerKv(const std::vector<uint64_t>& hashes, uint32_t layer, uint64_t begin,
                   uint64_t end) {
  constexpr uint32_t kRowBytes = kDim * 2;  // float16
  return KvTensors{.keys = prefix_kv::SideTensor(hashes, layer, 0, kHeads, kRowBytes, begin, end),
                   .values = prefix_kv::SideTensor(hashes, layer, 1, kHeads, kRowBytes, begin, end),
                   .tokens = end - begin};
}

// The same positions as a Fetch shows them: one token of every head.
std::vector<RefToken> ExpectedTokens(const std::vector<uint64_t>& hashes, uint32_t layer,
                                     uint64_t end) {
  std::vector<RefToken> tokens;
  for (uint64_t i = 0; i < end; ++i) {
    RefToken& token = tokens.emplace_back();
    token.position = i;
    for (uint32_t head = 0; head < kHeads; ++head) {
      for (uint32_t d = 0; d < kDim * 2; ++d) {
        token.keys.push_back(KvByte(hashes[i], layer, 0, head, d));
        token.values.push_back(KvByte(hashes[i], layer, 1, head, d));
      }
    }
  }
  return tokens;
}

uint64_t CommonPrefix(const Tokens& a, const Tokens& b) {
  uint64_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

class PrefixSharingTest : public GpuTestBase {
 protected:
  void SetUp() override {
    GpuTestBase::SetUp();
    pool_ = MakePool(kPageBytes, kBudgetBytes);
    ASSERT_NE(pool_, nullptr);
    StartEngine(Spec());
  }
  void TearDown() override {
    if (engine_ != nullptr) {
      ReleaseEverything(*engine_);
      EXPECT_TRUE(engine_->ListPrefixes().empty()) << "entries outlived their snapshots";
      EXPECT_EQ(engine_->Stats().prefixes.entries, 0u);
      EXPECT_EQ(pool_->stats().used_pages, 0u) << "pages leaked";
    }
    engine_.reset();
    pool_.reset();
    GpuTestBase::TearDown();
  }
  void StartEngine(engine::CacheSpec spec, const engine::LeaseClock* clock = nullptr) {
    spec_ = std::move(spec);
    engine_.reset();
    engine_ = std::make_unique<Engine>(
        *pool_, engine::EngineOptions{.page_tokens = kPageTokens, .clock = clock});
  }
  static engine::CacheSpec Spec() {
    return MakeSpec({StandardLayerSpec(kHeads, kDim), StandardLayerSpec(kHeads, kDim)});
  }

  // A worker's prefill of `tokens`, `chunk` tokens an Update (0: all at
  // once): a cache, its K/V, a snapshot [0, n) of it; the cache is deleted,
  // so only the snapshot holds the pages.
  std::string Prefill(const Tokens& tokens, uint64_t chunk = 0) {
    auto cache = engine_->CreateCache(spec_);
    EXPECT_TRUE(cache.ok()) << cache.status();
    if (!cache.ok()) return "";
    const std::vector<uint64_t> hashes = PrefixHashes(tokens);
    if (chunk == 0) chunk = tokens.size();
    for (uint64_t begin = 0; begin < tokens.size(); begin += chunk) {
      const uint64_t end = std::min<uint64_t>(begin + chunk, tokens.size());
      for (uint32_t layer = 0; layer < spec_.layers.size(); ++layer) {
        const KvTensors kv = WorkerKv(hashes, layer, begin, end);
        auto offset = engine_->Update(cache->cache_id, layer, kv.input());
        EXPECT_TRUE(offset.ok()) << offset.status();
      }
    }
    auto snapshot = engine_->Snapshot(cache->cache_id, 0);
    EXPECT_TRUE(snapshot.ok()) << snapshot.status();
    EXPECT_TRUE(engine_->DeleteCache(cache->cache_id).ok());
    return snapshot.ok() ? snapshot->snapshot_id : "";
  }

  // Publishes the first `n` of `tokens` from a fresh prefill, then releases
  // the worker's own snapshot (the entry keeps what it needs).
  engine::PublishedPrefix PrefillAndPublish(const Tokens& tokens, uint64_t n) {
    const std::string snapshot = Prefill(tokens);
    auto published =
        engine_->PublishPrefix("", snapshot, absl::MakeConstSpan(tokens).subspan(0, n));
    EXPECT_TRUE(published.ok()) << published.status();
    EXPECT_TRUE(engine_->ReleaseSnapshot(snapshot).ok());
    return published.ok() ? *published : engine::PublishedPrefix{};
  }

  // The random publish / lookup / release test's body (below).
  void RunRandomSequences(uint64_t seed, int steps);

  // A pool of these options under a fresh engine.
  void UsePool(gpu::PoolOptions options) {
    engine_.reset();
    auto pool = gpu::PagePool::Create(device(), options);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
    StartEngine(Spec());
  }

  // A fresh cache restored from `handle` holds exactly `tokens`' K/V.
  void ExpectRestores(const std::string& handle, const Tokens& tokens) {
    auto cache = engine_->CreateCache(spec_);
    ASSERT_TRUE(cache.ok()) << cache.status();
    auto restored = engine_->Restore(cache->cache_id, handle, tokens.size());
    ASSERT_TRUE(restored.ok()) << restored.status();
    auto view = engine_->Freeze(cache->cache_id, "");
    ASSERT_TRUE(view.ok()) << view.status();
    const std::vector<uint64_t> hashes = PrefixHashes(tokens);
    for (uint32_t layer = 0; layer < spec_.layers.size(); ++layer) {
      auto fetched = FetchLayer(**view, layer, kEverything);
      ASSERT_TRUE(fetched.ok()) << fetched.status();
      EXPECT_TRUE(SameTokens(ExpectedTokens(hashes, layer, tokens.size()), *fetched))
          << "layer " << layer;
    }
    view->reset();
    EXPECT_TRUE(engine_->DeleteCache(cache->cache_id).ok());
  }

  // A worker that finds `query`'s prefix: a fresh cache restored from the
  // handle at the matched length. Checks every byte, that the restore took
  // no page (unless other threads run), and releases all it made. Returns
  // the matched length.
  uint64_t LookupAndRestore(const Tokens& query, bool alone = true) {
    auto found = engine_->LookupPrefix("", spec_, query);
    EXPECT_TRUE(found.ok()) << found.status();
    if (!found.ok() || !found->handle.has_value()) return 0;
    auto cache = engine_->CreateCache(spec_);
    EXPECT_TRUE(cache.ok()) << cache.status();
    const uint32_t pages_before = pool_->stats().used_pages;
    auto restored =
        engine_->Restore(cache->cache_id, found->handle->snapshot_id, found->matched_tokens);
    EXPECT_TRUE(restored.ok()) << restored.status();
    if (alone) {
      EXPECT_EQ(pool_->stats().used_pages, pages_before) << "a restore copied pages";
    }
    auto view = engine_->Freeze(cache->cache_id, "");
    EXPECT_TRUE(view.ok()) << view.status();
    const std::vector<uint64_t> hashes = PrefixHashes(query);
    for (uint32_t layer = 0; view.ok() && layer < spec_.layers.size(); ++layer) {
      auto fetched = FetchLayer(**view, layer, kEverything);
      EXPECT_TRUE(fetched.ok()) << fetched.status();
      if (fetched.ok()) {
        EXPECT_TRUE(SameTokens(ExpectedTokens(hashes, layer, found->matched_tokens), *fetched))
            << "layer " << layer;
      }
    }
    EXPECT_TRUE(engine_->DeleteCache(cache->cache_id).ok());
    EXPECT_TRUE(engine_->ReleaseSnapshot(found->handle->snapshot_id).ok());
    return found->matched_tokens;
  }

  ManualClock clock_;  // outlives engine_, which may read it
  std::unique_ptr<gpu::PagePool> pool_;
  std::unique_ptr<Engine> engine_;
  engine::CacheSpec spec_;
};

// Random publish / lookup / restore / release against a map of entry id to
// tokens. A lookup must match the longest common prefix with any entry; an
// entry the engine drops must be a strict prefix of one it keeps (nothing a
// lookup could find is lost), or counted as dropped for room.
void PrefixSharingTest::RunRandomSequences(uint64_t seed, int steps) {
  std::mt19937_64 rng(seed);
  std::vector<Tokens> stems;
  for (int i = 0; i < 5; ++i) {
    Tokens stem(1 + rng() % 40);
    for (uint32_t& token : stem) token = rng() % 6;
    stems.push_back(stem);
  }
  const auto random_sequence = [&] {
    Tokens tokens = stems[rng() % stems.size()];
    tokens.resize(1 + rng() % tokens.size());
    for (uint64_t tail = rng() % 24; tail > 0; --tail) tokens.push_back(rng() % 6);
    return tokens;
  };
  std::map<std::string, Tokens> reference;
  uint64_t dropped_before = 0;
  // Syncs `reference` with what the engine keeps: an entry that went must be
  // covered by a longer one it keeps, or be one of those dropped for room.
  const auto sync = [&] {
    std::map<std::string, Tokens> kept;
    for (const engine::PrefixEntry& entry : engine_->ListPrefixes()) {
      auto it = reference.find(entry.snapshot.snapshot_id);
      ASSERT_NE(it, reference.end()) << "an entry nobody published";
      EXPECT_EQ(entry.tokens, it->second.size());
      kept.insert(*it);
    }
    uint64_t uncovered = 0;
    for (const auto& [id, gone] : reference) {
      if (kept.contains(id)) continue;
      uncovered += std::none_of(kept.begin(), kept.end(), [&](const auto& entry) {
        return entry.second.size() > gone.size() && CommonPrefix(entry.second, gone) == gone.size();
      });
    }
    const uint64_t dropped = engine_->Stats().prefixes.dropped;
    EXPECT_LE(uncovered, dropped - dropped_before) << "an entry was lost";
    dropped_before = dropped;
    reference = std::move(kept);
  };
  uint64_t hits = 0;
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    const uint64_t op = rng() % 100;
    if (op < 40) {
      const Tokens tokens = random_sequence();
      const uint64_t n = 1 + rng() % tokens.size();
      const engine::PublishedPrefix published = PrefillAndPublish(tokens, n);
      if (!published.entry.snapshot_id.empty()) {  // a failure fails the test already
        reference[published.entry.snapshot_id] = Tokens(tokens.begin(), tokens.begin() + n);
      }
    } else if (op < 90) {
      const Tokens query = random_sequence();
      uint64_t expected = 0;
      for (const auto& [id, tokens] : reference) {
        expected = std::max(expected, CommonPrefix(query, tokens));
      }
      // Where nothing is dropped a restore takes no page; in a tight pool it
      // may bring pages back from host memory.
      const bool roomy = pool_->stats().max_host_pages == 0;
      EXPECT_EQ(LookupAndRestore(query, roomy), expected);
      hits += expected > 0;
    } else if (!reference.empty()) {
      auto victim = std::next(reference.begin(), rng() % reference.size());
      ASSERT_TRUE(engine_->ReleaseSnapshot(victim->first).ok());
      reference.erase(victim);
    }
    sync();
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(hits, steps / 8) << "the sequences should share prefixes often";
  EXPECT_EQ(engine_->Stats().prefixes.entries, reference.size());
}

TEST_P(PrefixSharingTest, RandomSequencesMatchTheReference) {
  RunRandomSequences(20261125, 400);
  EXPECT_EQ(engine_->Stats().prefixes.dropped, 0u) << "the pool has room for all";
}

// The same in a device of 64 pages over 32 of host memory (a sequence takes
// up to 32, and a publish holds its own and an earlier entry's on the
// device): entries move down and come back, the least recently used are
// dropped, and every match and every restored byte still agrees with what
// the engine keeps.
TEST_P(PrefixSharingTest, RandomSequencesInATightPoolMatchTheReference) {
  UsePool(gpu::PoolOptions{
      .page_bytes = kPageBytes, .budget_bytes = 64 * kPageBytes, .host_bytes = 32 * kPageBytes});
  RunRandomSequences(20261127, 400);
  const engine::EngineStats stats = engine_->Stats();
  std::printf("[ prefixes ] %llu entries kept, %llu dropped, %llu pages evicted, %llu back\n",
              (unsigned long long)stats.prefixes.entries,
              (unsigned long long)stats.prefixes.dropped, (unsigned long long)stats.pool.evictions,
              (unsigned long long)stats.pool.promotions_from_host);
  EXPECT_GT(stats.prefixes.dropped, 0u) << "the pool should have been too small";
  EXPECT_GT(stats.pool.evictions, 0u) << "nothing was evicted";
}

// Two workers publish the same system prompt: one copy of its pages stays.
// A third publishes it with a different continuation: the common whole pages
// are shared, only the rest is new.
TEST_P(PrefixSharingTest, PublishingWhatIsCachedSharesItsPages) {
  Tokens prompt(64);
  for (uint32_t i = 0; i < prompt.size(); ++i) prompt[i] = 1000 + i;
  const engine::PublishedPrefix first = PrefillAndPublish(prompt, prompt.size());
  EXPECT_FALSE(first.already_published);
  const uint32_t one_copy = pool_->stats().used_pages;
  EXPECT_EQ(one_copy, 2 * prompt.size() / kPageTokens);  // two layers

  const engine::PublishedPrefix second = PrefillAndPublish(prompt, prompt.size());
  EXPECT_TRUE(second.already_published);
  EXPECT_EQ(second.entry.snapshot_id, first.entry.snapshot_id);
  EXPECT_EQ(pool_->stats().used_pages, one_copy);

  Tokens longer = prompt;
  longer.resize(62);  // diverges two tokens before the end of page 16
  for (uint32_t i = 0; i < 10; ++i) longer.push_back(7 + i);
  const engine::PublishedPrefix third = PrefillAndPublish(longer, longer.size());
  EXPECT_EQ(third.shared_tokens, 60u);  // whole pages of the match
  // Pages 15.. (positions 60-71) are new on each layer: 3 pages a layer.
  EXPECT_EQ(pool_->stats().used_pages, one_copy + 2 * 3);
  EXPECT_EQ(LookupAndRestore(longer), longer.size());
  EXPECT_EQ(LookupAndRestore(prompt), prompt.size());
}

// Publishing a longer sequence drops the entry it extends; lookups of the
// shorter one still match all of it.
TEST_P(PrefixSharingTest, AnEntryThatIsExtendedGivesWayToTheLongerOne) {
  Tokens turns = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const engine::PublishedPrefix system = PrefillAndPublish(turns, 5);
  const engine::PublishedPrefix chat = PrefillAndPublish(turns, 9);
  EXPECT_EQ(chat.shared_tokens, 4u);
  ASSERT_EQ(engine_->ListPrefixes().size(), 1u);
  EXPECT_EQ(engine_->ListPrefixes()[0].snapshot.snapshot_id, chat.entry.snapshot_id);
  EXPECT_EQ(absl::StatusCode::kNotFound, engine_->ReleaseSnapshot(system.entry.snapshot_id).code());
  EXPECT_EQ(LookupAndRestore({1, 2, 3, 4, 5, 99}), 5u);
  const engine::PrefixStats stats = engine_->Stats().prefixes;
  EXPECT_EQ(stats.lookups, 1u);
  EXPECT_EQ(stats.hits, 1u);
  EXPECT_EQ(stats.matched_tokens, 5u);
  EXPECT_EQ(engine_->ListPrefixes()[0].hits, 1u);
}

// ...but never a pinned entry, nor one that outlives the longer one: a pinned
// system prompt stays when a chat that extends it is published for a minute.
TEST_P(PrefixSharingTest, APinnedOrLongerLivedEntryStaysWhenExtended) {
  const Tokens turns = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const engine::PublishedPrefix system = PrefillAndPublish(turns, 5);
  ASSERT_TRUE(engine_->SetPinned(system.entry.snapshot_id, true).ok());
  const std::string chat_snapshot = Prefill(turns);
  auto chat = engine_->PublishPrefix("", chat_snapshot, turns, absl::Seconds(60));
  ASSERT_TRUE(chat.ok()) << chat.status();
  ASSERT_TRUE(engine_->ReleaseSnapshot(chat_snapshot).ok());
  EXPECT_EQ(engine_->ListPrefixes().size(), 2u);
  ASSERT_TRUE(engine_->ReleaseSnapshot(chat->entry.snapshot_id).ok());
  EXPECT_EQ(LookupAndRestore({1, 2, 3, 4, 5, 6}), 5u) << "the pinned prompt went with the chat";
  ASSERT_TRUE(engine_->SetPinned(system.entry.snapshot_id, false).ok());
}

TEST_P(PrefixSharingTest, BadInputIsRefusedAndChangesNothing) {
  const Tokens tokens = {4, 5, 6, 7, 8, 9};
  const std::string snapshot = Prefill(tokens);
  PrefillAndPublish({1, 2, 3}, 3);
  const EngineFingerprint before = Fingerprint(*engine_);
  const auto refused = [&](absl::StatusCode code, absl::string_view field,
                           const absl::Status& status) {
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_THAT(status.message(), HasSubstr(field));
    EXPECT_EQ(Fingerprint(*engine_), before);
    EXPECT_EQ(engine_->ListPrefixes().size(), 1u);
  };
  refused(absl::StatusCode::kInvalidArgument, "tokens",
          engine_->PublishPrefix("", snapshot, {}).status());
  refused(absl::StatusCode::kInvalidArgument, "tokens",
          engine_->PublishPrefix("", snapshot, {4, 5, 6, 7, 8, 9, 10}).status());
  refused(absl::StatusCode::kNotFound, "snapshot_id",
          engine_->PublishPrefix("", "0123456789abcdef0123456789abcdef", {4}).status());
  refused(absl::StatusCode::kInvalidArgument, "tokens",
          engine_->LookupPrefix("", spec_, {}).status());
  engine::CacheSpec broken = spec_;
  broken.layers[1].num_kv_heads = 0;
  refused(absl::StatusCode::kInvalidArgument, "spec.layers[1]",
          engine_->LookupPrefix("", broken, {1, 2, 3}).status());

  // Starting past 0, or more than one row: not a prefix.
  auto cache = engine_->CreateCache(spec_);
  ASSERT_TRUE(cache.ok());
  const std::vector<uint64_t> hashes = PrefixHashes(tokens);
  for (uint32_t layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(
        engine_->Update(cache->cache_id, layer, WorkerKv(hashes, layer, 0, 6).input()).ok());
  }
  auto tail = engine_->Snapshot(cache->cache_id, 2);
  ASSERT_TRUE(tail.ok());
  const EngineFingerprint with_tail = Fingerprint(*engine_);
  auto status = engine_->PublishPrefix("", tail->snapshot_id, {6, 7}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_EQ(Fingerprint(*engine_), with_tail);

  // A layout mismatch is a miss, never another layout's bytes.
  engine::CacheSpec other = MakeSpec({StandardLayerSpec(kHeads, kDim)});
  auto miss = engine_->LookupPrefix("", other, {1, 2, 3});
  ASSERT_TRUE(miss.ok()) << miss.status();
  EXPECT_FALSE(miss->handle.has_value());
  EXPECT_EQ(miss->matched_tokens, 0u);
  other = spec_;
  other.model = "another-model";
  EXPECT_FALSE(engine_->LookupPrefix("", other, {1, 2, 3})->handle.has_value());
  // Nor another namespace's.
  EXPECT_FALSE(engine_->LookupPrefix("tenant-b", spec_, {1, 2, 3})->handle.has_value());
  EXPECT_EQ(engine_->ListPrefixes().size(), 1u);
}

TEST_P(PrefixSharingTest, BatchedSnapshotsAreNotPrefixes) {
  engine::CacheSpec batched = Spec();
  batched.batch_size = 2;
  auto cache = engine_->CreateCache(batched);
  ASSERT_TRUE(cache.ok());
  std::mt19937_64 rng(3);
  for (uint32_t layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(
        engine_->Update(cache->cache_id, layer, RandomKv(batched, layer, 3, rng).input()).ok());
  }
  auto snapshot = engine_->Snapshot(cache->cache_id, 0);
  ASSERT_TRUE(snapshot.ok());
  auto status = engine_->PublishPrefix("", snapshot->snapshot_id, {1, 2, 3}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(status.message(), HasSubstr("batch_size 2"));
  EXPECT_TRUE(engine_->ListPrefixes().empty());
}

// A rotating window is the state at its snapshot's end: such a layout
// publishes a snapshot where the prefix ends, and matches only whole entries.
TEST_P(PrefixSharingTest, RotatingLayoutsMatchWholeEntriesOnly) {
  StartEngine(MakeSpec({RotatingLayerSpec(kHeads, kDim, kDim, /*max_size=*/8, /*keep=*/0)}));
  const Tokens tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const std::string snapshot = Prefill(tokens, /*chunk=*/1);  // decode steps: an 8-token window
  auto cut = engine_->PublishPrefix("", snapshot, {1, 2, 3, 4, 5});
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kFailedPrecondition) << cut.status();
  EXPECT_THAT(cut.status().message(), HasSubstr("where its prefix ends"));
  ASSERT_TRUE(engine_->PublishPrefix("", snapshot, tokens).ok());
  ASSERT_TRUE(engine_->ReleaseSnapshot(snapshot).ok());

  Tokens longer = tokens;
  longer.push_back(13);
  auto whole = engine_->LookupPrefix("", spec_, longer);
  ASSERT_TRUE(whole.ok() && whole->handle.has_value());
  EXPECT_EQ(whole->matched_tokens, tokens.size());
  auto cache = engine_->CreateCache(spec_);
  ASSERT_TRUE(cache.ok());
  ASSERT_TRUE(engine_->Restore(cache->cache_id, whole->handle->snapshot_id, tokens.size()).ok());
  auto view = engine_->Freeze(cache->cache_id, "");
  ASSERT_TRUE(view.ok());
  auto fetched = FetchLayer(**view, 0, kEverything);
  ASSERT_TRUE(fetched.ok());
  // The window: the last 8 positions.
  std::vector<RefToken> expected = ExpectedTokens(PrefixHashes(tokens), 0, tokens.size());
  expected.erase(expected.begin(), expected.end() - 8);
  EXPECT_TRUE(SameTokens(expected, *fetched));

  const Tokens diverging = {1, 2, 3, 4, 5, 6, 99};
  auto partial = engine_->LookupPrefix("", spec_, diverging);
  ASSERT_TRUE(partial.ok());
  EXPECT_FALSE(partial->handle.has_value()) << "a window cannot be cut back to 6 tokens";
}

// Entries and lookup handles are leased: lookups renew an entry; one nobody
// looks up expires, and so does a handle nobody uses.
TEST_P(PrefixSharingTest, EntriesAndHandlesExpireUnlessUsed) {
  StartEngine(Spec(), &clock_);
  const Tokens tokens = {1, 2, 3, 4, 5, 6};
  const std::string snapshot = Prefill(tokens);
  ASSERT_TRUE(engine_->PublishPrefix("", snapshot, tokens, absl::Seconds(60)).ok());
  ASSERT_TRUE(engine_->ReleaseSnapshot(snapshot).ok());
  for (int minute = 0; minute < 3; ++minute) {
    clock_.Advance(absl::Seconds(45));
    auto found = engine_->LookupPrefix("", spec_, tokens, absl::Seconds(10));
    ASSERT_TRUE(found.ok() && found->handle.has_value()) << "renewed by the lookup before";
  }
  clock_.Advance(absl::Seconds(30));
  EXPECT_EQ(engine_->ExpireLeases().second, 3u);  // the three handles, unused
  EXPECT_EQ(engine_->ListPrefixes().size(), 1u);
  clock_.Advance(absl::Seconds(31));
  EXPECT_EQ(engine_->ExpireLeases().second, 1u);
  EXPECT_TRUE(engine_->ListPrefixes().empty());
  EXPECT_FALSE(engine_->LookupPrefix("", spec_, tokens)->handle.has_value());
  EXPECT_EQ(pool_->stats().used_pages, 0u);
}

// An entry is evicted like any snapshot: when the device is full, its pages
// move to host memory; a lookup and restore brings them back, bytes intact.
TEST_P(PrefixSharingTest, EntriesAreEvictedToHostMemoryAndComeBack) {
  constexpr uint32_t kDevicePages = 32;
  UsePool(gpu::PoolOptions{.page_bytes = kPageBytes,
                           .budget_bytes = kDevicePages * kPageBytes,
                           .host_bytes = 64 * kPageBytes});
  Tokens prompt(40);  // 10 pages on each of 2 layers
  for (uint32_t i = 0; i < prompt.size(); ++i) prompt[i] = 70 + i;
  PrefillAndPublish(prompt, prompt.size());
  // A worker's handle from a lookup does not keep the entry on the device.
  auto handle = engine_->LookupPrefix("", spec_, prompt);
  ASSERT_TRUE(handle.ok() && handle->handle.has_value());
  // A live cache that needs 24 of the 32 pages: some of the entry's must go.
  auto cache = engine_->CreateCache(spec_);
  ASSERT_TRUE(cache.ok());
  Tokens other(48);
  for (uint32_t i = 0; i < other.size(); ++i) other[i] = 900 + i;
  const std::vector<uint64_t> hashes = PrefixHashes(other);
  for (uint32_t layer = 0; layer < 2; ++layer) {
    auto updated = engine_->Update(cache->cache_id, layer, WorkerKv(hashes, layer, 0, 48).input());
    ASSERT_TRUE(updated.ok()) << updated.status();
  }
  ASSERT_EQ(engine_->ListPrefixes().size(), 1u);
  EXPECT_GT(engine_->ListPrefixes()[0].snapshot.tiers.host, 0u);
  EXPECT_GT(pool_->stats().host_pages, 0u);
  ASSERT_TRUE(engine_->DeleteCache(cache->cache_id).ok());
  EXPECT_EQ(LookupAndRestore(prompt, /*alone=*/false), prompt.size());
  EXPECT_EQ(engine_->ListPrefixes()[0].snapshot.tiers.host, 0u) << "restored from the device";
  ReleaseEverything(*engine_);
  EXPECT_EQ(pool_->stats().host_pages, 0u);
}

// `length` consecutive token ids from `first` (16: 4 pages on each of 2 layers).
Tokens Prompt(uint32_t first, uint32_t length = 16) {
  Tokens tokens(length);
  for (uint32_t i = 0; i < length; ++i) tokens[i] = first + i;
  return tokens;
}

// A live cache holding the K/V of Prompt(first, tokens).
absl::StatusOr<std::string> LiveCache(Engine& engine, const engine::CacheSpec& spec, uint32_t first,
                                      uint64_t tokens) {
  ASSIGN_OR_RETURN(engine::CacheInfo cache, engine.CreateCache(spec));
  const std::vector<uint64_t> hashes = PrefixHashes(Prompt(first, tokens));
  for (uint32_t layer = 0; layer < spec.layers.size(); ++layer) {
    RETURN_IF_ERROR(
        engine.Update(cache.cache_id, layer, WorkerKv(hashes, layer, 0, tokens).input()).status());
  }
  return cache.cache_id;
}

// Entries are the server's cache: a full device drops the least recently
// used unpinned ones to serve a live cache, never a pinned one, and refuses
// only when nothing else can go.
TEST_P(PrefixSharingTest, AFullDeviceDropsTheLeastRecentlyUsedEntries) {
  UsePool(gpu::PoolOptions{.page_bytes = kPageBytes, .budget_bytes = 32 * kPageBytes});
  const Tokens a = Prompt(100), b = Prompt(200), c = Prompt(300), d = Prompt(400);
  for (const Tokens* prompt : {&a, &b, &c}) PrefillAndPublish(*prompt, prompt->size());
  const std::string pinned = PrefillAndPublish(d, d.size()).entry.snapshot_id;
  ASSERT_EQ(pool_->stats().used_pages, 32u) << "four entries fill the device";
  ASSERT_TRUE(engine_->SetPinned(pinned, true).ok());
  EXPECT_EQ(LookupAndRestore(a), a.size());  // a is now the most recent; b the least

  auto first = LiveCache(*engine_, spec_, 900, 16);  // 8 pages: b's entry goes
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(engine_->Stats().prefixes.dropped, 1u);
  EXPECT_EQ(LookupAndRestore(b, /*alone=*/false), 0u) << "b was the least recently used";
  auto second = LiveCache(*engine_, spec_, 950, 32);  // 16 pages: c, then a
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(engine_->Stats().prefixes.dropped, 3u);
  ASSERT_EQ(engine_->ListPrefixes().size(), 1u);
  EXPECT_EQ(engine_->ListPrefixes()[0].snapshot.snapshot_id, pinned);

  // Only the pinned entry is left: refused, naming the pool, and it stays.
  auto third = LiveCache(*engine_, spec_, 990, 4);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr(gpu::kPoolExhausted));
  EXPECT_EQ(engine_->ListPrefixes().size(), 1u);
  ASSERT_TRUE(engine_->SetPinned(pinned, false).ok());
}

// A worker's handle holds its own snapshot: the entry it came from may be
// dropped, and the handle still restores every byte.
TEST_P(PrefixSharingTest, AHandleOutlivesItsDroppedEntry) {
  UsePool(gpu::PoolOptions{.page_bytes = kPageBytes, .budget_bytes = 32 * kPageBytes});
  const Tokens a = Prompt(100);
  PrefillAndPublish(a, a.size());
  auto handle = engine_->LookupPrefix("", spec_, a);
  ASSERT_TRUE(handle.ok() && handle->handle.has_value());
  for (uint32_t first : {200, 300, 400}) {
    const Tokens prompt = Prompt(first);
    PrefillAndPublish(prompt, prompt.size());
    EXPECT_EQ(LookupAndRestore(prompt), prompt.size());
  }
  // a's entry is the least recent, but its pages are the handle's too:
  // dropping it frees nothing, so the next entry goes as well.
  auto cache = LiveCache(*engine_, spec_, 900, 16);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(engine_->Stats().prefixes.dropped, 2u);
  EXPECT_EQ(engine_->ListPrefixes().size(), 2u);
  ASSERT_TRUE(engine_->DeleteCache(*cache).ok());
  ExpectRestores(handle->handle->snapshot_id, a);
}

// With tiers, entries first move down; only when host memory (and disk) are
// full too does the least recently used one go.
TEST_P(PrefixSharingTest, EntriesAreDroppedOnlyWhenEveryTierIsFull) {
  UsePool(gpu::PoolOptions{
      .page_bytes = kPageBytes, .budget_bytes = 16 * kPageBytes, .host_bytes = 16 * kPageBytes});
  std::vector<Tokens> prompts;
  for (uint32_t first : {100, 200, 300, 400}) {
    prompts.push_back(Prompt(first));
    PrefillAndPublish(prompts.back(), prompts.back().size());
  }
  EXPECT_EQ(engine_->Stats().prefixes.dropped, 0u) << "32 pages fit device and host";
  EXPECT_EQ(pool_->stats().host_pages, 16u);
  auto cache = LiveCache(*engine_, spec_, 900, 16);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(engine_->Stats().prefixes.dropped, 1u);
  ASSERT_TRUE(engine_->DeleteCache(*cache).ok());
  EXPECT_EQ(LookupAndRestore(prompts[0], /*alone=*/false), 0u) << "the oldest went";
  for (size_t i = 1; i < prompts.size(); ++i) {
    EXPECT_EQ(LookupAndRestore(prompts[i], /*alone=*/false), prompts[i].size());
  }
}

// Entries already below the device free nothing on it: when live caches
// hold every device page, a refused call drops no entry.
TEST_P(PrefixSharingTest, EntriesBelowAFullDeviceAreNotDroppedForNothing) {
  UsePool(gpu::PoolOptions{
      .page_bytes = kPageBytes, .budget_bytes = 32 * kPageBytes, .host_bytes = 64 * kPageBytes});
  for (uint32_t first : {100, 200, 300}) PrefillAndPublish(Prompt(first), 16);
  auto moved = engine_->EvictIdleBytes(0);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(*moved, 24u);
  auto full = LiveCache(*engine_, spec_, 900, 64);  // 32 pages: the whole device
  ASSERT_TRUE(full.ok()) << full.status();
  auto refused = LiveCache(*engine_, spec_, 990, 4);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr(gpu::kPoolExhausted));
  EXPECT_EQ(engine_->Stats().prefixes.dropped, 0u);
  EXPECT_EQ(engine_->ListPrefixes().size(), 3u);
  for (const engine::CacheInfo& cache : engine_->ListCaches()) {
    ASSERT_TRUE(engine_->DeleteCache(cache.cache_id).ok());
  }
  EXPECT_EQ(LookupAndRestore(Prompt(200), /*alone=*/false), 16u);
}

// A fleet that publishes for ever is never refused for the metadata budget:
// the oldest entries make room, the newest answer.
TEST_P(PrefixSharingTest, PublishingForEverStaysWithinTheMetadataBudget) {
  const uint64_t base = engine_->Stats().metadata_bytes;
  PrefillAndPublish(Prompt(10), 16);
  const uint64_t per_entry = engine_->Stats().metadata_bytes - base;
  ReleaseEverything(*engine_);
  engine_.reset();
  engine_ = std::make_unique<Engine>(
      *pool_,
      engine::EngineOptions{.page_tokens = kPageTokens, .metadata_bytes = base + 8 * per_entry});
  for (uint32_t i = 0; i < 40; ++i) PrefillAndPublish(Prompt(1000 * (i + 1)), 16);
  const engine::EngineStats stats = engine_->Stats();
  EXPECT_LE(stats.metadata_bytes, stats.max_metadata_bytes);
  EXPECT_GT(stats.prefixes.dropped, 0u);
  EXPECT_EQ(stats.prefixes.entries + stats.prefixes.dropped, 40u);
  EXPECT_EQ(LookupAndRestore(Prompt(40000), /*alone=*/false), 16u) << "the newest stays";
}

// A KV-event ledger's blocks (prefix_blocks.h) live as long as the entries
// that hold them: each entry's charge covers what it may add there.
TEST_P(PrefixSharingTest, AnEntryIsChargedForItsBlocksInTheKvEventLedger) {
  struct Discard final : engine::BlockEventSink {
    void Emit(engine::BlockEvent) override {}
  } sink;
  engine::PrefixBlocks ledger(4, &sink);
  const Tokens prompt = Prompt(10);
  auto entry_bytes = [&](engine::PrefixBlocks* blocks) {
    engine_.reset();
    engine_ = std::make_unique<Engine>(
        *pool_, engine::EngineOptions{.page_tokens = kPageTokens, .prefix_blocks = blocks});
    const uint64_t base = engine_->Stats().metadata_bytes;
    PrefillAndPublish(prompt, 16);
    const uint64_t bytes = engine_->Stats().metadata_bytes - base;
    ReleaseEverything(*engine_);
    return bytes;
  };
  const uint64_t without = entry_bytes(nullptr);
  const uint64_t with = entry_bytes(&ledger);
  StartEngine(Spec());  // none that points at the ledger outlives it
  EXPECT_EQ(ledger.blocks(), 0u) << "released entries leave no block";
  // Four blocks of four token ids (16 bytes each on the heap) and their
  // 8-byte hashes as map keys, at the least.
  EXPECT_GE(with - without, 4 * (16 + 8));
  EXPECT_EQ(with - without, 4 * ledger.MaxBytesPerBlock());
}

// Workers publishing and looking up the same prefixes at once: every restore
// is byte-exact (the checks run in each thread).
TEST_P(PrefixSharingTest, ConcurrentWorkersAgree) {
  Tokens system(24);
  for (uint32_t i = 0; i < system.size(); ++i) system[i] = 500 + i;
  PrefillAndPublish(system, system.size());
  std::vector<std::thread> workers;
  for (int w = 0; w < 4; ++w) {
    workers.emplace_back([this, w, &system] {
      std::mt19937_64 rng(w);
      for (int i = 0; i < 25; ++i) {
        Tokens tokens = system;
        for (uint64_t tail = 1 + rng() % 12; tail > 0; --tail) tokens.push_back(rng() % 3);
        EXPECT_GE(LookupAndRestore(tokens, /*alone=*/false), system.size());
        PrefillAndPublish(tokens, tokens.size());
      }
    });
  }
  for (std::thread& worker : workers) worker.join();
  EXPECT_GE(engine_->Stats().prefixes.hits, 100u);
}

INSTANTIATE_TEST_SUITE_P(TransferPaths, PrefixSharingTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
