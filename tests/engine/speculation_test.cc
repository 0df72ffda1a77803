// The rules of speculation (engine/speculation/speculation.h), one test each:
// ids, one open speculation per cache, live changes refused while it is open
// (snapshots and reads allowed), unknown and ended ids, accepted beyond the
// drafted tokens, drafted layers out of step, a recurrent layer without a state
// at the accepted offset, isolation, deletion. Every refusal changes nothing:
// not the engine's caches, snapshots and pages, not the open speculation.
#include <algorithm>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "speculation_test_util.h"

namespace kvcache::testing {
namespace {

constexpr auto kRefused = absl::StatusCode::kFailedPrecondition;
constexpr auto kNotFound = absl::StatusCode::kNotFound;
constexpr char kUnknownId[] = "0123456789abcdef0123456789abcdef";

TEST_P(SpeculationTest, BeginGivesUnguessableIdsAndDescribesTheCommittedHistory) {
  std::set<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    SpeculatingCache cache(*engine_, MixedLayout());
    ASSERT_TRUE(cache.Step(5));
    absl::StatusOr<engine::SpeculationInfo> info = engine_->BeginSpeculation(cache.id(), i % 2);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->speculation_id.size(), 32u);
    EXPECT_TRUE(std::all_of(info->speculation_id.begin(), info->speculation_id.end(),
                            [](char c) { return absl::ascii_isxdigit(c) && !absl::ascii_isupper(c); }));
    EXPECT_EQ(info->cache_id, cache.id());
    EXPECT_EQ(info->isolated, i % 2 == 1);
    EXPECT_EQ(info->committed_offset, 5u);
    EXPECT_EQ(info->layer_offsets, std::vector<uint64_t>(5, 5));
    ids.insert(info->speculation_id);
  }
  EXPECT_EQ(ids.size(), 4u);
}

TEST_P(SpeculationTest, OneOpenSpeculationPerCache) {
  SpeculatingCache cache(*engine_, StandardSpec());
  ASSERT_TRUE(cache.Step(3));
  ASSERT_TRUE(cache.Begin(false));
  ASSERT_TRUE(cache.Draft(2));
  for (bool isolated : {false, true}) {
    ExpectRefused(kRefused, "cache_id", cache.speculation_id(),
                  [&] { return engine_->BeginSpeculation(cache.id(), isolated); });
  }
  ASSERT_TRUE(cache.Commit(1).ok());
  ASSERT_TRUE(cache.Begin(true));  // the next one, once it ended
  EXPECT_TRUE(cache.Abort());
  EXPECT_TRUE(cache.Matches());
}

TEST_P(SpeculationTest, BeginNeedsLayersInStep) {
  SpeculatingCache cache(*engine_, MixedLayout());
  ASSERT_TRUE(cache.Step(2));
  std::mt19937_64 rng(1);
  const KvTensors kv = RandomKv(cache.spec(), 0, 1, rng);
  ASSERT_TRUE(engine_->Update(cache.id(), 0, kv.input()).ok());  // layer 0 one ahead
  ExpectRefused(kRefused, "out of step", "",
                [&] { return engine_->BeginSpeculation(cache.id(), false); });
}

// Each live change is refused and changes nothing; what reads the committed
// history (snapshots, views, batch reads) goes on, and sees no drafted token.
TEST_P(SpeculationTest, LiveChangesAreRefusedWhileOneIsOpen) {
  SpeculatingCache cache(*engine_, MixedLayout());
  ASSERT_TRUE(cache.Step(6));
  RefCacheSnapshotPtr before_ref = cache.reference().Snapshot(0);
  const std::string before = engine_->Snapshot(cache.id(), 0)->snapshot_id;
  ASSERT_TRUE(cache.Begin(false));
  ASSERT_TRUE(cache.Draft(3));
  const std::string& id = cache.speculation_id();
  std::mt19937_64 rng(2);
  const KvTensors kv = RandomKv(cache.spec(), 0, 1, rng);
  const RefState state = RandomState(cache.spec(), 2, rng);
  ExpectRefused(kRefused, "cache_id", id, [&] { return engine_->Update(cache.id(), 0, kv.input()); });
  ExpectRefused(kRefused, "cache_id", id,
                [&] { return engine_->UpdateState(cache.id(), 2, StateInputOf(state, 1)); });
  ExpectRefused(kRefused, "cache_id", id, [&] { return engine_->Trim(cache.id(), 0); });
  ExpectRefused(kRefused, "cache_id", id, [&] { return engine_->Restore(cache.id(), "", 6); });
  ExpectRefused(kRefused, "cache_id", id, [&] { return engine_->Restore(cache.id(), before, 6); });
  ExpectRefused(kRefused, "cache_id", id, [&] { return engine_->FilterRows(cache.id(), {0}); });
  ExpectRefused(kRefused, "cache_id", id,
                [&] { return engine_->ExtendCache(cache.id(), cache.id()); });

  absl::StatusOr<engine::SnapshotInfo> during = engine_->Snapshot(cache.id(), 0);
  ASSERT_TRUE(during.ok()) << during.status();
  EXPECT_EQ(during->to_offset, 6u);
  EXPECT_TRUE(SnapshotViewMatches(*engine_, during->snapshot_id, *before_ref));
  EXPECT_TRUE(cache.Matches());
  EXPECT_EQ(engine_->GetCache(cache.id())->layer_offsets, std::vector<uint64_t>(5, 6));
  SpeculatingCache other(*engine_, MixedLayout(), 9);
  ASSERT_TRUE(other.Step(6));
  EXPECT_TRUE(engine_->ExtendCache(other.id(), cache.id()).ok());  // read as other_id
  EXPECT_TRUE(engine_->ExtractRow(cache.id(), 0).ok());
  const std::string both[] = {cache.id(), other.id()};
  EXPECT_TRUE(engine_->MergeCaches(both).ok());
  EXPECT_TRUE(cache.SpeculationMatches());
  ASSERT_TRUE(cache.Commit(2).ok());
  EXPECT_TRUE(cache.Matches());
  EXPECT_TRUE(SnapshotViewMatches(*engine_, during->snapshot_id, *before_ref));
}

TEST_P(SpeculationTest, UnknownEndedAndForeignIdsAreNotFound) {
  SpeculatingCache cache(*engine_, StandardSpec());
  SpeculatingCache other(*engine_, StandardSpec(), 4);
  ASSERT_TRUE(cache.Step(2));
  std::mt19937_64 rng(3);
  const KvTensors kv = RandomKv(cache.spec(), 0, 1, rng);
  const auto expect_gone = [&](const std::string& id, const std::string& cache_id) {
    ExpectRefused(kNotFound, "speculation_id", "",
                  [&] { return engine_->UpdateSpeculation(id, cache_id, 0, kv.input()); });
    ExpectRefused(kNotFound, "speculation_id", "",
                  [&] { return engine_->Freeze(cache_id, "", id); });
    if (!cache_id.empty()) return;
    ExpectRefused(kNotFound, "speculation_id", "", [&] { return engine_->GetSpeculation(id); });
    ExpectRefused(kNotFound, "speculation_id", "",
                  [&] { return engine_->CommitSpeculation(id, 0); });
    ExpectRefused(kNotFound, "speculation_id", "", [&] { return engine_->AbortSpeculation(id); });
  };
  expect_gone(kUnknownId, "");
  ASSERT_TRUE(cache.Begin(false));
  const std::string committed = cache.speculation_id();
  // Named with another cache: as if unknown (it does not say whose it is).
  ExpectRefused(kNotFound, "speculation_id", committed,
                [&] { return engine_->UpdateSpeculation(committed, other.id(), 0, kv.input()); });
  ExpectRefused(kNotFound, "speculation_id", committed,
                [&] { return engine_->Freeze(other.id(), "", committed); });
  ASSERT_TRUE(cache.Commit(0).ok());
  expect_gone(committed, "");
  expect_gone(committed, cache.id());
  ASSERT_TRUE(cache.Begin(true));
  const std::string aborted = cache.speculation_id();
  ASSERT_TRUE(cache.Abort());
  expect_gone(aborted, "");
}

TEST_P(SpeculationTest, DeletingTheCacheEndsItsSpeculation) {
  SpeculatingCache cache(*engine_, MixedLayout());
  ASSERT_TRUE(cache.Step(7));
  const int64_t empty = 0;
  ASSERT_TRUE(cache.Begin(false));
  ASSERT_TRUE(cache.Draft(5));
  ASSERT_TRUE(engine_->DeleteCache(cache.id()).ok());
  EXPECT_EQ(UsedPages(), empty) << "the drafts' pages outlived the cache";
  const std::string id = cache.speculation_id();
  EXPECT_EQ(engine_->CommitSpeculation(id, 1).status().code(), kNotFound);
  EXPECT_EQ(engine_->AbortSpeculation(id).status().code(), kNotFound);
  EXPECT_EQ(engine_->Freeze("", "", id).status().code(), kNotFound);
  EXPECT_EQ(engine_->GetSpeculation(id).status().code(), kNotFound);
}

TEST_P(SpeculationTest, AcceptingMoreThanWasDraftedIsInvalid) {
  SpeculatingCache cache(*engine_, MixedLayout());
  ASSERT_TRUE(cache.Step(4));
  ASSERT_TRUE(cache.Begin(false));
  ASSERT_TRUE(cache.Draft(3));
  for (uint64_t accepted : {4, 100}) {
    ExpectRefused(absl::StatusCode::kInvalidArgument, "accepted", cache.speculation_id(),
                  [&] { return engine_->CommitSpeculation(cache.speculation_id(), accepted); });
  }
  EXPECT_TRUE(cache.SpeculationMatches());
  ASSERT_TRUE(cache.Commit(3).ok());  // still open, and commits
  EXPECT_TRUE(cache.Matches());
}

TEST_P(SpeculationTest, DraftedLayersMustBeInStepToCommit) {
  SpeculatingCache cache(*engine_, MixedLayout());
  ASSERT_TRUE(cache.Step(4));
  ASSERT_TRUE(cache.Begin(false));
  ASSERT_TRUE(cache.Draft(2));
  ASSERT_TRUE(cache.DraftLayer(0, 1));
  ASSERT_TRUE(cache.DraftLayer(3, 2));
  for (uint64_t accepted : {0, 1, 2}) {
    ExpectRefused(kRefused, "out of step", cache.speculation_id(),
                  [&] { return engine_->CommitSpeculation(cache.speculation_id(), accepted); });
  }
  for (uint32_t layer : {1u, 2u, 4u}) ASSERT_TRUE(cache.DraftLayer(layer, 1));
  ExpectRefused(kRefused, "out of step", cache.speculation_id(),
                [&] { return engine_->CommitSpeculation(cache.speculation_id(), 2); });
  ASSERT_TRUE(cache.DraftLayer(0, 1));
  for (uint32_t layer : {1u, 2u, 4u}) ASSERT_TRUE(cache.DraftLayer(layer, 1));
  ASSERT_TRUE(cache.Commit(3).ok());
  EXPECT_TRUE(cache.Matches());
}

// An `accepted` that no layer reached is malformed whatever the layers'
// steps are: INVALID_ARGUMENT naming accepted comes before the out-of-step
// refusal, which answers any smaller value.
TEST_P(SpeculationTest, AcceptingMoreThanAnyLayerDraftedIsInvalidEvenOutOfStep) {
  SpeculatingCache cache(*engine_, MixedLayout());
  ASSERT_TRUE(cache.Step(4));
  ASSERT_TRUE(cache.Begin(false));
  ASSERT_TRUE(cache.Draft(2));
  ASSERT_TRUE(cache.DraftLayer(3, 2));  // layer 3 has drafted 4, the others 2
  for (uint64_t accepted : {5, 9}) {
    ExpectRefused(absl::StatusCode::kInvalidArgument, "accepted", cache.speculation_id(),
                  [&] { return cache.Commit(accepted); });
  }
  for (uint64_t accepted : {0, 3, 4}) {
    ExpectRefused(kRefused, "out of step", cache.speculation_id(),
                  [&] { return cache.Commit(accepted); });
  }
  for (uint32_t layer : {0u, 1u, 2u, 4u}) ASSERT_TRUE(cache.DraftLayer(layer, 2));
  ASSERT_TRUE(cache.Commit(4).ok());
  EXPECT_TRUE(cache.Matches());
}

// One state for three drafted tokens: the commit can keep 0 or 3 of them,
// not 1 or 2, and a refusal leaves every layer of the mixed layout as it was.
TEST_P(SpeculationTest, RecurrentLayersCommitOnlyWhereADraftedStateSits) {
  SpeculatingCache cache(*engine_, MixedLayout());
  ASSERT_TRUE(cache.Step(4));
  ASSERT_TRUE(cache.Begin(false));
  ASSERT_TRUE(cache.Draft(3, /*state_per_token=*/false));
  for (uint64_t accepted : {1, 2}) {
    ExpectRefused(kRefused, "layer 2", cache.speculation_id(),
                  [&] { return engine_->CommitSpeculation(cache.speculation_id(), accepted); });
  }
  ASSERT_TRUE(cache.Commit(3).ok());
  EXPECT_TRUE(cache.Matches());
  ASSERT_TRUE(cache.Begin(false));
  ASSERT_TRUE(cache.Draft(2, /*state_per_token=*/false));
  ASSERT_TRUE(cache.Commit(0).ok());  // the committed state needs no drafted one
  EXPECT_TRUE(cache.Matches());
}

TEST_P(SpeculationTest, RefusedDraftsChangeNothing) {
  SpeculatingCache cache(*engine_, MixedLayout());
  ASSERT_TRUE(cache.Step(3));
  ASSERT_TRUE(cache.Begin(false));
  ASSERT_TRUE(cache.Draft(1));
  const std::string& id = cache.speculation_id();
  std::mt19937_64 rng(4);
  KvTensors kv = RandomKv(cache.spec(), 0, 2, rng);
  const RefState state = RandomState(cache.spec(), 2, rng);
  ExpectRefused(kRefused, "expected_offset", id,
                [&] { return engine_->UpdateSpeculation(id, "", 0, kv.input(), 3); });
  ExpectRefused(absl::StatusCode::kInvalidArgument, "layer", id,
                [&] { return engine_->UpdateSpeculation(id, "", 9, kv.input()); });
  ExpectRefused(absl::StatusCode::kInvalidArgument, "keys", id,
                [&] { return engine_->UpdateSpeculation(id, "", 2, kv.input()); });
  ExpectRefused(absl::StatusCode::kInvalidArgument, "state", id,
                [&] { return engine_->UpdateSpeculationState(id, "", 0, StateInputOf(state, 1)); });
  ExpectRefused(absl::StatusCode::kInvalidArgument, "state", id, [&] {
    return engine_->UpdateSpeculationState(id, "", 1, StateInputOf(state, 1));
  });
  kv.keys.pop_back();
  ExpectRefused(absl::StatusCode::kInvalidArgument, "keys", id,
                [&] { return engine_->UpdateSpeculation(id, "", 0, kv.input()); });
  ExpectRefused(absl::StatusCode::kInvalidArgument, "speculation_id", id,
                [&] { return engine_->Freeze("", "some-snapshot", id); });
  EXPECT_TRUE(cache.SpeculationMatches());
}

// An isolated speculation touches nothing of the live cache: not its bytes,
// not its pages (the drafts stage in copies), not even on commit.
TEST_P(SpeculationTest, IsolatedSpeculationNeverChangesTheLiveCache) {
  SpeculatingCache cache(*engine_, MixedLayout());
  ASSERT_TRUE(cache.Step(6));
  const EngineFingerprint before = Fingerprint(*engine_);
  const uint64_t live_bytes = engine_->GetCache(cache.id())->size_bytes;
  for (uint64_t accepted : {0, 2, 4}) {
    ASSERT_TRUE(cache.Begin(true));
    ASSERT_TRUE(cache.Draft(4));
    EXPECT_TRUE(cache.SpeculationMatches());
    EXPECT_EQ(engine_->GetCache(cache.id())->size_bytes, live_bytes);
    ASSERT_TRUE(cache.Commit(accepted).ok());
    const EngineFingerprint after = Fingerprint(*engine_);
    EXPECT_TRUE(after == before) << Describe(before) << "\n" << Describe(after);
  }
  EXPECT_TRUE(cache.Matches());
}

// Commit and abort leave exactly the pages one plain update of the accepted
// tokens would: the drafted ones past them go back to the free list.
TEST_P(SpeculationTest, CommitAndAbortReleaseTheDraftedPages) {
  SpeculatingCache speculating(*engine_, MixedLayout(), 5);
  SpeculatingCache plain(*engine_, MixedLayout(), 5);
  ASSERT_TRUE(speculating.Step(5));
  ASSERT_TRUE(plain.Step(5));
  const int64_t start = UsedPages();
  ASSERT_TRUE(speculating.Begin(false));
  ASSERT_TRUE(speculating.Draft(8));
  EXPECT_GT(UsedPages(), start);
  ASSERT_TRUE(speculating.Abort());
  EXPECT_EQ(UsedPages(), start);
  ASSERT_TRUE(speculating.Begin(false));
  ASSERT_TRUE(speculating.Draft(8));
  ASSERT_TRUE(speculating.Commit(3).ok());
  const int64_t committed = UsedPages() - start;
  ASSERT_TRUE(plain.Step(3));
  EXPECT_EQ(UsedPages() - start - committed, committed) << "the commit kept more pages";
  EXPECT_TRUE(speculating.Matches());
}

// A chunk left empty (start == offset) keeps the page of its offset after a
// trim, but has none in a cache assembled from its rows (ExtractRow): either
// way, after an abort or a commit of none, the drafted tokens' pages are gone
// and the layer's own are as they were.
TEST_P(SpeculationTest, DraftsOnAnEmptyChunkLeaveItsPagesAsTheyWere) {
  SpeculatingCache cache(*engine_, ChunkedSpec());
  ASSERT_TRUE(cache.Step(11));
  ASSERT_TRUE(cache.Step(1));  // the chunk of 6 starts at 5
  ASSERT_EQ(cache.reference().Trim(7), 7u);
  ASSERT_TRUE(engine_->Trim(cache.id(), 7).ok());  // empty: start == offset == 5
  absl::StatusOr<engine::CacheInfo> extracted = engine_->ExtractRow(cache.id(), 0);
  ASSERT_TRUE(extracted.ok()) << extracted.status();
  ASSERT_EQ(extracted->offset, 5u);
  EXPECT_EQ(extracted->size_bytes, 0u) << "the premise: no page for an empty chunk";
  std::mt19937_64 rng(8);
  for (const std::string& id : {cache.id(), extracted->cache_id}) {
    const uint64_t bytes = engine_->GetCache(id)->size_bytes;
    const int64_t used = UsedPages();
    for (const bool abort : {true, false}) {
      SCOPED_TRACE(absl::StrCat(id == cache.id() ? "trimmed" : "extracted",
                                abort ? ", aborted" : ", none committed"));
      absl::StatusOr<engine::SpeculationInfo> begun = engine_->BeginSpeculation(id, false);
      ASSERT_TRUE(begun.ok()) << begun.status();
      const KvTensors kv = RandomKv(cache.spec(), 0, 3, rng);
      ASSERT_TRUE(engine_->UpdateSpeculation(begun->speculation_id, id, 0, kv.input()).ok());
      ASSERT_TRUE(abort ? engine_->AbortSpeculation(begun->speculation_id).ok()
                        : engine_->CommitSpeculation(begun->speculation_id, 0).ok());
      EXPECT_EQ(engine_->GetCache(id)->size_bytes, bytes);
      EXPECT_EQ(UsedPages(), used);
    }
  }
  EXPECT_TRUE(cache.Matches());
}

// A view of the speculation taken before it ended keeps its bytes while the
// live cache writes over those positions afterwards (copy-on-write, and the
// layer's append right does not reach what such a view reads).
TEST_P(SpeculationTest, ViewsOfTheSpeculationOutliveIt) {
  for (const engine::CacheSpec& spec : {StandardSpec(), RotatingSpec(2), MixedLayout()}) {
    SpeculatingCache cache(*engine_, spec);
    ASSERT_TRUE(cache.Step(5));
    ASSERT_TRUE(cache.Begin(false));
    ASSERT_TRUE(cache.Draft(3));
    absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view =
        engine_->Freeze("", "", cache.speculation_id());
    ASSERT_TRUE(view.ok()) << view.status();
    std::vector<std::vector<RefToken>> tokens;
    std::vector<std::optional<RefState>> states;
    for (uint32_t layer = 0; layer < spec.layers.size(); ++layer) {
      const bool recurrent = engine::IsRecurrent(spec.layers[layer]);
      tokens.push_back(recurrent ? std::vector<RefToken>{} : cache.speculation()->Fetch(layer));
      states.push_back(recurrent ? cache.speculation()->FetchState(layer) : std::nullopt);
    }
    ASSERT_TRUE(cache.Commit(1).ok());
    ASSERT_TRUE(cache.Step(4));  // over the positions the view holds
    EXPECT_TRUE(ViewMatches(
        **view, [&](uint32_t layer) { return tokens[layer]; },
        [&](uint32_t layer) { return states[layer]; }));
    EXPECT_TRUE(cache.Matches());
  }
}

INSTANTIATE_TEST_SUITE_P(TransferPaths, SpeculationTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
