#include "random_driver.h"

#include <algorithm>
#include <variant>

#include "absl/strings/str_cat.h"
#include "chunked_recurrent_test_util.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "reference_chunked.h"
#include "reference_quantized.h"

namespace kvcache::testing {
namespace {

const char* OpName(int op) {
  static const char* const kNames[] = {"Update", "Fetch",   "Trim",    "Snapshot",
                                       "Restore", "Rewind", "Merge",   "Split",
                                       "Release", "FetchSnapshot", "Recreate",
                                       "ExtractRow", "FilterRows", "MergeCaches", "ExtendCache",
                                       "Speculate", "SnapshotWay"};
  return kNames[op];
}

}  // namespace

RandomDriver::RandomDriver(engine::Engine& engine, const RandomConfig& config)
    : engine_(engine), config_(config), rng_(config.seed) {
  for (const engine::LayerSpec& layer : config_.spec.layers) {
    has_standard_layer_ |= std::holds_alternative<engine::StandardKind>(layer.kind) ||
                           std::holds_alternative<engine::QuantizedKind>(layer.kind);
    all_recurrent_ &= engine::IsRecurrent(layer);
  }
  CreateCache();
}

void RandomDriver::CreateCache() {
  absl::StatusOr<engine::CacheInfo> info = engine_.CreateCache(config_.spec);
  ASSERT_TRUE(info.ok()) << info.status();
  cache_id_ = info->cache_id;
  reference_ = std::make_unique<RefCache>(config_.spec);
}

uint64_t RandomDriver::Offset() const { return reference_->CommonOffset().value(); }

uint64_t RandomDriver::Uniform(uint64_t low, uint64_t high) {
  return std::uniform_int_distribution<uint64_t>(low, high)(rng_);
}

bool RandomDriver::Chance(double p) { return std::bernoulli_distribution(p)(rng_); }

engine::TokenRange RandomDriver::RandomWindow(uint64_t end) {
  const uint64_t begin = Uniform(0, end);
  return {begin, Uniform(begin, end + 1)};
}

// Chunked layers: long enough for one update to overfill the chunk twice.
uint64_t RandomDriver::MaxUpdateTokens() const {
  uint64_t longest = LongestUsefulUpdate(config_.spec);
  for (const engine::LayerSpec& layer : config_.spec.layers) {
    if (const auto* chunked = std::get_if<engine::ChunkedKind>(&layer.kind)) {
      longest = std::max<uint64_t>(longest, 2 * chunked->chunk_size + 3);
    }
  }
  return longest;
}

size_t RandomDriver::RandomSnapshotIndex() { return Uniform(0, snapshots_.size() - 1); }

void RandomDriver::Forget(const std::string& id) {
  std::erase_if(snapshots_, [&](const TrackedSnapshot& s) { return s.id == id; });
}

RandomDriver::Op RandomDriver::PickOp() {
  // Weights in Op order; Recreate is rare because it resets the history.
  // Speculation rounds (either way) last, several updates and fetches each.
  static const std::vector<double> kWeights = {30, 14, 7, 12, 10, 6, 7, 6, 4, 6, 0.3,
                                               0, 0, 0, 0, 4, 3};
  // Batch operations (extract, filter, merge, extend) when configured.
  static const std::vector<double> kBatchWeights = {30, 14, 7, 12, 10, 6, 7, 6, 4, 6, 0.3,
                                                    3, 4, 3, 4, 4, 3};
  const std::vector<double>& weights = config_.batch_ops ? kBatchWeights : kWeights;
  std::discrete_distribution<int> pick(weights.begin(), weights.end());
  return static_cast<Op>(pick(rng_));
}

void RandomDriver::Run() {
  for (uint64_t i = 0; i < config_.operations; ++i) {
    const Op op = PickOp();
    SCOPED_TRACE(absl::StrCat(config_.name, " seed=", config_.seed, " op#", i, " ",
                              OpName(static_cast<int>(op)), " at offset ", Offset()));
    Step(op);
    if (!::testing::Test::HasFailure()) CheckOffsets();
    if (::testing::Test::HasFailure()) return;
    ++stats_.operations;
  }
}

void RandomDriver::Step(Op op) {
  switch (op) {
    case Op::kUpdate: return Update();
    case Op::kFetch: return Fetch();
    case Op::kTrim: return Trim();
    case Op::kSnapshot: return TakeSnapshot();
    case Op::kRestore: return Restore();
    case Op::kRewind: return Rewind();
    case Op::kMerge: return Merge();
    case Op::kSplit: return Split();
    case Op::kRelease: return Release();
    case Op::kFetchSnapshot: return FetchSnapshot();
    case Op::kRecreate: return Recreate();
    case Op::kExtractRow: return ExtractRow();
    case Op::kFilterRows: return FilterRows();
    case Op::kMergeCaches: return MergeCaches();
    case Op::kExtendCache: return ExtendCache();
    case Op::kSpeculate: return Speculate();
    case Op::kSnapshotWay: return SpeculateBySnapshots();
  }
}

void RandomDriver::Recreate() {
  const std::string old_id = cache_id_;
  ASSERT_TRUE(engine_.DeleteCache(old_id).ok());
  EXPECT_EQ(engine_.GetCache(old_id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_.DeleteCache(old_id).code(), absl::StatusCode::kNotFound);
  CreateCache();
  // Snapshots outlive their cache: still listed, still readable.
  EXPECT_EQ(engine_.ListSnapshots().size(), snapshots_.size());
  if (!snapshots_.empty()) FetchSnapshot();
}

// Bounds memory: shrinks by trimming where every layer allows it, else (or
// when a chunked layer's start stopped the trim short) starts over.
void RandomDriver::ShrinkOrRecreate(uint64_t tokens) {
  if (reference_->Trim(0).has_value()) {
    const uint64_t n = Uniform(Offset() / 2, Offset());
    const std::optional<uint64_t> expected = reference_->Trim(n);
    absl::StatusOr<uint64_t> trimmed = engine_.Trim(cache_id_, n);
    ASSERT_TRUE(trimmed.ok()) << trimmed.status();
    ASSERT_EQ(*trimmed, expected.value());
    if (Offset() + tokens <= kStandardOffsetCap) return;
  }
  Recreate();
}

void RandomDriver::Update() {
  // A cache of recurrent layers only may step by 0 tokens (a state that
  // consumed none); attention layers need at least one.
  const uint64_t tokens = all_recurrent_ ? Uniform(0, 4)
                          : Chance(0.45) ? 1
                                         : Uniform(2, MaxUpdateTokens());
  if (has_standard_layer_ && Offset() + tokens > kStandardOffsetCap) {
    return ShrinkOrRecreate(tokens);
  }
  for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
    if (IsRecurrentLayer(layer)) {
      UpdateStateLayer(layer, tokens);
    } else {
      UpdateLayer(layer, tokens);
    }
    if (::testing::Test::HasFailure()) return;
    if (layer == 0 && tokens > 0 && reference_->num_layers() > 1 && Chance(0.05)) {
      // Mid-step the layers are out of step: whole-cache operations are refused.
      absl::StatusOr<engine::CacheInfo> info = engine_.GetCache(cache_id_);
      ASSERT_TRUE(info.ok());
      EXPECT_FALSE(info->in_step);
      EXPECT_EQ(engine_.Snapshot(cache_id_, 0).status().code(),
                absl::StatusCode::kFailedPrecondition);
      EXPECT_EQ(engine_.Trim(cache_id_, 0).status().code(), absl::StatusCode::kFailedPrecondition);
    }
  }
  ++stats_.updates;
}

void RandomDriver::UpdateLayer(uint32_t layer, uint64_t tokens) {
  const KvTensors kv = RandomLayerKv(reference_->spec(), layer, tokens, rng_);
  const uint64_t before = reference_->layer(layer).offset();
  if (Chance(0.03)) {
    const uint64_t wrong = before > 0 && Chance(0.5) ? before - 1 : before + 1;
    EXPECT_EQ(engine_.Update(cache_id_, layer, kv.input(), wrong).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  if (Chance(0.02)) {  // a recurrent state for an attention layer
    const RefState state{.conv = kv.keys, .delta = kv.values};
    EXPECT_EQ(engine_.UpdateState(cache_id_, layer, StateInputOf(state, tokens)).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  std::optional<uint64_t> expected_offset;
  if (Chance(0.2)) expected_offset = before;
  absl::StatusOr<uint64_t> result = engine_.Update(cache_id_, layer, kv.input(), expected_offset);
  ASSERT_TRUE(result.ok()) << result.status();
  reference_->Update(layer, TokensFromTensors(ShapeOf(reference_->spec(), layer), kv.keys,
                                              kv.values, tokens));
  ASSERT_EQ(*result, reference_->layer(layer).offset());
}

void RandomDriver::Fetch() {
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view = engine_.View(cache_id_, "");
  ASSERT_TRUE(view.ok()) << view.status();
  if (IsRecurrentLayer(layer)) {
    CheckState(**view, layer, LiveState(layer));
    ++stats_.fetches;
    return;
  }
  const std::vector<RefToken> expected = reference_->layer(layer).Fetch();
  CheckReferenceShape(layer, expected);
  CheckLayer(**view, layer, expected);
  ++stats_.fetches;
}

void RandomDriver::CheckLayer(const engine::CacheSnapshot& view, uint32_t layer,
                              const std::vector<RefToken>& all) {
  const uint64_t end = all.empty() ? 0 : all.back().position + 1;
  const engine::TokenRange window = Chance(0.4) ? kEverything : RandomWindow(end + 2);
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

void RandomDriver::Trim() {
  const uint64_t offset = Offset();
  const uint64_t n = Chance(0.1) ? Uniform(offset, offset + 5) : Uniform(0, std::min<uint64_t>(offset, 12));
  const std::optional<uint64_t> expected = reference_->Trim(n);
  absl::StatusOr<uint64_t> result = engine_.Trim(cache_id_, n);
  if (!expected.has_value()) {
    ASSERT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition) << result.status();
    ++stats_.refusals;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(*result, *expected);
}

void RandomDriver::TakeSnapshot() {
  if (snapshots_.size() >= kMaxSnapshots) Release();
  const uint64_t offset = Offset();
  uint64_t from;
  if (Chance(0.1)) {
    from = offset + Uniform(0, 2);  // refused: nothing to snapshot
  } else if (!snapshots_.empty() && Chance(0.3)) {
    from = snapshots_[RandomSnapshotIndex()].reference->to;  // makes adjacent pairs to merge
  } else {
    from = offset == 0 ? 0 : Uniform(0, offset - 1);
  }
  const bool pinned = Chance(0.3);
  RefCacheSnapshotPtr expected = reference_->Snapshot(from);
  absl::StatusOr<engine::SnapshotInfo> result = engine_.Snapshot(cache_id_, from, pinned);
  if (expected == nullptr) {
    ASSERT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition) << result.status();
    ++stats_.refusals;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->cache_id, cache_id_);
  EXPECT_EQ(result->pinned, pinned);
  CheckSnapshotInfo(*result, *expected);
  snapshots_.push_back({result->snapshot_id, expected});
}

void RandomDriver::CheckSnapshotInfo(const engine::SnapshotInfo& info,
                                     const RefCacheSnapshot& reference) {
  EXPECT_EQ(info.from_offset, reference.from) << info.snapshot_id;
  EXPECT_EQ(info.to_offset, reference.to) << info.snapshot_id;
  EXPECT_EQ(info.snapshot_id.size(), 32u);
}

void RandomDriver::Restore() {
  if (snapshots_.empty()) return Rewind();
  const TrackedSnapshot& snapshot = snapshots_[RandomSnapshotIndex()];
  const uint64_t to = snapshot.reference->to;
  uint64_t target;
  const uint64_t pick = Uniform(0, 99);
  if (pick < 45) {
    target = to;
  } else if (pick < 80) {
    target = Uniform(0, to);
  } else if (pick < 90) {
    target = to + Uniform(1, 3);  // beyond the snapshot: refused
  } else {
    target = Uniform(0, Offset() + 2);
  }
  const std::string id = snapshot.id;
  CompareRestore(id, snapshot.reference.get(), target);
}

void RandomDriver::Rewind() {
  const uint64_t target = Chance(0.2) ? Offset() : Uniform(0, Offset() + 2);
  CompareRestore("", nullptr, target);
}

void RandomDriver::CompareRestore(const std::string& snapshot_id,
                                  const RefCacheSnapshot* reference, uint64_t target) {
  SCOPED_TRACE(absl::StrCat("restore ", snapshot_id.empty() ? "live" : snapshot_id, " to ",
                            target));
  const bool expected = reference_->Restore(reference, target);
  absl::StatusOr<engine::CacheInfo> result = engine_.Restore(cache_id_, snapshot_id, target);
  if (!expected) {
    ASSERT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition) << result.status();
    ++stats_.restores_refused;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->layer_offsets, reference_->layer_offsets());
  ++stats_.restores_ok;
}

void RandomDriver::Merge() {
  if (snapshots_.empty()) return;
  std::vector<std::pair<size_t, size_t>> adjacent;
  for (size_t p = 0; p < snapshots_.size(); ++p) {
    for (size_t c = 0; c < snapshots_.size(); ++c) {
      if (p != c && snapshots_[p].reference->to == snapshots_[c].reference->from) {
        adjacent.emplace_back(p, c);
      }
    }
  }
  std::pair<size_t, size_t> pair{RandomSnapshotIndex(), RandomSnapshotIndex()};
  if (!adjacent.empty() && Chance(0.6)) pair = adjacent[Uniform(0, adjacent.size() - 1)];
  const TrackedSnapshot parent = snapshots_[pair.first];
  const TrackedSnapshot child = snapshots_[pair.second];
  SCOPED_TRACE(absl::StrCat("merge [", parent.reference->from, ",", parent.reference->to, ") + [",
                            child.reference->from, ",", child.reference->to, ")"));
  RefCacheSnapshotPtr expected = RefCache::Merge(parent.reference, child.reference);
  absl::StatusOr<engine::SnapshotInfo> result = engine_.MergeSnapshots(parent.id, child.id);
  if (expected == nullptr) {
    ASSERT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition) << result.status();
    ++stats_.refusals;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  CheckSnapshotInfo(*result, *expected);
  Forget(parent.id);
  Forget(child.id);
  snapshots_.push_back({result->snapshot_id, expected});
  // Merge consumes its inputs.
  EXPECT_EQ(engine_.View("", parent.id).status().code(), absl::StatusCode::kNotFound);
  ++stats_.merges_ok;
}

void RandomDriver::Split() {
  if (snapshots_.empty()) return;
  if (snapshots_.size() >= kMaxSnapshots) Release();
  const TrackedSnapshot snapshot = snapshots_[RandomSnapshotIndex()];
  const uint64_t from = snapshot.reference->from;
  const uint64_t to = snapshot.reference->to;
  const uint64_t at = (to - from >= 2 && Chance(0.75)) ? Uniform(from + 1, to - 1)
                                                      : Uniform(from > 0 ? from - 1 : 0, to + 1);
  SCOPED_TRACE(absl::StrCat("split [", from, ",", to, ") at ", at));
  auto expected = RefCache::Split(snapshot.reference, at);
  auto result = engine_.SplitSnapshot(snapshot.id, at);
  if (!expected.has_value()) {
    ASSERT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition) << result.status();
    ++stats_.refusals;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  CheckSnapshotInfo(result->first, *expected->first);
  CheckSnapshotInfo(result->second, *expected->second);
  Forget(snapshot.id);
  snapshots_.push_back({result->first.snapshot_id, expected->first});
  snapshots_.push_back({result->second.snapshot_id, expected->second});
  EXPECT_EQ(engine_.View("", snapshot.id).status().code(), absl::StatusCode::kNotFound);
  ++stats_.splits_ok;
}

void RandomDriver::Release() {
  if (snapshots_.empty()) return;
  const std::string id = snapshots_[RandomSnapshotIndex()].id;
  ASSERT_TRUE(engine_.ReleaseSnapshot(id).ok());
  Forget(id);
  if (Chance(0.1)) {
    EXPECT_EQ(engine_.ReleaseSnapshot(id).code(), absl::StatusCode::kNotFound);
  }
}

void RandomDriver::FetchSnapshot() {
  if (snapshots_.empty()) return;
  const TrackedSnapshot& snapshot = snapshots_[RandomSnapshotIndex()];
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  SCOPED_TRACE(absl::StrCat("snapshot [", snapshot.reference->from, ",", snapshot.reference->to,
                            ")"));
  auto view = engine_.View(cache_id_, snapshot.id);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ((*view)->from, snapshot.reference->from);
  EXPECT_EQ((*view)->to, snapshot.reference->to);
  if (IsRecurrentLayer(layer)) {
    CheckState(**view, layer, SnapshotState(*snapshot.reference, layer));
  } else {
    CheckLayer(**view, layer, RefCache::FetchSnapshot(*snapshot.reference, layer));
  }
  ++stats_.fetches;
}

void RandomDriver::CheckOffsets() {
  absl::StatusOr<engine::CacheInfo> info = engine_.GetCache(cache_id_);
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->layer_offsets, reference_->layer_offsets());
  ASSERT_TRUE(info->in_step);
  ASSERT_EQ(info->offset, Offset());
}

void RandomDriver::CheckAllSnapshots() {
  ASSERT_EQ(engine_.ListSnapshots().size(), snapshots_.size());
  for (const TrackedSnapshot& snapshot : snapshots_) {
    auto view = engine_.View("", snapshot.id);
    ASSERT_TRUE(view.ok()) << view.status();
    for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
      auto actual = FetchStoredLayer(**view, layer, kEverything);
      ASSERT_TRUE(actual.ok()) << actual.status();
      ASSERT_TRUE(SameTokens(RefCache::FetchSnapshot(*snapshot.reference, layer), *actual))
          << "snapshot " << snapshot.id << " layer " << layer;
      if (IsRecurrentLayer(layer)) {
        CheckState(**view, layer, SnapshotState(*snapshot.reference, layer));
      }
    }
  }
}

void RandomDriver::Finish() {
  SCOPED_TRACE(absl::StrCat(config_.name, " seed=", config_.seed, " final check"));
  if (!::testing::Test::HasFailure()) {
    auto view = engine_.View(cache_id_, "");
    ASSERT_TRUE(view.ok()) << view.status();
    for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
      auto actual = FetchStoredLayer(**view, layer, kEverything);
      ASSERT_TRUE(actual.ok()) << actual.status();
      EXPECT_TRUE(SameTokens(reference_->layer(layer).Fetch(), *actual)) << "layer " << layer;
      if (IsRecurrentLayer(layer)) CheckState(**view, layer, LiveState(layer));
    }
    CheckAllSnapshots();
  }
  ReleaseEverything(engine_);
  snapshots_.clear();
}

}  // namespace kvcache::testing
