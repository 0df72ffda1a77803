// WireDriver's page check of a speculation round, over the wire, as the
// engine driver's (tests/engine/random_driver_page_check.cc): before the
// round, a snapshot of the live cache from 0 restored into a new cache of its
// spec (the shadow); after it, the shadow takes one plain Update of the kept
// tokens per attention layer (each recurrent layer the live state, advancing
// by them), and the two caches must report the same size_bytes: the pages of
// drafted tokens that were not kept are gone, whatever else holds pages on
// the server (this holds with a shared server too).
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "e2e_test_util.h"
#include "gtest/gtest.h"
#include "wire_driver.h"

namespace kvcache::testing {

std::optional<WireDriver::PageShadow> WireDriver::BeginPageShadow() {
  PageShadow shadow{.offset = Offset()};
  RefCacheSnapshotPtr expected = reference_->Snapshot(0);  // null at offset 0
  if (expected != nullptr) {
    RefCache restored(reference_->spec());
    if (!restored.Restore(expected.get(), shadow.offset)) return std::nullopt;
  }
  absl::StatusOr<v1::CacheInfo> live = client_.GetCache(cache_id_);
  EXPECT_TRUE(live.ok()) << live.status();
  if (!live.ok()) return std::nullopt;
  absl::StatusOr<v1::CacheInfo> created = client_.CreateCache(live->spec());
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return std::nullopt;
  shadow.cache_id = created->cache_id();
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
    SendToShadow(shadow, parts);
    return shadow;
  }
  absl::StatusOr<v1::SnapshotInfo> snapshot = client_.Snapshot(cache_id_, 0);
  EXPECT_TRUE(snapshot.ok()) << snapshot.status();
  if (snapshot.ok()) shadow.snapshot_id = snapshot->snapshot_id();
  absl::StatusOr<v1::CacheInfo> restored =
      client_.Restore(shadow.cache_id, shadow.snapshot_id, shadow.offset);
  EXPECT_TRUE(restored.ok()) << restored.status();
  return shadow;
}

void WireDriver::EndPageShadow(const PageShadow& shadow, const RefSpeculation& reference,
                               uint64_t kept) {
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
  if (!::testing::Test::HasFailure()) SendToShadow(shadow, parts);
  if (!::testing::Test::HasFailure()) {
    SCOPED_TRACE(absl::StrCat("page check of a round from ", shadow.offset, ", ", kept, " kept"));
    absl::StatusOr<v1::CacheInfo> live = client_.GetCache(cache_id_);
    absl::StatusOr<v1::CacheInfo> plain = client_.GetCache(shadow.cache_id);
    EXPECT_TRUE(live.ok() && plain.ok()) << live.status() << plain.status();
    if (live.ok() && plain.ok()) {
      EXPECT_EQ(plain->offset(), live->offset()) << "the shadow is not where the live cache is";
      EXPECT_EQ(live->size_bytes(), plain->size_bytes())
          << "the live cache holds other pages than plain updates of what it kept would";
      ++stats_.page_checks;
    }
  }
  DropPageShadow(shadow);
}

void WireDriver::SendToShadow(const PageShadow& shadow, const std::deque<StepPart>& parts) {
  if (parts.empty()) return;
  const std::vector<LayerUpdate> updates = UpdatesOf(reference_->spec(), parts);
  absl::StatusOr<std::vector<v1::UpdateResponse>> acks = client_.Update(shadow.cache_id, updates);
  EXPECT_TRUE(acks.ok()) << "the shadow's update: " << acks.status();
}

void WireDriver::DropPageShadow(const PageShadow& shadow) {
  EXPECT_TRUE(client_.DeleteCache(shadow.cache_id).ok());
  if (!shadow.snapshot_id.empty()) {
    EXPECT_TRUE(client_.ReleaseSnapshot(shadow.snapshot_id).ok());
  }
}

}  // namespace kvcache::testing
