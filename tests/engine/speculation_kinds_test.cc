// Speculation on every layer kind against RefSpeculation (commit keeps what
// one Update of the accepted tokens would, the live cache shows the committed
// history throughout), and the other way to speculate: a snapshot at every
// drafted offset and a restore to the accepted one, which must cost page
// references only: appending into a page a snapshot shares writes it in place
// (token_store.h AppendRight), and the restore shares the snapshot's pages;
// on the mixed layout it must leave the pages plain steps would.
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "speculation_test_util.h"

namespace kvcache::testing {
namespace {

struct Named {
  std::string name;
  engine::CacheSpec spec;
};

std::vector<Named> EveryKind() {
  return {{"standard", StandardSpec()},         {"quantized", QuantizedSpec()},
          {"chunked", ChunkedSpec()},           {"rotating", RotatingSpec(0)},
          {"rotating_sinks", RotatingSpec(2)},  {"recurrent", RecurrentSpec()},
          {"mixed", MixedLayout()},             {"batched", BatchedSpec()}};
}

// The attention kinds (a recurrent state is replaced whole by every step, so
// the snapshot way holds a state per snapshot there: see the next test).
std::vector<Named> AttentionKinds() {
  return {{"standard", StandardSpec()},        {"quantized", QuantizedSpec()},
          {"chunked", ChunkedSpec()},          {"rotating", RotatingSpec(0)},
          {"rotating_sinks", RotatingSpec(2)}, {"batched", BatchedSpec()}};
}

// Rounds of 1..8 drafted tokens in two pieces, committing 0..k (the windows
// wrap, the chunks trim, the live cache is checked mid-round), some aborted,
// some isolated.
TEST_P(SpeculationTest, EveryKindCommitsWhatOneUpdateOfTheAcceptedTokensWould) {
  for (const Named& kind : EveryKind()) {
    SCOPED_TRACE(kind.name);
    SpeculatingCache cache(*engine_, kind.spec);
    ASSERT_TRUE(cache.Step(3));
    for (uint64_t round = 0; round < 12; ++round) {
      SCOPED_TRACE(absl::StrCat("round ", round, " at ", cache.offset()));
      const uint64_t drafted = 1 + round % 8;
      const uint64_t accepted = (round * 5) % (drafted + 1);
      ASSERT_TRUE(cache.Begin(/*isolated=*/round % 5 == 3));
      ASSERT_TRUE(cache.Draft(1));
      if (drafted > 1) {
        ASSERT_TRUE(cache.Draft(drafted - 1));
      }
      EXPECT_TRUE(cache.SpeculationMatches());
      EXPECT_TRUE(cache.Matches()) << "the live cache shows a drafted token";
      if (round % 7 == 6) {
        ASSERT_TRUE(cache.Abort());
      } else {
        ASSERT_TRUE(cache.Commit(accepted).ok());
      }
      EXPECT_TRUE(cache.Matches());
      if (round % 3 == 0) {
        ASSERT_TRUE(cache.Step(1 + round % 4));
      }
    }
  }
}

// The pages that must exist for what `views` hold: per layer, one for each
// page index a held position falls in (every kind keeps tokens in pages by
// absolute position; all layers of these specs take kSpeculationPageTokens).
// Holders of the same index share one page unless something was copied.
int64_t PagesCovering(const std::vector<std::shared_ptr<const engine::CacheSnapshot>>& views) {
  int64_t pages = 0;
  for (uint32_t layer = 0; layer < views[0]->spec.layers.size(); ++layer) {
    std::set<uint64_t> indices;
    for (const auto& view : views) {
      for (const engine::TokenRange& range : view->Ranges(layer, kEverything)) {
        for (uint64_t p = range.begin; p < range.end; ++p) indices.insert(p / kSpeculationPageTokens);
      }
    }
    pages += indices.size();
  }
  return pages;
}

// k snapshots, one at each drafted offset before its token is written (each
// from the token before the committed offset, as a snapshot needs a token, or
// from 0 for a chunked layer, which restores only from its whole chunk), then
// a restore to the accepted offset: at every point the pool holds no page
// beyond those covering what the cache and its snapshots hold, so nothing was
// copied (a copy-on-write would leave the snapshot's page and the copy).
TEST_P(SpeculationTest, SnapshotPerDraftedTokenCopiesNoPage) {
  for (const Named& kind : AttentionKinds()) {
    SCOPED_TRACE(kind.name);
    SpeculatingCache cache(*engine_, kind.spec, 1);
    ASSERT_TRUE(cache.Step(10));  // wraps the windows, trims the chunk; ends mid-page
    std::vector<std::shared_ptr<const engine::CacheSnapshot>> held;
    const auto covered = [&] {
      std::vector<std::shared_ptr<const engine::CacheSnapshot>> views = held;
      views.push_back(*engine_->Freeze(cache.id(), ""));
      return PagesCovering(views);
    };
    for (uint64_t k : {1, 4, 8}) {
      SCOPED_TRACE(absl::StrCat("k ", k));
      const uint64_t committed = cache.offset();
      const bool chunked = std::holds_alternative<engine::ChunkedKind>(kind.spec.layers[0].kind);
      const uint64_t from = chunked ? 0 : committed - 1;
      std::vector<std::pair<std::string, RefCacheSnapshotPtr>> snapshots;
      for (uint64_t i = 0; i < k; ++i) {
        absl::StatusOr<engine::SnapshotInfo> info = engine_->Snapshot(cache.id(), from);
        ASSERT_TRUE(info.ok()) << info.status();
        snapshots.emplace_back(info->snapshot_id, cache.reference().Snapshot(from));
        held.push_back(*engine_->Freeze("", info->snapshot_id));
        ASSERT_TRUE(cache.Step(1));
        EXPECT_EQ(UsedPages(), covered()) << "step " << i << " copied a page";
      }
      const uint64_t accepted = k / 2;
      ASSERT_TRUE(engine_->Restore(cache.id(), snapshots[accepted].first, committed + accepted).ok());
      ASSERT_TRUE(cache.reference().Restore(snapshots[accepted].second.get(), committed + accepted));
      EXPECT_EQ(UsedPages(), covered()) << "the restore copied a page";
      for (const auto& [id, reference] : snapshots) {
        EXPECT_TRUE(SnapshotViewMatches(*engine_, id, *reference));
        ASSERT_TRUE(engine_->ReleaseSnapshot(id).ok());
      }
      held.clear();
      EXPECT_TRUE(cache.Matches());
      ASSERT_TRUE(cache.Step(1));
      EXPECT_EQ(UsedPages(), covered());
    }
  }
}

// The same with the snapshot taken after each token and the one restored to
// kept for the next round (the committed state it may go back to): the first
// write after the restore shares its page with that snapshot only, and claims
// the right through it (token_store.h RestoreSource) instead of copying.
TEST_P(SpeculationTest, KeepingTheRestoredSnapshotCopiesNoPage) {
  for (const Named& kind : AttentionKinds()) {
    SCOPED_TRACE(kind.name);
    SpeculatingCache cache(*engine_, kind.spec, 4);
    ASSERT_TRUE(cache.Step(10));
    std::vector<std::pair<std::string, RefCacheSnapshotPtr>> kept;
    const auto take = [&] {
      absl::StatusOr<engine::SnapshotInfo> info = engine_->Snapshot(cache.id(), 0);
      EXPECT_TRUE(info.ok()) << info.status();
      kept.emplace_back(info.ok() ? info->snapshot_id : "", cache.reference().Snapshot(0));
    };
    const auto covered = [&] {
      std::vector<std::shared_ptr<const engine::CacheSnapshot>> views = {
          *engine_->Freeze(cache.id(), "")};
      for (const auto& snapshot : kept) views.push_back(*engine_->Freeze("", snapshot.first));
      return PagesCovering(views);
    };
    take();
    for (uint64_t k : {1, 3, 4, 2}) {
      SCOPED_TRACE(absl::StrCat("k ", k));
      for (uint64_t i = 0; i < k; ++i) {
        ASSERT_TRUE(cache.Step(1));
        take();
        EXPECT_EQ(UsedPages(), covered()) << "step " << i << " copied a page";
      }
      const auto target = kept[kept.size() - 1 - k / 2];
      ASSERT_TRUE(engine_->Restore(cache.id(), target.first, target.second->to).ok());
      ASSERT_TRUE(cache.reference().Restore(target.second.get(), target.second->to));
      for (const auto& [id, reference] : kept) {
        EXPECT_TRUE(SnapshotViewMatches(*engine_, id, *reference));
        if (id != target.first) {
          ASSERT_TRUE(engine_->ReleaseSnapshot(id).ok());
        }
      }
      kept = {target};
      EXPECT_EQ(UsedPages(), covered()) << "the restore copied a page";
      EXPECT_TRUE(cache.Matches());
    }
    ASSERT_TRUE(engine_->ReleaseSnapshot(kept[0].first).ok());
  }
}

// A recurrent layer's steps replace its state with fresh pages, so each
// snapshot keeps one state alive (swapped, never copied): k snapshots hold k
// states more than the plain steps, and the restore adds nothing.
TEST_P(SpeculationTest, SnapshotPerDraftedTokenHoldsOneStateEachOnRecurrentLayers) {
  SpeculatingCache snapshotting(*engine_, RecurrentSpec(), 1);
  SpeculatingCache plain(*engine_, RecurrentSpec(), 1);
  ASSERT_TRUE(snapshotting.Step(5));
  ASSERT_TRUE(plain.Step(5));
  const int64_t state_pages = UsedPages() / 2;
  std::vector<std::pair<std::string, RefCacheSnapshotPtr>> snapshots;
  const int64_t before = UsedPages();
  for (uint64_t i = 0; i < 4; ++i) {
    snapshots.emplace_back(engine_->Snapshot(snapshotting.id(), 4)->snapshot_id,
                           snapshotting.reference().Snapshot(4));
    ASSERT_TRUE(snapshotting.Step(1));
    ASSERT_TRUE(plain.Step(1));
  }
  EXPECT_EQ(UsedPages() - before, 4 * state_pages);
  const int64_t restored_from = UsedPages();
  ASSERT_TRUE(engine_->Restore(snapshotting.id(), snapshots[2].first, 7).ok());
  ASSERT_TRUE(snapshotting.reference().Restore(snapshots[2].second.get(), 7));
  EXPECT_LE(UsedPages(), restored_from);
  for (const auto& snapshot : snapshots) ASSERT_TRUE(engine_->ReleaseSnapshot(snapshot.first).ok());
  EXPECT_TRUE(snapshotting.Matches());
}

// The snapshot way on the mixed layout (standard, rotating with sinks,
// recurrent, chunked, quantized): a snapshot from 0 (the chunked layer
// restores only from its whole chunk) at each drafted offset, one token per
// step, then a restore to the accepted offset, which brings the recurrent
// layer's state back from the snapshot taken there, and every snapshot
// released. The cache then equals the reference and holds the pool bytes of
// a twin that took only the accepted steps; with the snapshots gone the pool
// holds the two caches' pages and nothing else.
TEST_P(SpeculationTest, SnapshotPerDraftedTokenOnTheMixedLayout) {
  SpeculatingCache cache(*engine_, MixedLayout(), 6);
  SpeculatingCache plain(*engine_, MixedLayout(), 7);
  ASSERT_TRUE(cache.Step(9));
  ASSERT_TRUE(plain.Step(9));
  const auto size_bytes = [&](const SpeculatingCache& of) {
    return engine_->GetCache(of.id())->size_bytes;
  };
  for (auto [drafted, accepted] : {std::pair<uint64_t, uint64_t>{1, 0}, {4, 2}, {8, 8}, {5, 1},
                                   {3, 3}, {7, 6}, {2, 0}}) {
    SCOPED_TRACE(absl::StrCat(accepted, " of ", drafted, " accepted at ", cache.offset()));
    const uint64_t committed = cache.offset();
    std::vector<std::pair<std::string, RefCacheSnapshotPtr>> snapshots;
    for (uint64_t i = 0; i < drafted; ++i) {
      absl::StatusOr<engine::SnapshotInfo> info = engine_->Snapshot(cache.id(), 0);
      ASSERT_TRUE(info.ok()) << info.status();
      snapshots.emplace_back(info->snapshot_id, cache.reference().Snapshot(0));
      ASSERT_TRUE(cache.Step(1));
    }
    if (accepted < drafted) {
      const auto& [id, reference] = snapshots[accepted];
      absl::StatusOr<engine::CacheInfo> restored =
          engine_->Restore(cache.id(), id, committed + accepted);
      ASSERT_TRUE(restored.ok()) << restored.status();
      ASSERT_TRUE(cache.reference().Restore(reference.get(), committed + accepted));
    }
    for (const auto& [id, reference] : snapshots) {
      EXPECT_TRUE(SnapshotViewMatches(*engine_, id, *reference));
      ASSERT_TRUE(engine_->ReleaseSnapshot(id).ok());
    }
    EXPECT_TRUE(cache.Matches());
    for (uint64_t i = 0; i < accepted; ++i) ASSERT_TRUE(plain.Step(1));
    EXPECT_EQ(size_bytes(cache), size_bytes(plain)) << "pages of rejected tokens were kept";
    EXPECT_EQ(UsedPages() * kSpeculationPageBytes, size_bytes(cache) + size_bytes(plain))
        << "a page of the round outlived its snapshots";
    ASSERT_TRUE(cache.Step(1));  // live again
    ASSERT_TRUE(plain.Step(1));
  }
}

// The append right: a layer keeps writing the page its snapshots share, but
// never where another holder reads (after a rewind, in a cache restored from
// the snapshot, after a speculation ended short): there it copies first.
TEST_P(SpeculationTest, AppendingInPlaceLeavesEveryOtherHolderAlone) {
  for (const Named& kind : AttentionKinds()) {
    SCOPED_TRACE(kind.name);
    SpeculatingCache cache(*engine_, kind.spec, 2);
    SpeculatingCache other(*engine_, kind.spec, 3);
    ASSERT_TRUE(cache.Step(5));
    std::vector<std::pair<std::string, RefCacheSnapshotPtr>> snapshots;
    const auto take = [&] {
      snapshots.emplace_back(engine_->Snapshot(cache.id(), 0)->snapshot_id,
                             cache.reference().Snapshot(0));
    };
    take();
    ASSERT_TRUE(cache.Step(1));  // in place, past the snapshot
    take();
    if (cache.reference().Trim(0).has_value()) {  // still trimmable
      ASSERT_TRUE(engine_->Restore(cache.id(), "", 5).ok());
      ASSERT_TRUE(cache.reference().Restore(nullptr, 5));
      ASSERT_TRUE(cache.Step(2));  // over position 5, which the second snapshot holds
      take();
    }
    ASSERT_TRUE(engine_->Restore(other.id(), snapshots.back().first, cache.offset()).ok());
    ASSERT_TRUE(other.reference().Restore(snapshots.back().second.get(), cache.offset()));
    ASSERT_TRUE(other.Step(2));  // the restored cache appends where `cache` does
    ASSERT_TRUE(cache.Step(2));
    ASSERT_TRUE(cache.Begin(false));
    ASSERT_TRUE(cache.Draft(3));
    // A reader of the live cache meanwhile: it shares the page the drafted
    // tokens begin in, so the layer looks for a right (ClaimRight) with them
    // past its offset.
    ASSERT_TRUE(engine_->Freeze(cache.id(), "").ok());
    // A reader of the drafted tokens (a Fetch of the speculation in flight).
    const auto drafted_view = engine_->Freeze("", "", cache.speculation_id());
    ASSERT_TRUE(drafted_view.ok()) << drafted_view.status();
    const std::vector<RefToken> drafted = cache.speculation()->Fetch(0);
    ASSERT_TRUE(cache.Commit(1).ok());
    ASSERT_TRUE(cache.Step(3));  // over the two rejected drafted positions
    take();
    for (const auto& [id, reference] : snapshots) {
      EXPECT_TRUE(SnapshotViewMatches(*engine_, id, *reference)) << id;
    }
    EXPECT_TRUE(LayerViewMatches(**drafted_view, 0, drafted, std::nullopt));
    EXPECT_TRUE(cache.Matches());
    EXPECT_TRUE(other.Matches());
  }
}

}  // namespace
}  // namespace kvcache::testing
