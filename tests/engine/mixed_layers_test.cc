// Caches that mix layer kinds as hybrid models do (Qwen3-Next: recurrent and
// attention; Llama 4 / Gemma 3: chunked, sliding-window and global attention):
// Snapshot, Restore and Trim act on all layers as one. A layer that cannot
// reach the target refuses the whole call and no layer changes; a recurrent
// layer reaches only its snapshot's offset, so the whole restore does.
#include <random>
#include <string>
#include <vector>

#include "chunked_recurrent_test_util.h"
#include "engine/layers/cache.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "hybrid_test_fixture.h"

namespace kvcache::testing {
namespace {

using engine::CacheSpec;

class MixedLayersTest : public HybridEngineTest {};

CacheSpec Qwen3NextSpec() {
  return MakeSpec({SmallState(), ThreePageState(), SmallState(), StandardLayerSpec(2, 8)},
                  DType::kFloat32);
}

TEST_P(MixedLayersTest, RestoreMovesEveryLayerOrNone) {
  HybridCache cache(*engine_, Qwen3NextSpec());
  ASSERT_TRUE(cache.Step(6));
  ASSERT_TRUE(cache.Step(4));
  const int64_t before_snapshot = UsedPages();
  const Tracked at10 = Take(cache, 0);
  EXPECT_EQ(UsedPages(), before_snapshot);  // states and pages are shared, not copied
  ASSERT_TRUE(cache.Step(5));
  const FullFingerprint before = FullFingerprintOf(*engine_);
  // Neither the recurrent layers nor the standard one can reach 12.
  ExpectRefusedUnchanged(cache.Restore(at10.id, at10.ref.get(), 12), before,
                         "layer 0: target 12 is past the recurrent snapshot's offset 10");
  // The standard layer could rewind to 8, the recurrent ones cannot.
  ExpectRefusedUnchanged(cache.Restore(at10.id, at10.ref.get(), 8), before,
                         "layer 0: target 8 is before the recurrent snapshot's offset 10");
  ExpectRefusedUnchanged(cache.Restore("", nullptr, 12), before, "layer 0: a recurrent state");
  const int64_t before_restore = UsedPages();
  ASSERT_TRUE(cache.Restore(at10.id, at10.ref.get(), 10).ok());
  EXPECT_LE(UsedPages(), before_restore);  // nothing copied
  EXPECT_EQ(engine_->GetCache(cache.id())->layer_offsets, (std::vector<uint64_t>(4, 10)));
  EXPECT_TRUE(cache.Matches());
  ASSERT_TRUE(cache.Step(1));
  EXPECT_TRUE(cache.Matches());
}

// A step torn half-way (one layer updated) is recovered by restoring a
// snapshot: the recurrent layer cannot rewind, but it can take a state.
TEST_P(MixedLayersTest, TornStepIsRecoveredFromASnapshot) {
  const CacheSpec spec = MakeSpec({SmallState(), StandardLayerSpec(1, 4)});
  HybridCache cache(*engine_, spec);
  ASSERT_TRUE(cache.Step(4));
  const Tracked at4 = Take(cache, 0);
  std::mt19937_64 rng(17);
  RefState state = RandomState(spec, 0, rng);
  ASSERT_TRUE(engine_->UpdateState(cache.id(), 0, StateInputOf(state, 2)).ok());
  cache.reference().UpdateState(0, std::move(state), 2);
  EXPECT_EQ(engine_->Snapshot(cache.id(), 0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const FullFingerprint before = FullFingerprintOf(*engine_);
  ExpectRefusedUnchanged(cache.Restore("", nullptr, 4), before, "cannot be rewound");
  ASSERT_TRUE(cache.Restore(at4.id, at4.ref.get(), 4).ok());
  EXPECT_TRUE(engine_->GetCache(cache.id())->in_step);
  EXPECT_TRUE(cache.Matches());
}

// Llama 4 / Gemma 3: a chunked layer refuses a rewind below its start while
// the sliding-window and global layers beside it would accept.
TEST_P(MixedLayersTest, ChunkedLayerHoldsBackTheWholeCache) {
  const CacheSpec spec = MakeSpec(
      {RotatingLayerSpec(1, 4, 0, 16, 0), ChunkedLayerSpec(2, 4, 4, 4), StandardLayerSpec(1, 8)},
      DType::kBFloat16);
  HybridCache cache(*engine_, spec);
  ASSERT_TRUE(cache.Step(6));
  ASSERT_TRUE(cache.Step(1));  // chunked start 2, offset 7
  const FullFingerprint before = FullFingerprintOf(*engine_);
  ExpectRefusedUnchanged(cache.Restore("", nullptr, 1), before,
                         "layer 1: target 1 is below the start position 2");
  absl::StatusOr<uint64_t> trimmed = engine_->Trim(cache.id(), 7);
  ASSERT_TRUE(trimmed.ok()) << trimmed.status();
  EXPECT_EQ(*trimmed, 5u);  // every layer stops where the chunked one does
  EXPECT_EQ(cache.reference().Trim(7), std::optional<uint64_t>(5));
  EXPECT_EQ(engine_->GetCache(cache.id())->layer_offsets, (std::vector<uint64_t>{2, 2, 2}));
  EXPECT_TRUE(cache.Matches());
}

TEST_P(MixedLayersTest, TrimRefusalNamesTheLayerAndWhy) {
  HybridCache cache(*engine_, MakeSpec({StandardLayerSpec(1, 4), SmallState()}));
  ASSERT_TRUE(cache.Step(3));
  const FullFingerprint before = FullFingerprintOf(*engine_);
  ExpectRefusedUnchanged(engine_->Trim(cache.id(), 1).status(), before,
                         "layer 1 cannot be trimmed: a recurrent state");
  HybridCache windowed(*engine_, MakeSpec({RotatingLayerSpec(1, 4, 0, 4, 0)}));
  ASSERT_TRUE(windowed.Step(5));
  const FullFingerprint filled = FullFingerprintOf(*engine_);
  ExpectRefusedUnchanged(engine_->Trim(windowed.id(), 1).status(), filled,
                         "layer 0 cannot be trimmed: its rotating window has filled");
}

// Split gives the parent no recurrent state (and no window); merging the
// halves back keeps the child's, and the merged snapshot restores.
TEST_P(MixedLayersTest, SplitAndMergeAcrossKinds) {
  const CacheSpec spec = MakeSpec({SmallState(), ChunkedLayerSpec(1, 4, 4, 6),
                                   RotatingLayerSpec(1, 4, 0, 8, 2), StandardLayerSpec(1, 4)});
  HybridCache cache(*engine_, spec);
  ASSERT_TRUE(cache.Step(7));
  ASSERT_TRUE(cache.Step(1));  // chunked start 1, offset 8
  const Tracked whole = Take(cache, 0);
  Tracked parent, child, merged;
  Split(whole, 5, &parent, &child);
  EXPECT_EQ(parent.ref->layers[0], nullptr);  // recurrent: (none, snapshot)
  EXPECT_EQ(parent.ref->layers[2], nullptr);  // rotating: (none, snapshot)
  ASSERT_NE(parent.ref->layers[1], nullptr);  // chunked: start 1 <= 5
  ASSERT_TRUE(Merge(parent, child, &merged).ok());
  ASSERT_TRUE(cache.Step(2));
  ASSERT_TRUE(cache.Restore(merged.id, merged.ref.get(), 8).ok());
  EXPECT_TRUE(cache.Matches());
}

// Every layer ends at the target: a recurrent layer beside one that rewinds
// live (its snapshot part null) refuses a target past its own offset rather
// than leave the layers out of step. No whole snapshot the engine makes has
// that shape (its recurrent and rotating parts are null together), so this
// builds one by hand.
TEST_P(MixedLayersTest, RestoreEndsEveryLayerAtTheTarget) {
  const CacheSpec spec =
      engine::NormalizeSpec(MakeSpec({SmallState(), RotatingLayerSpec(1, 4, 0, 8, 0)}));
  auto cache = engine::Cache::Create(spec, *pool_, kHybridPageTokens);
  ASSERT_TRUE(cache.ok()) << cache.status();
  RefCache reference(spec);
  std::mt19937_64 rng(23);
  const auto step = [&](uint64_t tokens) {
    RefState state = RandomState(spec, 0, rng);
    ASSERT_TRUE((*cache)->UpdateState(0, StateInputOf(state, tokens)).ok());
    reference.UpdateState(0, std::move(state), tokens);
    const KvTensors kv = RandomKv(spec, 1, tokens, rng);
    ASSERT_TRUE((*cache)->Update(1, kv.input()).ok());
    reference.Update(1, TokensFromTensors(ShapeOf(spec, 1), kv.keys, kv.values, tokens));
  };
  step(3);
  absl::StatusOr<engine::CacheSnapshotPtr> snapshot = (*cache)->Snapshot("c", 0);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  engine::CacheSnapshot no_window = **snapshot;
  no_window.layers[1] = nullptr;
  RefCacheSnapshot ref_no_window = *reference.Snapshot(0);
  ref_no_window.layers[1] = nullptr;
  step(3);
  const absl::Status refused = (*cache)->Restore(&no_window, 6);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(Mentions(refused, "layer 0: target 6 is past the recurrent snapshot's offset 3"));
  EXPECT_FALSE(reference.Restore(&ref_no_window, 6));
  EXPECT_EQ((*cache)->layer_offsets(), (std::vector<uint64_t>{6, 6}));
  ASSERT_TRUE((*cache)->Restore(&no_window, 3).ok());  // the window rewinds live to 3
  EXPECT_TRUE(reference.Restore(&ref_no_window, 3));
  EXPECT_EQ((*cache)->layer_offsets(), (std::vector<uint64_t>{3, 3}));
  (*cache)->Free();
}

INSTANTIATE_TEST_SUITE_P(TransferPaths, MixedLayersTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
