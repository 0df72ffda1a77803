// RandomDriver's reads (random_driver.h): the live cache, snapshots and
// speculations read through engine views, and the final comparison.
#include "random_driver.h"

#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "chunked_recurrent_test_util.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "reference_chunked.h"
#include "reference_quantized.h"
#include "reference_recurrent.h"

namespace kvcache::testing {

RandomDriver::RandomDriver(engine::Engine& engine, const RandomConfig& config)
    : EngineAdapterHolder(engine), DriverCore(engine_adapter, config) {
  Start();
}

void RandomDriver::FetchLive() {
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  SCOPED_TRACE(absl::StrCat("fetch live layer ", layer));
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view =
      engine().Freeze(cache_id_, "");
  ASSERT_TRUE(view.ok()) << view.status();
  if (IsRecurrent(layer)) {
    CheckState(**view, layer, ExpectedState(layer, nullptr));
  } else {
    const std::vector<RefToken> expected = Expected(layer, nullptr);
    CheckReferenceShape(layer, expected);
    CheckLayer(**view, layer, expected);
  }
  ++stats_.fetches;
}

void RandomDriver::FetchSnapshot() {
  if (snapshots_.empty()) return;
  const TrackedSnapshot& snapshot = snapshots_[RandomSnapshotIndex()];
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  SCOPED_TRACE(absl::StrCat("fetch snapshot [", snapshot.reference->from, ",",
                            snapshot.reference->to, ") layer ", layer));
  // A snapshot is found by its id alone; the live cache named beside it is
  // renewed, not read.
  auto view = engine().Freeze(Chance(0.5) ? cache_id_ : "", snapshot.id);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ((*view)->from, snapshot.reference->from);
  EXPECT_EQ((*view)->to, snapshot.reference->to);
  const RefCacheSnapshot* reference = snapshot.reference.get();
  if (IsRecurrent(layer)) {
    CheckState(**view, layer, ExpectedState(layer, reference));
  } else {
    CheckLayer(**view, layer, Expected(layer, reference));
  }
  ++stats_.snapshot_fetches;
}

void RandomDriver::FetchSpeculationWindow(const std::string& id, const RefSpeculation& reference) {
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view =
      engine().Freeze(Chance(0.5) ? cache_id_ : "", "", id);
  ASSERT_TRUE(view.ok()) << view.status();
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  if (IsRecurrent(layer)) {
    return CheckState(**view, layer,
                      reference.FetchState(layer).value_or(ZeroState(reference_->spec(), layer)));
  }
  CheckLayer(**view, layer, reference.Fetch(layer));
}

// Only the engine can hold a read across other calls: a Fetch over the wire
// ends before the next call starts.
DriverCore::HeldRead RandomDriver::HoldSpeculationRead(const std::string& id,
                                                       const RefSpeculation& reference) {
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view = engine().Freeze("", "", id);
  EXPECT_TRUE(view.ok()) << view.status();
  if (!view.ok()) return nullptr;
  if (IsRecurrent(layer)) {
    return [this, view = *std::move(view), layer,
            state = reference.FetchState(layer).value_or(ZeroState(reference_->spec(), layer))] {
      CheckState(*view, layer, state);
    };
  }
  return [this, view = *std::move(view), layer, tokens = reference.Fetch(layer)] {
    CheckLayer(*view, layer, tokens);
  };
}

void RandomDriver::CheckLayer(const engine::CacheSnapshot& view, uint32_t layer,
                              const std::vector<RefToken>& all) {
  const uint64_t end = all.empty() ? 0 : all.back().position + 1;
  engine::TokenRange window = kEverything;
  if (!Chance(0.4)) {
    const uint64_t begin = Uniform(0, end + 2);
    window = {begin, Uniform(begin, end + 3)};
  }
  SCOPED_TRACE(absl::StrCat("layer ", layer, " window [", window.begin, ",", window.end, ")"));
  const std::vector<RefToken> expected = Clip(all, window);
  const std::vector<engine::TokenRange> ranges = view.Ranges(layer, window);
  ASSERT_EQ(RangesString(ranges), RangesString(RangesOf(expected)));
  if (ranges.empty() || Chance(0.6)) {
    absl::StatusOr<std::vector<RefToken>> actual = FetchStoredLayer(view, layer, window);
    ASSERT_TRUE(actual.ok()) << actual.status();
    ASSERT_TRUE(SameTokens(expected, *actual));
    return;
  }
  // A sub-range of one returned range: reads need not start at a range start.
  const engine::TokenRange& range = ranges[Uniform(0, ranges.size() - 1)];
  const uint64_t begin = Uniform(range.begin, range.end - 1);
  const engine::TokenRange sub{begin, Uniform(begin + 1, range.end)};
  absl::StatusOr<std::vector<RefToken>> actual = ReadStoredRange(view, layer, sub);
  ASSERT_TRUE(actual.ok()) << actual.status();
  ASSERT_TRUE(SameTokens(Clip(expected, sub), *actual));
}

// The reference's own invariant (a bug here is in reference_model.cc): a
// standard layer holds [0, offset); a rotating one the sinks [0, keep) and a
// window ending at offset.
void RandomDriver::CheckReferenceShape(uint32_t layer, const std::vector<RefToken>& tokens) {
  const std::vector<engine::TokenRange> ranges = RangesOf(tokens);
  const uint64_t offset = reference_->layer(layer).offset();
  if (const auto* chunked = dynamic_cast<const RefChunkedLayer*>(&reference_->layer(layer))) {
    // [start_position, offset), empty when a trim reached the start.
    const uint64_t start = chunked->start_position();
    if (start == offset) {
      EXPECT_TRUE(ranges.empty()) << "reference model shape";
    } else {
      EXPECT_EQ(RangesString(ranges), RangesString({{start, offset}})) << "reference model shape";
    }
    return;
  }
  if (offset == 0) {
    EXPECT_TRUE(ranges.empty()) << "reference model shape";
    return;
  }
  ASSERT_FALSE(ranges.empty()) << "reference model shape";
  EXPECT_EQ(ranges.back().end, offset) << "reference model shape";
  EXPECT_LE(ranges.size(), 2u) << "reference model shape " << RangesString(ranges);
  const auto* rotating = std::get_if<engine::RotatingKind>(&config_.spec.layers[layer].kind);
  if (ranges.size() == 2) {
    ASSERT_NE(rotating, nullptr) << "reference model shape";
    EXPECT_EQ(ranges[0], (engine::TokenRange{0, rotating->keep})) << "reference model shape";
  } else if (rotating == nullptr) {
    EXPECT_EQ(ranges[0].begin, 0u) << "reference model shape";
  }
}

void RandomDriver::CheckState(const engine::CacheSnapshot& view, uint32_t layer,
                              const std::optional<RefState>& expected) {
  SCOPED_TRACE(absl::StrCat("recurrent layer ", layer));
  EXPECT_TRUE(view.Ranges(layer, kEverything).empty());
  absl::StatusOr<RefState> actual = ReadLayerState(view, layer);
  if (!expected.has_value()) {
    ASSERT_EQ(actual.status().code(), absl::StatusCode::kInvalidArgument) << actual.status();
    return;
  }
  ASSERT_TRUE(actual.ok()) << actual.status();
  ASSERT_TRUE(actual->conv == expected->conv) << "conv state bytes differ";
  ASSERT_TRUE(actual->delta == expected->delta) << "delta state bytes differ";
  if (Chance(0.1)) {  // a recurrent layer has no tokens to read
    EXPECT_EQ(ReadRange(view, layer, {0, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

void RandomDriver::CheckAllSnapshots() {
  CheckSnapshotList();
  for (const TrackedSnapshot& snapshot : snapshots_) {
    auto view = engine().Freeze("", snapshot.id);
    ASSERT_TRUE(view.ok()) << view.status();
    for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
      auto actual = FetchStoredLayer(**view, layer, kEverything);
      ASSERT_TRUE(actual.ok()) << actual.status();
      ASSERT_TRUE(SameTokens(RefCache::FetchSnapshot(*snapshot.reference, layer), *actual))
          << "snapshot " << snapshot.id << " layer " << layer;
      if (IsRecurrent(layer)) {
        CheckState(**view, layer, ExpectedState(layer, snapshot.reference.get()));
      }
    }
  }
}

void RandomDriver::Finish() {
  SCOPED_TRACE(absl::StrCat(config_.name, " seed=", config_.seed, " final check"));
  if (!::testing::Test::HasFailure()) {
    auto view = engine().Freeze(cache_id_, "");
    ASSERT_TRUE(view.ok()) << view.status();
    for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
      auto actual = FetchStoredLayer(**view, layer, kEverything);
      ASSERT_TRUE(actual.ok()) << actual.status();
      EXPECT_TRUE(SameTokens(reference_->layer(layer).Fetch(), *actual)) << "layer " << layer;
      if (IsRecurrent(layer)) CheckState(**view, layer, ExpectedState(layer, nullptr));
    }
    CheckAllSnapshots();
  }
  ReleaseEverything(engine());
  snapshots_.clear();
}

}  // namespace kvcache::testing
