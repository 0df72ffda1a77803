// DriverCore (driver_core.h): the operation choice, and the operations on
// snapshots and history. The update streams are in driver_core_steps.cc, the
// batch operations in driver_core_batch.cc, the snapshot way and the page
// check in driver_core_pages.cc.
#include "driver_core.h"

#include <algorithm>
#include <tuple>
#include <variant>

#include "absl/strings/str_cat.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"

namespace kvcache::testing {
namespace {

using Code = absl::StatusCode;

const char* OpName(int op) {
  static const char* const kNames[] = {
      "Step",   "StreamSteps", "TornStep",      "Fetch",    "FetchWindow", "Trim",
      "Snapshot", "Restore",   "Rewind",        "Merge",    "Split",       "Release",
      "FetchSnapshot", "Recreate", "ExtractRow", "FilterRows", "MergeCaches", "ExtendCache",
      "Speculate", "SnapshotWay"};
  return kNames[op];
}

}  // namespace

DriverCore::DriverCore(DriverAdapter& adapter, const DriverConfig& config)
    : adapter_(adapter), config_(config), rng_(config.seed) {
  for (const engine::LayerSpec& layer : config_.spec.layers) {
    has_standard_layer_ |= std::holds_alternative<engine::StandardKind>(layer.kind) ||
                           std::holds_alternative<engine::QuantizedKind>(layer.kind);
    all_recurrent_ &= engine::IsRecurrent(layer);
  }
}

bool IsServerId(const std::string& id) {
  const std::string digits = id.substr(id.rfind(':') + 1);  // npos + 1: the whole id
  return digits.size() == 32 && digits.find_first_not_of("0123456789abcdef") == std::string::npos;
}

void DriverCore::Start() { CreateCache(); }

void DriverCore::CreateCache() {
  absl::StatusOr<CacheState> info = adapter_.CreateCache(config_.spec);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(IsServerId(info->cache_id)) << info->cache_id;
  EXPECT_EQ(info->num_layers, config_.spec.layers.size());
  EXPECT_EQ(info->layer_offsets.size(), config_.spec.layers.size());
  EXPECT_TRUE(info->in_step);
  cache_id_ = info->cache_id;
  cache_ids_.insert(cache_id_);
  reference_ = std::make_unique<RefCache>(config_.spec);
}

bool DriverCore::IsRecurrent(uint32_t layer) const {
  return engine::IsRecurrent(config_.spec.layers[layer]);
}

uint64_t DriverCore::Offset() const { return reference_->CommonOffset().value(); }

uint64_t DriverCore::Uniform(uint64_t low, uint64_t high) {
  return std::uniform_int_distribution<uint64_t>(low, high)(rng_);
}

bool DriverCore::Chance(double p) { return std::bernoulli_distribution(p)(rng_); }

// Chunked layers: long enough for one update to overfill the chunk twice.
uint64_t DriverCore::MaxUpdateTokens() const {
  uint64_t longest = LongestUsefulUpdate(config_.spec);
  for (const engine::LayerSpec& layer : config_.spec.layers) {
    if (const auto* chunked = std::get_if<engine::ChunkedKind>(&layer.kind)) {
      longest = std::max<uint64_t>(longest, 2 * chunked->chunk_size + 3);
    }
  }
  return longest;
}

size_t DriverCore::RandomSnapshotIndex() { return Uniform(0, snapshots_.size() - 1); }

void DriverCore::Forget(const std::string& id) {
  std::erase_if(snapshots_, [&](const TrackedSnapshot& s) { return s.id == id; });
}

std::vector<RefToken> DriverCore::Expected(uint32_t layer, const RefCacheSnapshot* snapshot) const {
  if (snapshot != nullptr) return RefCache::FetchSnapshot(*snapshot, layer);
  return reference_->layer(layer).Fetch();
}

std::optional<RefState> DriverCore::ExpectedState(uint32_t layer,
                                                  const RefCacheSnapshot* snapshot) const {
  if (!IsRecurrent(layer)) return std::nullopt;
  if (snapshot == nullptr) {
    // A live layer reads as zeros before its first update.
    return reference_->layer(layer).FetchState().value_or(ZeroState(reference_->spec(), layer));
  }
  const RefLayerSnapshotPtr& part = snapshot->layers[layer];
  return part == nullptr ? std::nullopt : part->state;
}

DriverCore::Op DriverCore::PickOp() {
  // Weights in Op order; a torn step needs two layers; Recreate resets history;
  // batch operations only when configured. Speculation rounds (either way)
  // last several updates and reads each.
  const double torn = reference_->num_layers() > 1 ? 3 : 0;
  const double batch = config_.batch_ops ? 3 : 0;
  const double speculate = config_.batch_ops ? 5.8 : 5.2;
  const std::vector<double> weights = {24, 5, torn, 10, 6, 6, 10, 9, 5, 6, 5, 4, 6, 0.3,
                                       batch, batch, batch, batch, speculate, 3};
  std::discrete_distribution<int> pick(weights.begin(), weights.end());
  return static_cast<Op>(pick(rng_));
}

void DriverCore::Run() {
  for (uint64_t i = 0; i < config_.operations; ++i) {
    if (i % 50 == 0) CheckSnapshotList();
    const Op op = PickOp();
    SCOPED_TRACE(absl::StrCat(config_.name, " seed=", config_.seed, " op#", i, " ",
                              OpName(static_cast<int>(op)), " at offset ", Offset()));
    Step(op);
    if (!::testing::Test::HasFailure()) CheckOffsets();
    if (::testing::Test::HasFailure()) return;
    ++stats_.operations;
  }
}

void DriverCore::Step(Op op) {
  switch (op) {
    case Op::kStep: return UpdateStep();
    case Op::kStreamSteps: return StreamSteps();
    case Op::kTornStep: return TornStep();
    case Op::kFetch: return FetchLive();
    case Op::kFetchWindow: return FetchWindow();
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

void DriverCore::Recreate() {
  const std::string old_id = cache_id_;
  ASSERT_TRUE(adapter_.DeleteCache(old_id).ok());
  EXPECT_EQ(adapter_.GetCache(old_id).status().code(), Code::kNotFound);
  EXPECT_EQ(adapter_.DeleteCache(old_id).code(), Code::kNotFound);
  const std::deque<StepPart> parts = {RandomPart(reference_->spec(), 0, 1)};
  EXPECT_EQ(adapter_.SendUpdates(old_id, reference_->spec(), parts, true).status.code(),
            Code::kNotFound);
  CreateCache();
  if (::testing::Test::HasFailure()) return;
  // Snapshots outlive their cache: still listed, still readable.
  CheckSnapshotList();
  if (!snapshots_.empty()) FetchSnapshot();
}

bool DriverCore::KeepStandardLayersSmall(uint64_t tokens) {
  if (!has_standard_layer_ || Offset() + tokens <= kStandardOffsetCap) return false;
  if (!reference_->Trim(0).has_value()) {
    Recreate();
    return true;
  }
  const uint64_t n = Uniform(Offset() / 2, Offset());
  const std::optional<uint64_t> expected = reference_->Trim(n);
  absl::StatusOr<TrimResult> trimmed = adapter_.Trim(cache_id_, n);
  EXPECT_TRUE(trimmed.ok()) << trimmed.status();
  if (trimmed.ok()) {
    EXPECT_EQ(trimmed->trimmed, expected.value());
  }
  if (Offset() + tokens > kStandardOffsetCap) Recreate();
  return true;
}

void DriverCore::Trim() {
  const uint64_t offset = Offset();
  const uint64_t n =
      Chance(0.1) ? Uniform(offset, offset + 5) : Uniform(0, std::min<uint64_t>(offset, 12));
  const std::optional<uint64_t> expected = reference_->Trim(n);
  absl::StatusOr<TrimResult> result = adapter_.Trim(cache_id_, n);
  if (!expected.has_value()) {
    ASSERT_EQ(result.status().code(), Code::kFailedPrecondition) << result.status();
    ++stats_.refusals;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->trimmed, *expected);
  // The engine's Trim answers the count alone; CheckOffsets after every
  // operation reads the offsets back there.
  if (result->layer_offsets.has_value()) {
    ASSERT_EQ(*result->layer_offsets, reference_->layer_offsets());
  }
}

void DriverCore::TakeSnapshot() {
  if (snapshots_.size() >= kMaxSnapshots) Release();
  const uint64_t offset = Offset();
  uint64_t from;
  if (Chance(0.1)) {
    from = offset + Uniform(0, 2);  // refused: nothing to snapshot
  } else if (!snapshots_.empty() && Chance(0.3)) {
    from = snapshots_[RandomSnapshotIndex()].reference->to;  // adjacent pairs to merge
  } else {
    from = offset == 0 ? 0 : Uniform(0, offset - 1);
  }
  const bool pinned = Chance(0.3);
  RefCacheSnapshotPtr expected = reference_->Snapshot(from);
  absl::StatusOr<SnapshotState> result = adapter_.Snapshot(cache_id_, from, pinned);
  if (expected == nullptr) {
    ASSERT_EQ(result.status().code(), Code::kFailedPrecondition) << result.status();
    ++stats_.refusals;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->cache_id, cache_id_);
  CheckSnapshotInfo(*result, *expected, pinned);
  snapshots_.push_back({result->snapshot_id, expected, pinned});
}

void DriverCore::Restore() {
  if (snapshots_.empty()) return Rewind();
  const TrackedSnapshot snapshot = snapshots_[RandomSnapshotIndex()];
  const uint64_t to = snapshot.reference->to;
  const uint64_t pick = Uniform(0, 99);
  uint64_t target;
  if (pick < 45) {
    target = to;
  } else if (pick < 80) {
    target = Uniform(0, to);
  } else if (pick < 90) {
    target = to + Uniform(1, 3);  // beyond the snapshot: refused
  } else {
    target = Uniform(0, Offset() + 2);
  }
  CompareRestore(snapshot.id, snapshot.reference.get(), target);
}

void DriverCore::Rewind() {
  const uint64_t target = Chance(0.2) ? Offset() : Uniform(0, Offset() + 2);
  CompareRestore("", nullptr, target);
}

void DriverCore::CompareRestore(const std::string& snapshot_id, const RefCacheSnapshot* reference,
                                uint64_t target) {
  SCOPED_TRACE(
      absl::StrCat("restore ", snapshot_id.empty() ? "live" : snapshot_id, " to ", target));
  const bool expected = reference_->Restore(reference, target);
  absl::StatusOr<CacheState> result = adapter_.Restore(cache_id_, snapshot_id, target);
  if (!expected) {
    ASSERT_EQ(result.status().code(), Code::kFailedPrecondition) << result.status();
    ++stats_.restores_refused;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->layer_offsets, reference_->layer_offsets());
  ++stats_.restores_ok;
}

void DriverCore::Merge() {
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
  absl::StatusOr<SnapshotState> result = adapter_.MergeSnapshots(parent.id, child.id);
  if (expected == nullptr) {
    ASSERT_EQ(result.status().code(), Code::kFailedPrecondition) << result.status();
    ++stats_.refusals;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  CheckSnapshotInfo(*result, *expected, result->pinned);
  Forget(parent.id);
  Forget(child.id);
  snapshots_.push_back({result->snapshot_id, expected, result->pinned});
  // Merge consumes its inputs.
  EXPECT_EQ(adapter_.ReadSnapshot(parent.id).code(), Code::kNotFound);
  EXPECT_EQ(adapter_.ReleaseSnapshot(child.id).code(), Code::kNotFound);
  ++stats_.merges_ok;
}

void DriverCore::Split() {
  if (snapshots_.empty()) return;
  if (snapshots_.size() >= kMaxSnapshots) Release();
  const TrackedSnapshot snapshot = snapshots_[RandomSnapshotIndex()];
  const uint64_t from = snapshot.reference->from;
  const uint64_t to = snapshot.reference->to;
  const uint64_t at = (to - from >= 2 && Chance(0.75)) ? Uniform(from + 1, to - 1)
                                                       : Uniform(from > 0 ? from - 1 : 0, to + 1);
  SCOPED_TRACE(absl::StrCat("split [", from, ",", to, ") at ", at));
  auto expected = RefCache::Split(snapshot.reference, at);
  absl::StatusOr<std::pair<SnapshotState, SnapshotState>> result =
      adapter_.SplitSnapshot(snapshot.id, at);
  if (!expected.has_value()) {
    ASSERT_EQ(result.status().code(), Code::kFailedPrecondition) << result.status();
    ++stats_.refusals;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  const auto& [parent, child] = *result;
  CheckSnapshotInfo(parent, *expected->first, parent.pinned);
  CheckSnapshotInfo(child, *expected->second, child.pinned);
  Forget(snapshot.id);
  snapshots_.push_back({parent.snapshot_id, expected->first, parent.pinned});
  snapshots_.push_back({child.snapshot_id, expected->second, child.pinned});
  EXPECT_EQ(adapter_.ReadSnapshot(snapshot.id).code(), Code::kNotFound);
  ++stats_.splits_ok;
}

void DriverCore::Release() {
  if (snapshots_.empty()) return;
  const std::string id = snapshots_[RandomSnapshotIndex()].id;
  ASSERT_TRUE(adapter_.ReleaseSnapshot(id).ok());
  Forget(id);
  if (Chance(0.1)) {
    EXPECT_EQ(adapter_.ReleaseSnapshot(id).code(), Code::kNotFound);
  }
}

void DriverCore::CheckSnapshotInfo(const SnapshotState& info, const RefCacheSnapshot& reference,
                                   bool pinned) {
  EXPECT_EQ(info.from, reference.from) << info.snapshot_id;
  EXPECT_EQ(info.to, reference.to) << info.snapshot_id;
  EXPECT_EQ(info.pinned, pinned) << info.snapshot_id;
  EXPECT_TRUE(IsServerId(info.snapshot_id)) << info.snapshot_id;
  EXPECT_TRUE(cache_ids_.contains(info.cache_id)) << info.cache_id;
}

void DriverCore::CheckOffsets() {
  absl::StatusOr<CacheState> info = adapter_.GetCache(cache_id_);
  ASSERT_TRUE(info.ok()) << info.status();
  const std::vector<uint64_t> expected = reference_->layer_offsets();
  ASSERT_EQ(info->layer_offsets, expected);
  ASSERT_EQ(info->in_step, reference_->CommonOffset().has_value());
  ASSERT_EQ(info->offset, *std::min_element(expected.begin(), expected.end()));
}

// Other drivers' snapshots are told apart by cache id; filtered by cache,
// only those of the current cache are listed.
void DriverCore::CheckSnapshotList() {
  using Entry = std::tuple<std::string, uint64_t, uint64_t>;
  std::vector<Entry> expected;
  for (const TrackedSnapshot& s : snapshots_) {
    expected.emplace_back(s.id, s.reference->from, s.reference->to);
  }
  absl::StatusOr<std::vector<SnapshotState>> all = adapter_.ListSnapshots("");
  ASSERT_TRUE(all.ok()) << all.status();
  std::vector<Entry> listed;
  for (const SnapshotState& info : *all) {
    if (!cache_ids_.contains(info.cache_id)) continue;
    listed.emplace_back(info.snapshot_id, info.from, info.to);
  }
  if (!config_.shares_server) {
    EXPECT_EQ(all->size(), listed.size()) << "snapshots of caches this driver never made";
  }
  std::sort(expected.begin(), expected.end());
  std::sort(listed.begin(), listed.end());
  ASSERT_EQ(listed, expected);
  absl::StatusOr<std::vector<SnapshotState>> mine = adapter_.ListSnapshots(cache_id_);
  ASSERT_TRUE(mine.ok()) << mine.status();
  for (const SnapshotState& info : *mine) EXPECT_EQ(info.cache_id, cache_id_);
}

}  // namespace kvcache::testing
