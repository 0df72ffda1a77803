// RandomDriver's page check of a speculation round (either way): pages a
// round leaves behind (drafted tokens past the accepted ones still in a page
// table, a page kept for a position nobody holds) would not show in any
// fetch, so the live cache is compared with a shadow that never speculated.
//
//   before the round   S = Snapshot(live, from 0); shadow = a new cache of
//                      the live spec, Restore(shadow, S, offset): the same
//                      pages as the live cache
//   after it           the shadow takes plain updates of what the round kept
//                      (a commit of n is one Update of n tokens; the snapshot
//                      way's steps one Update each), so it holds what the live
//                      cache should: the two must take the same pool bytes
//
// The pool's used-page count is not compared: the shadow starts without the
// live layers' append right (engine/token_store.h), so its first write may copy
// the page the two share where the live cache writes in place.
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "chunked_recurrent_test_util.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "random_driver.h"

namespace kvcache::testing {

std::optional<RandomDriver::PageShadow> RandomDriver::BeginPageShadow() {
  PageShadow shadow{.offset = Offset()};
  RefCacheSnapshotPtr expected = reference_->Snapshot(0);  // null at offset 0
  if (expected != nullptr) {
    RefCache restored(reference_->spec());
    if (!restored.Restore(expected.get(), shadow.offset)) return std::nullopt;
  }
  absl::StatusOr<engine::CacheSpec> spec = engine_.GetSpec(cache_id_);
  EXPECT_TRUE(spec.ok()) << spec.status();
  if (!spec.ok()) return std::nullopt;
  absl::StatusOr<engine::CacheInfo> created = engine_.CreateCache(*spec);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return std::nullopt;
  shadow.cache_id = created->cache_id;
  if (expected == nullptr) {
    // At offset 0 only a recurrent layer may hold something: a state that
    // consumed no token.
    for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
      if (!IsRecurrentLayer(layer)) continue;
      const std::optional<RefState> state = reference_->layer(layer).FetchState();
      if (!state.has_value()) continue;
      EXPECT_TRUE(engine_.UpdateState(shadow.cache_id, layer, StateInputOf(*state, 0)).ok());
    }
    return shadow;
  }
  absl::StatusOr<engine::SnapshotInfo> snapshot = engine_.Snapshot(cache_id_, 0);
  EXPECT_TRUE(snapshot.ok()) << snapshot.status();
  if (snapshot.ok()) shadow.snapshot_id = snapshot->snapshot_id;
  absl::StatusOr<engine::CacheInfo> restored =
      engine_.Restore(shadow.cache_id, shadow.snapshot_id, shadow.offset);
  EXPECT_TRUE(restored.ok()) << restored.status();
  ExpectSamePages(shadow, "before the round: a cache restored from a snapshot of the live one");
  return shadow;
}

void RandomDriver::ExpectSamePages(const PageShadow& shadow, const std::string& what) {
  SCOPED_TRACE(absl::StrCat("page check of a round from ", shadow.offset, ", ", what));
  absl::StatusOr<engine::CacheInfo> live = engine_.GetCache(cache_id_);
  absl::StatusOr<engine::CacheInfo> plain = engine_.GetCache(shadow.cache_id);
  ASSERT_TRUE(live.ok() && plain.ok()) << live.status() << plain.status();
  EXPECT_EQ(plain->layer_offsets, live->layer_offsets) << "the shadow is not in step";
  EXPECT_EQ(live->size_bytes, plain->size_bytes)
      << "the live cache holds other pages than the shadow";
}

void RandomDriver::EndPageShadow(const PageShadow& shadow,
                                 const std::vector<StepTokens>& kept_steps) {
  if (!::testing::Test::HasFailure()) ApplyToShadow(shadow, kept_steps);
  if (!::testing::Test::HasFailure()) {
    ExpectSamePages(shadow, "after it: the shadow took plain updates of what the round kept");
    ++stats_.page_checks;
  }
  DropPageShadow(shadow);
}

void RandomDriver::ApplyToShadow(const PageShadow& shadow,
                                 const std::vector<StepTokens>& kept_steps) {
  for (const StepTokens& step : kept_steps) {
    for (uint32_t layer = 0; layer < step.size(); ++layer) {
      if (IsRecurrentLayer(layer)) continue;
      KvTensors kv{.tokens = step[layer].size()};
      TensorsFromTokens(ShapeOf(reference_->spec(), layer), step[layer], kv.keys, kv.values);
      absl::StatusOr<uint64_t> offset = engine_.Update(shadow.cache_id, layer, kv.input());
      ASSERT_TRUE(offset.ok()) << "shadow layer " << layer << ": " << offset.status();
    }
  }
  const uint64_t kept = Offset() - shadow.offset;
  if (kept == 0) return;  // recurrent layers: the state they had
  for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
    if (!IsRecurrentLayer(layer)) continue;
    absl::StatusOr<uint64_t> offset =
        engine_.UpdateState(shadow.cache_id, layer, StateInputOf(LiveState(layer), kept));
    ASSERT_TRUE(offset.ok()) << "shadow layer " << layer << ": " << offset.status();
  }
}

void RandomDriver::DropPageShadow(const PageShadow& shadow) {
  EXPECT_TRUE(engine_.DeleteCache(shadow.cache_id).ok());
  if (!shadow.snapshot_id.empty()) {
    EXPECT_TRUE(engine_.ReleaseSnapshot(shadow.snapshot_id).ok());
  }
}

}  // namespace kvcache::testing
