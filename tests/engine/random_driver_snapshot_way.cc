// RandomDriver's snapshot-per-token rounds: speculative decoding without
// BeginSpeculation, as ollama did before its speculative caches. Before each
// drafted token the live cache is snapshotted; the target model's verdict
// then restores the snapshot at the accepted offset (a recurrent layer can be
// restored only there: its state cannot be cut back) and the other snapshots
// are released. Every call is compared with the reference, and the round ends
// with the page check (random_driver_page_check.cc): restoring must leave the
// pages that plain steps of the kept tokens would.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "chunked_recurrent_test_util.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "random_driver.h"
#include "reference_quantized.h"

namespace kvcache::testing {

void RandomDriver::SpeculateBySnapshots() {
  const uint64_t drafted = Uniform(1, kMaxDraft);
  if (has_standard_layer_ && Offset() + drafted > kStandardOffsetCap) {
    return ShrinkOrRecreate(drafted);
  }
  if (Offset() == 0) return Update();  // a snapshot needs a token to hold
  const uint64_t committed = Offset();
  // From 0 mostly; from the last token sometimes, which a chunked layer that
  // trims its front meanwhile cannot restore (the reference says when).
  const uint64_t from = Chance(0.75) ? 0 : committed - 1;
  const uint64_t accepted = Uniform(0, drafted);
  SCOPED_TRACE(absl::StrCat("snapshot way from ", committed, " (snapshots from ", from, "): ",
                            accepted, " of ", drafted, " accepted"));
  const std::optional<PageShadow> shadow = BeginPageShadow();
  if (::testing::Test::HasFailure()) return;
  std::vector<TrackedSnapshot> taken;
  std::vector<StepTokens> steps;
  for (uint64_t i = 0; i < drafted && !::testing::Test::HasFailure(); ++i) {
    TakeDraftSnapshot(from, taken);
    if (!::testing::Test::HasFailure()) steps.push_back(StepOneToken());
  }
  if (!::testing::Test::HasFailure() && accepted < drafted) {
    const TrackedSnapshot target = taken[accepted];
    CompareRestore(target.id, target.reference.get(), committed + accepted);
  }
  if (::testing::Test::HasFailure()) return;
  ReleaseDraftSnapshots(taken, accepted);
  ++stats_.snapshot_way_rounds;
  // The accepted steps, or all of them when the restore was refused.
  steps.resize(Offset() - committed);
  if (shadow.has_value()) EndPageShadow(*shadow, steps);
}

void RandomDriver::TakeDraftSnapshot(uint64_t from, std::vector<TrackedSnapshot>& taken) {
  RefCacheSnapshotPtr expected = reference_->Snapshot(from);
  ASSERT_NE(expected, nullptr) << "the reference refused a snapshot from " << from;
  absl::StatusOr<engine::SnapshotInfo> info = engine_.Snapshot(cache_id_, from, Chance(0.2));
  ASSERT_TRUE(info.ok()) << info.status();
  CheckSnapshotInfo(*info, *expected);
  taken.push_back({info->snapshot_id, std::move(expected)});
}

RandomDriver::StepTokens RandomDriver::StepOneToken() {
  StepTokens step(reference_->num_layers());
  for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
    if (IsRecurrentLayer(layer)) {
      ApplyState(layer, 1);
    } else {
      const KvTensors kv = RandomLayerKv(reference_->spec(), layer, 1, rng_);
      step[layer] = TokensFromTensors(ShapeOf(reference_->spec(), layer), kv.keys, kv.values, 1);
      absl::StatusOr<uint64_t> result = engine_.Update(cache_id_, layer, kv.input());
      EXPECT_TRUE(result.ok()) << result.status();
      if (!result.ok()) return step;
      reference_->Update(layer, step[layer]);
      EXPECT_EQ(*result, reference_->layer(layer).offset());
    }
    if (::testing::Test::HasFailure()) return step;
  }
  ++stats_.updates;
  return step;
}

// The snapshot restored from is sometimes kept as the committed state the
// next round may go back to (a layer restored from it claims its append right
// through it: token_store.h RestoreSource); the rest are released.
void RandomDriver::ReleaseDraftSnapshots(const std::vector<TrackedSnapshot>& taken,
                                         size_t restored) {
  for (size_t i = 0; i < taken.size(); ++i) {
    if (i == restored && snapshots_.size() < kMaxSnapshots && Chance(0.3)) {
      snapshots_.push_back(taken[i]);
      continue;
    }
    EXPECT_TRUE(engine_.ReleaseSnapshot(taken[i].id).ok()) << taken[i].id;
  }
}

}  // namespace kvcache::testing
