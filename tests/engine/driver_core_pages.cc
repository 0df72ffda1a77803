// DriverCore's page check of a speculation round (either way), and the
// snapshot way to speculate.
//
// Pages a round leaves behind (drafted tokens past the accepted ones still in
// a page table, a page kept for a position nobody holds) would not show in any
// fetch, so the live cache is compared with a shadow that never speculated:
//
//   before the round   S = Snapshot(live, from 0); shadow = a new cache of
//                      the live spec, Restore(shadow, S, offset): the same
//                      pages as the live cache
//   after it           the shadow takes plain updates of what the round kept
//                      (a commit of n is one update of n tokens; the snapshot
//                      way's steps one update each), so it holds what the live
//                      cache should: the two must take the same pool bytes
//
// The pool's used-page count is not compared: the shadow starts without the
// live layers' append right (engine/layers/token_store.h), so its first write may copy
// the page the two share where the live cache writes in place.
//
// The snapshot way is speculative decoding without BeginSpeculation, as ollama
// did before its speculative caches. Before each drafted token the live cache
// is snapshotted; the target model's verdict then restores the snapshot at the
// accepted offset (a recurrent layer can be restored only there: its state
// cannot be cut back) and the other snapshots are released.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "driver_core.h"
#include "gtest/gtest.h"

namespace kvcache::testing {

std::optional<DriverCore::PageShadow> DriverCore::BeginPageShadow() {
  PageShadow shadow{.offset = Offset()};
  RefCacheSnapshotPtr expected = reference_->Snapshot(0);  // null at offset 0
  if (expected != nullptr) {
    RefCache restored(reference_->spec());
    if (!restored.Restore(expected.get(), shadow.offset)) return std::nullopt;
  }
  absl::StatusOr<CacheState> created = adapter_.CreateCacheLike(cache_id_);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return std::nullopt;
  shadow.cache_id = created->cache_id;
  if (expected == nullptr) {
    // At offset 0 only a recurrent layer may hold something: a state that
    // consumed no token.
    std::deque<StepPart> parts;
    for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
      if (!IsRecurrent(layer)) continue;
      std::optional<RefState> state = reference_->layer(layer).FetchState();
      if (!state.has_value()) continue;
      parts.push_back({.layer = layer, .recurrent = true, .state = *std::move(state)});
    }
    if (parts.empty()) return shadow;
    const StreamResult sent = adapter_.SendUpdates(shadow.cache_id, reference_->spec(), parts, true);
    EXPECT_TRUE(sent.status.ok()) << "the shadow's update: " << sent.status;
    return shadow;
  }
  absl::StatusOr<SnapshotState> snapshot = adapter_.Snapshot(cache_id_, 0, false);
  EXPECT_TRUE(snapshot.ok()) << snapshot.status();
  if (snapshot.ok()) shadow.snapshot_id = snapshot->snapshot_id;
  absl::StatusOr<CacheState> restored =
      adapter_.Restore(shadow.cache_id, shadow.snapshot_id, shadow.offset);
  EXPECT_TRUE(restored.ok()) << restored.status();
  ExpectSamePages(shadow, "before the round: a cache restored from a snapshot of the live one");
  return shadow;
}

void DriverCore::ExpectSamePages(const PageShadow& shadow, const std::string& what) {
  SCOPED_TRACE(absl::StrCat("page check of a round from ", shadow.offset, ", ", what));
  absl::StatusOr<CacheState> live = adapter_.GetCache(cache_id_);
  absl::StatusOr<CacheState> plain = adapter_.GetCache(shadow.cache_id);
  ASSERT_TRUE(live.ok() && plain.ok()) << live.status() << plain.status();
  EXPECT_EQ(plain->layer_offsets, live->layer_offsets) << "the shadow is not in step";
  EXPECT_EQ(live->size_bytes, plain->size_bytes)
      << "the live cache holds other pages than the shadow";
}

void DriverCore::EndPageShadow(const PageShadow& shadow, const std::deque<StepPart>& kept) {
  if (!::testing::Test::HasFailure() && !kept.empty()) {
    const StreamResult sent = adapter_.SendUpdates(shadow.cache_id, reference_->spec(), kept, true);
    EXPECT_TRUE(sent.status.ok()) << "the shadow's update: " << sent.status;
  }
  if (!::testing::Test::HasFailure()) {
    ExpectSamePages(shadow, "after it: the shadow took plain updates of what the round kept");
    ++stats_.page_checks;
  }
  DropPageShadow(shadow);
}

void DriverCore::DropPageShadow(const PageShadow& shadow) {
  EXPECT_TRUE(adapter_.DeleteCache(shadow.cache_id).ok());
  if (!shadow.snapshot_id.empty()) {
    EXPECT_TRUE(adapter_.ReleaseSnapshot(shadow.snapshot_id).ok());
  }
}

std::deque<StepPart> DriverCore::KeptParts(const RefSpeculation& reference, uint64_t kept) const {
  std::deque<StepPart> parts;
  for (uint32_t layer = 0; layer < reference_->num_layers() && kept > 0; ++layer) {
    StepPart part{.layer = layer, .recurrent = IsRecurrent(layer), .advance = kept};
    if (part.recurrent) {
      part.state = reference_->layer(layer).FetchState().value();  // the commit set one
    } else {
      part.kv.tokens = kept;
      TensorsFromTokens(ShapeOf(reference_->spec(), layer), reference.DraftedTokens(layer, kept),
                        part.kv.keys, part.kv.values);
    }
    parts.push_back(std::move(part));
  }
  return parts;
}

void DriverCore::SpeculateBySnapshots() {
  const uint64_t drafted = Uniform(1, kMaxDraft);
  if (KeepStandardLayersSmall(drafted)) return;
  if (Offset() == 0) return UpdateStep();  // a snapshot needs a token to hold
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
  std::vector<std::deque<StepPart>> steps;
  for (uint64_t i = 0; i < drafted && !::testing::Test::HasFailure(); ++i) {
    TakeDraftSnapshot(from, taken);
    if (::testing::Test::HasFailure()) break;
    steps.emplace_back();
    for (uint32_t l = 0; l < reference_->num_layers(); ++l) {
      steps.back().push_back(RandomPart(reference_->spec(), l, 1));
    }
    SendStream(steps.back(), steps.back().size());
    ++stats_.steps;
  }
  if (!::testing::Test::HasFailure() && accepted < drafted) {
    const TrackedSnapshot target = taken[accepted];
    CompareRestore(target.id, target.reference.get(), committed + accepted);
  }
  if (::testing::Test::HasFailure()) return;
  ReleaseDraftSnapshots(taken, accepted);
  ++stats_.snapshot_way_rounds;
  if (shadow.has_value()) EndPageShadow(*shadow, PlainSteps(steps, Offset() - committed));
}

std::deque<StepPart> DriverCore::PlainSteps(const std::vector<std::deque<StepPart>>& steps,
                                            uint64_t kept) const {
  std::deque<StepPart> plain;
  for (uint64_t s = 0; s < kept; ++s) {
    for (const StepPart& part : steps[s]) {
      if (!part.recurrent) plain.push_back(part);
    }
  }
  for (uint32_t layer = 0; layer < reference_->num_layers() && kept > 0; ++layer) {
    if (!IsRecurrent(layer)) continue;
    plain.push_back({.layer = layer,
                     .recurrent = true,
                     .state = reference_->layer(layer).FetchState().value(),
                     .advance = kept});
  }
  return plain;
}

// The snapshot restored from is sometimes kept as the committed state the next
// round may go back to (a layer restored from it claims its append right
// through it: token_store.h RestoreSource); the rest are released.
void DriverCore::ReleaseDraftSnapshots(const std::vector<TrackedSnapshot>& taken,
                                       size_t restored) {
  for (size_t i = 0; i < taken.size(); ++i) {
    if (i == restored && snapshots_.size() < kMaxSnapshots && Chance(0.3)) {
      snapshots_.push_back(taken[i]);
      continue;
    }
    EXPECT_TRUE(adapter_.ReleaseSnapshot(taken[i].id).ok()) << taken[i].id;
  }
}

void DriverCore::TakeDraftSnapshot(uint64_t from, std::vector<TrackedSnapshot>& taken) {
  RefCacheSnapshotPtr expected = reference_->Snapshot(from);
  ASSERT_NE(expected, nullptr) << "the reference refused a snapshot from " << from;
  const bool pinned = Chance(0.2);
  absl::StatusOr<SnapshotState> info = adapter_.Snapshot(cache_id_, from, pinned);
  ASSERT_TRUE(info.ok()) << info.status();
  CheckSnapshotInfo(*info, *expected, pinned);
  taken.push_back({info->snapshot_id, std::move(expected), pinned});
}

}  // namespace kvcache::testing
