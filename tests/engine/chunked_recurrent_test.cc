// Targeted tests of chunked and recurrent layers (engine/layers/chunked_layer.h,
// engine/layers/recurrent_layer.h): the front trim and its page releases, every
// refusal (and that it changes nothing), state sizes, zero-copy snapshots of
// states, and wrong-kind updates (mixed layouts: mixed_layers_test.cc). Each
// result is also checked against the CPU reference where one applies.
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "chunked_recurrent_test_util.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "hybrid_test_fixture.h"
#include "reference_recurrent.h"

namespace kvcache::testing {
namespace {

using engine::CacheSpec;

class ChunkedRecurrentTest : public HybridEngineTest {};

CacheSpec ChunkedSpec(uint32_t chunk) {
  return MakeSpec({ChunkedLayerSpec(2, 4, 8, chunk)}, DType::kFloat16);
}

// mlx-lm maybe_trim_front before each update: once the held length reaches
// chunk_size, the front moves to offset - chunk_size; a page goes back to the
// pool once every position it covers is below the start.
TEST_P(ChunkedRecurrentTest, ChunkedUpdateTrimsTheFrontFirstAndReleasesPages) {
  HybridCache cache(*engine_, ChunkedSpec(8));
  ASSERT_TRUE(cache.Step(5));
  ASSERT_TRUE(cache.Step(6));  // held 5 < 8 before it: no trim, 11 held
  EXPECT_EQ(RangesString(LiveRanges(cache.id(), 0)), "{[0,11)}");
  ASSERT_TRUE(cache.Step(1));  // held 11: start 3
  EXPECT_EQ(RangesString(LiveRanges(cache.id(), 0)), "{[3,12)}");
  EXPECT_EQ(UsedPages(), 3);   // page 0 still holds position 3
  ASSERT_TRUE(cache.Step(1));  // held 9: start 4
  EXPECT_EQ(RangesString(LiveRanges(cache.id(), 0)), "{[4,13)}");
  EXPECT_EQ(UsedPages(), 3);    // page 0 released, page 3 allocated
  ASSERT_TRUE(cache.Step(20));  // start 5, 28 held: an update may exceed the chunk
  EXPECT_EQ(RangesString(LiveRanges(cache.id(), 0)), "{[5,33)}");
  ASSERT_TRUE(cache.Step(1));  // start 25
  EXPECT_EQ(RangesString(LiveRanges(cache.id(), 0)), "{[25,34)}");
  EXPECT_EQ(UsedPages(), 3);  // pages 6, 7, 8
  EXPECT_TRUE(cache.Matches());
}

TEST_P(ChunkedRecurrentTest, ChunkedFailedUpdateDoesNotTrimTheFront) {
  HybridCache cache(*engine_, ChunkedSpec(4));
  ASSERT_TRUE(cache.Step(9));
  const FullFingerprint before = FullFingerprintOf(*engine_);
  std::mt19937_64 rng(3);
  const KvTensors kv = RandomKv(ShapeOf(ChunkedSpec(4), 0), 2, rng);
  engine::KvInput bad = kv.input();
  bad.tokens = 3;  // sizes say 2
  EXPECT_EQ(engine_->Update(cache.id(), 0, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(FullFingerprintOf(*engine_) == before);
  EXPECT_EQ(RangesString(LiveRanges(cache.id(), 0)), "{[0,9)}");
}

// mlx-lm trim: n = min(offset - start_position, n). A cache trims all its
// layers by the least any can, so a standard layer beside stays in step.
TEST_P(ChunkedRecurrentTest, TrimStopsAtTheChunkStartForEveryLayer) {
  HybridCache cache(*engine_, MakeSpec({ChunkedLayerSpec(1, 4, 4, 6), StandardLayerSpec(1, 4)}));
  ASSERT_TRUE(cache.Step(10));
  ASSERT_TRUE(cache.Step(2));  // start 4, offset 12
  absl::StatusOr<uint64_t> trimmed = engine_->Trim(cache.id(), 100);
  ASSERT_TRUE(trimmed.ok()) << trimmed.status();
  EXPECT_EQ(*trimmed, 8u);
  EXPECT_EQ(cache.reference().Trim(100), std::optional<uint64_t>(8));
  auto info = engine_->GetCache(cache.id());
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_offsets, (std::vector<uint64_t>{4, 4}));
  EXPECT_TRUE(LiveRanges(cache.id(), 0).empty());  // nothing held, start 4
  EXPECT_TRUE(cache.Matches());
  ASSERT_TRUE(cache.Step(3));  // appends at 4
  EXPECT_EQ(RangesString(LiveRanges(cache.id(), 0)), "{[4,7)}");
  EXPECT_TRUE(cache.Matches());
}

TEST_P(ChunkedRecurrentTest, ChunkedLiveRewindStopsAtTheStartPosition) {
  HybridCache cache(*engine_, ChunkedSpec(8));
  ASSERT_TRUE(cache.Step(10));
  ASSERT_TRUE(cache.Step(1));  // start 2, offset 11
  const FullFingerprint before = FullFingerprintOf(*engine_);
  ExpectRefusedUnchanged(cache.Restore("", nullptr, 1), before, "below the start position 2");
  ExpectRefusedUnchanged(cache.Restore("", nullptr, 12), before, "beyond the live offset");
  EXPECT_TRUE(cache.Restore("", nullptr, 2).ok());
  EXPECT_TRUE(LiveRanges(cache.id(), 0).empty());
  EXPECT_TRUE(cache.Matches());
}

// A snapshot from f taken at start s < f holds [f, to): restoring it needs the
// live tokens [s, f); one taken from its own start stands alone.
TEST_P(ChunkedRecurrentTest, ChunkedRestoreNeedsTheLiveTokensBelowTheSnapshot) {
  HybridCache cache(*engine_, ChunkedSpec(8));
  ASSERT_TRUE(cache.Step(10));
  ASSERT_TRUE(cache.Step(1));  // start 2, offset 11
  RefCacheSnapshotPtr partial_ref, whole_ref;
  const std::string partial = cache.Snapshot(6, &partial_ref);  // [6, 11), start 2
  const std::string whole = cache.Snapshot(0, &whole_ref);      // [2, 11), start 2
  ASSERT_TRUE(cache.Step(10));  // start 3, offset 21: [2, 3) is gone
  FullFingerprint before = FullFingerprintOf(*engine_);
  ExpectRefusedUnchanged(cache.Restore(partial, partial_ref.get(), 11), before,
                         "front was trimmed to 3");
  ExpectRefusedUnchanged(cache.Restore(whole, whole_ref.get(), 1), before,
                         "below the start position 2");
  ExpectRefusedUnchanged(cache.Restore(whole, whole_ref.get(), 12), before,
                         "beyond the snapshot's end 11");
  ASSERT_TRUE(cache.Restore(whole, whole_ref.get(), 9).ok());  // stands alone, then trimmed
  EXPECT_EQ(RangesString(LiveRanges(cache.id(), 0)), "{[2,9)}");
  EXPECT_TRUE(cache.Matches());
  ASSERT_TRUE(cache.Restore("", nullptr, 4).ok());  // start 2, offset 4 < 6
  before = FullFingerprintOf(*engine_);
  ExpectRefusedUnchanged(cache.Restore(partial, partial_ref.get(), 11), before,
                         "fewer than the snapshot's start 6");
  ASSERT_TRUE(cache.Restore(whole, whole_ref.get(), 7).ok());
  const int64_t pages = UsedPages();
  ASSERT_TRUE(cache.Restore(partial, partial_ref.get(), 11).ok());  // [2, 6) live + [6, 11)
  EXPECT_EQ(UsedPages(), pages);  // live and snapshot share the page at 6: nothing copied
  EXPECT_EQ(RangesString(LiveRanges(cache.id(), 0)), "{[2,11)}");
  EXPECT_TRUE(cache.Matches());
}

// The snapshot's state is what it restores, start position included, into any
// cache of the same layout.
TEST_P(ChunkedRecurrentTest, ChunkedSnapshotRestoresItsStartPositionIntoAnotherCache) {
  HybridCache source(*engine_, ChunkedSpec(5));
  ASSERT_TRUE(source.Step(7));
  ASSERT_TRUE(source.Step(2));  // start 2, offset 9
  RefCacheSnapshotPtr reference;
  const std::string id = source.Snapshot(0, &reference);
  HybridCache target(*engine_, ChunkedSpec(5), 99);
  ASSERT_TRUE(target.Restore(id, reference.get(), 9).ok());
  EXPECT_EQ(RangesString(LiveRanges(target.id(), 0)), "{[2,9)}");
  ASSERT_TRUE(target.Step(1));  // held 7 >= 5: start 4
  EXPECT_EQ(RangesString(LiveRanges(target.id(), 0)), "{[4,10)}");
  EXPECT_TRUE(target.Matches());
}

// Merge: the child's state over both ranges, the tokens below the child's
// from taken from the parent, which must hold them. Split: the parent is the
// state trimmed to `at`, none when its front was trimmed past `at` later.
TEST_P(ChunkedRecurrentTest, ChunkedMergeAndSplitFollowTheChunk) {
  HybridCache cache(*engine_, ChunkedSpec(8));
  ASSERT_TRUE(cache.Step(8));
  const Tracked early = Take(cache, 0);  // [0, 8), start 0
  ASSERT_TRUE(cache.Step(4));
  ASSERT_TRUE(cache.Step(1));           // start 4, offset 13
  const Tracked late = Take(cache, 0);  // holds [4, 13)
  ASSERT_TRUE(cache.Restore(early.id, early.ref.get(), 8).ok());
  ASSERT_TRUE(cache.Step(10));                 // start 0, offset 18
  const Tracked wide_child = Take(cache, 13);  // [13, 18), start 0: needs [0, 13)
  const FullFingerprint before = FullFingerprintOf(*engine_);
  Tracked merged;
  ExpectRefusedUnchanged(Merge(late, wide_child, &merged), before,
                         "the child's chunk starts at 0 but the parent holds tokens only from 4");
  const Tracked parent = Take(cache, 0);  // [0, 18), start 0
  ASSERT_TRUE(cache.Step(1));             // start 10, offset 19
  const Tracked child = Take(cache, 18);  // [18, 19), start 10
  const int64_t pages = UsedPages();
  ASSERT_TRUE(Merge(parent, child, &merged).ok());
  EXPECT_LE(UsedPages() - pages, 1);  // at most the page straddling 18
  EXPECT_EQ(RangesString(SnapshotRanges(merged.id, 0)), "{[10,19)}");
  Tracked lower, upper;
  Split(merged, 15, &lower, &upper);  // lower: the state trimmed to 15
  EXPECT_EQ(RangesString(SnapshotRanges(lower.id, 0)), "{[10,15)}");
  EXPECT_EQ(RangesString(SnapshotRanges(upper.id, 0)), "{[15,19)}");
  Tracked upper_a, upper_b, rejoined;
  Split(upper, 17, &upper_a, &upper_b);
  ASSERT_TRUE(Merge(upper_a, upper_b, &rejoined).ok());
  EXPECT_EQ(RangesString(SnapshotRanges(rejoined.id, 0)), "{[15,19)}");
  Tracked none, rest;
  Split(lower, 5, &none, &rest);  // start 10 > 5: no state at 5
  ASSERT_EQ(none.ref->layers[0], nullptr);
  EXPECT_TRUE(SnapshotRanges(none.id, 0).empty());
  EXPECT_EQ(RangesString(SnapshotRanges(rest.id, 0)), "{[10,15)}");
  const FullFingerprint split = FullFingerprintOf(*engine_);
  ExpectRefusedUnchanged(Merge(none, rest, &merged), split, "holds nothing");
  Tracked joined;
  ASSERT_TRUE(Merge(rest, rejoined, &joined).ok());  // [5, 19), start 10
  EXPECT_EQ(RangesString(SnapshotRanges(joined.id, 0)), "{[10,19)}");
  // Restoring the empty half rewinds the live layer, as a nil snapshot does.
  EXPECT_TRUE(cache.Restore(none.id, none.ref.get(), 15).ok());
  EXPECT_TRUE(cache.Matches());
}

// Halves cut below the start position of the state they came from hold
// nothing for the chunked layer; merged, they hold nothing either (restoring
// any of them rewinds the live layer alike).
TEST_P(ChunkedRecurrentTest, ChunkedHalvesHoldingNothingMergeIntoNothing) {
  HybridCache cache(*engine_, ChunkedSpec(4));
  ASSERT_TRUE(cache.Step(8));
  ASSERT_TRUE(cache.Step(1));            // start 4, offset 9
  const Tracked whole = Take(cache, 0);  // [0, 9), start 4
  Tracked below2, from2, two_three, from3, merged;
  Split(whole, 2, &below2, &from2);
  Split(from2, 3, &two_three, &from3);
  ASSERT_EQ(below2.ref->layers[0], nullptr);
  ASSERT_EQ(two_three.ref->layers[0], nullptr);
  ASSERT_TRUE(Merge(below2, two_three, &merged).ok());
  EXPECT_EQ(merged.ref->layers[0], nullptr);
  EXPECT_TRUE(SnapshotRanges(merged.id, 0).empty());
}

// ---------------------------------------------------------------- recurrent

TEST_P(ChunkedRecurrentTest, RecurrentStateReadsAsZerosUntilTheFirstUpdate) {
  const CacheSpec spec = MakeSpec({ThreePageState()}, DType::kFloat32);
  HybridCache cache(*engine_, spec);
  EXPECT_EQ(UsedPages(), 0);  // no state, no pages
  auto view = engine_->Freeze(cache.id(), "");
  ASSERT_TRUE(view.ok());
  absl::StatusOr<RefState> state = ReadLayerState(**view, 0);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_TRUE(*state == ZeroState(spec, 0));
  EXPECT_EQ(engine_->Snapshot(cache.id(), 0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(cache.Step(0));  // a state that consumed no token
  EXPECT_EQ(UsedPages(), 3);
  EXPECT_EQ(cache.offset(), 0u);
  EXPECT_TRUE(cache.Matches());
}

// Each update writes fresh pages and drops the old ones; snapshots keep the
// pages they saw, so Snapshot, Restore, Merge and Split allocate nothing.
TEST_P(ChunkedRecurrentTest, RecurrentStatesAreSwappedNeverCopied) {
  HybridCache cache(*engine_, MakeSpec({ThreePageState()}, DType::kFloat32));
  ASSERT_TRUE(cache.Step(2));
  EXPECT_EQ(UsedPages(), 3);
  const Tracked first = Take(cache, 0);
  EXPECT_EQ(UsedPages(), 3);
  ASSERT_TRUE(cache.Step(3));
  EXPECT_EQ(UsedPages(), 6);  // the snapshot keeps the old state
  ASSERT_TRUE(engine_->ReleaseSnapshot(first.id).ok());
  EXPECT_EQ(UsedPages(), 3);
  const Tracked at5 = Take(cache, 1);  // `from` is recorded; the state is whole
  EXPECT_TRUE(HybridSnapshotMatches(*engine_, at5.id, *at5.ref));
  ASSERT_TRUE(cache.Step(1));
  EXPECT_EQ(UsedPages(), 6);
  ASSERT_TRUE(cache.Restore(at5.id, at5.ref.get(), 5).ok());
  EXPECT_EQ(UsedPages(), 3);  // the live layer now shares the snapshot's pages
  EXPECT_TRUE(cache.Matches());
  // ollama would take a target past the snapshot and land at 5; every layer
  // must end at the target, so it is refused.
  const FullFingerprint restored = FullFingerprintOf(*engine_);
  ExpectRefusedUnchanged(cache.Restore(at5.id, at5.ref.get(), 9), restored,
                         "past the recurrent snapshot's offset 5");
  Tracked none, whole;
  Split(at5, 3, &none, &whole);
  EXPECT_EQ(UsedPages(), 3);
  Tracked merged;
  ASSERT_TRUE(Merge(none, whole, &merged).ok());  // the child supersedes
  EXPECT_EQ(UsedPages(), 3);
}

TEST_P(ChunkedRecurrentTest, RecurrentRefusalsChangeNothing) {
  const CacheSpec spec = MakeSpec({SmallState(), ThreePageState()}, DType::kFloat32);
  HybridCache cache(*engine_, spec);
  ASSERT_TRUE(cache.Step(5));
  const Tracked at5 = Take(cache, 0);
  ASSERT_TRUE(cache.Step(2));
  const FullFingerprint before = FullFingerprintOf(*engine_);
  std::mt19937_64 rng(5);
  for (auto [layer, conv, field] :
       {std::tuple{0u, true, "state.conv_state"}, std::tuple{1u, false, "state.delta_state"}}) {
    const RefState bad = RandomState(spec, layer, rng, conv ? 4 : 0, conv ? 0 : -4);
    const absl::Status status =
        engine_->UpdateState(cache.id(), layer, StateInputOf(bad, 1)).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(Mentions(status, field));
  }
  const RefState good = RandomState(spec, 0, rng);
  absl::Status status =
      engine_->UpdateState(cache.id(), 0, StateInputOf(good, UINT64_MAX)).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(Mentions(status, "state.advance"));
  status = engine_->UpdateState(cache.id(), 0, StateInputOf(good, 1), 6).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  const KvTensors kv = RandomKv(RefShape{}, 1, rng);
  status = engine_->Update(cache.id(), 1, kv.input()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(Mentions(status, "keys: layer 1 is recurrent"));
  auto view = engine_->Freeze(cache.id(), "");
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(ReadRange(**view, 0, {0, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(FullFingerprintOf(*engine_) == before);
  ExpectRefusedUnchanged(engine_->Trim(cache.id(), 0).status(), before,
                         "a recurrent state holds every token");
  ExpectRefusedUnchanged(cache.Restore("", nullptr, 6), before, "cannot be rewound");
  ExpectRefusedUnchanged(cache.Restore("", nullptr, 8), before, "cannot be rewound");
  ExpectRefusedUnchanged(cache.Restore(at5.id, at5.ref.get(), 4), before,
                         "before the recurrent snapshot's offset 5");
  EXPECT_TRUE(cache.Restore("", nullptr, 7).ok());  // the current offset
  EXPECT_TRUE(cache.Matches());
}

// A recurrent state exists only at its snapshot's offset: any other target is
// refused, also where every layer is recurrent and none other would refuse
// it, and nothing changes.
TEST_P(ChunkedRecurrentTest, RecurrentRestoreReachesOnlyItsSnapshotsOffset) {
  HybridCache cache(*engine_, MakeSpec({SmallState(), ThreePageState()}, DType::kFloat32));
  ASSERT_TRUE(cache.Step(8));
  const Tracked at8 = Take(cache, 0);
  ASSERT_TRUE(cache.Step(3));
  const FullFingerprint before = FullFingerprintOf(*engine_);
  ExpectRefusedUnchanged(cache.Restore(at8.id, at8.ref.get(), 9), before,
                         "layer 0: target 9 is past the recurrent snapshot's offset 8");
  ExpectRefusedUnchanged(cache.Restore(at8.id, at8.ref.get(), 11), before,
                         "layer 0: target 11 is past the recurrent snapshot's offset 8");
  ExpectRefusedUnchanged(cache.Restore(at8.id, at8.ref.get(), 7), before,
                         "layer 0: target 7 is before the recurrent snapshot's offset 8");
  ASSERT_TRUE(cache.Restore(at8.id, at8.ref.get(), 8).ok());
  EXPECT_EQ(engine_->GetCache(cache.id())->layer_offsets, (std::vector<uint64_t>{8, 8}));
  EXPECT_TRUE(cache.Matches());
}

// Keys and values for a recurrent layer, or a state for an attention layer,
// are INVALID_ARGUMENT in a mixed cache, and change nothing.
TEST_P(ChunkedRecurrentTest, WrongKindUpdatesAreInvalid) {
  const CacheSpec spec =
      MakeSpec({SmallState(), StandardLayerSpec(1, 4), ChunkedLayerSpec(1, 4, 4, 5)});
  HybridCache cache(*engine_, spec);
  ASSERT_TRUE(cache.Step(3));
  const FullFingerprint before = FullFingerprintOf(*engine_);
  std::mt19937_64 rng(9);
  const KvTensors kv = RandomKv(spec, 1, 1, rng);
  EXPECT_EQ(engine_->Update(cache.id(), 0, kv.input()).status().code(),
            absl::StatusCode::kInvalidArgument);
  const RefState state = RandomState(spec, 0, rng);
  for (uint32_t layer : {1u, 2u}) {
    const absl::Status status =
        engine_->UpdateState(cache.id(), layer, StateInputOf(state, 1)).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(Mentions(status, "state:"));
  }
  EXPECT_TRUE(FullFingerprintOf(*engine_) == before);
  ASSERT_TRUE(cache.Step(2));
  EXPECT_TRUE(cache.Matches());
}

INSTANTIATE_TEST_SUITE_P(TransferPaths, ChunkedRecurrentTest,
                         ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
