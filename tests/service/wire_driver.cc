// The operations of WireDriver (wire_driver.h) on snapshots and history; the
// Update streams are in wire_driver_steps.cc, the batch operations in
// wire_driver_batch.cc, the comparisons in wire_driver_checks.cc.
#include "wire_driver.h"

#include <algorithm>
#include <variant>

#include "absl/strings/str_cat.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;

// Bounds that keep a run's memory and time small: snapshots held at once, and
// how far standard layers grow before the driver trims or recreates the cache.
constexpr size_t kMaxSnapshots = 8;
constexpr uint64_t kStandardOffsetCap = 150;

const char* OpName(int op) {
  static const char* const kNames[] = {
      "Step",    "StreamSteps", "TornStep",   "Fetch",      "FetchWindow", "Trim",
      "Snapshot", "Restore",    "Rewind",     "Merge",      "Split",       "Release",
      "FetchSnapshot", "Recreate", "ExtractRow", "FilterRows", "MergeCaches", "ExtendCache",
      "Speculate"};
  return kNames[op];
}

}  // namespace

WireDriver::WireDriver(Client& client, const WireConfig& config)
    : client_(client), config_(config), rng_(config.seed) {
  for (const engine::LayerSpec& layer : config_.spec.layers) {
    has_standard_layer_ |= std::holds_alternative<engine::StandardKind>(layer.kind) ||
                           std::holds_alternative<engine::QuantizedKind>(layer.kind);
    all_recurrent_ &= engine::IsRecurrent(layer);
  }
  CreateCache();
}

void WireDriver::CreateCache() {
  absl::StatusOr<v1::CacheInfo> info = client_.CreateCache(ToWireSpec(config_.spec));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->cache_id().size(), 32u);
  EXPECT_EQ(info->spec().layers_size(), static_cast<int>(config_.spec.layers.size()));
  EXPECT_EQ(info->layer_offsets_size(), static_cast<int>(config_.spec.layers.size()));
  EXPECT_TRUE(info->in_step());
  cache_id_ = info->cache_id();
  cache_ids_.insert(cache_id_);
  reference_ = std::make_unique<RefCache>(config_.spec);
}

uint64_t WireDriver::Offset() const { return reference_->CommonOffset().value(); }

uint64_t WireDriver::Uniform(uint64_t low, uint64_t high) {
  return std::uniform_int_distribution<uint64_t>(low, high)(rng_);
}

bool WireDriver::Chance(double p) { return std::bernoulli_distribution(p)(rng_); }

// Chunked layers: long enough for one update to overfill the chunk twice.
uint64_t WireDriver::MaxUpdateTokens() const {
  uint64_t longest = LongestUsefulUpdate(config_.spec);
  for (const engine::LayerSpec& layer : config_.spec.layers) {
    if (const auto* chunked = std::get_if<engine::ChunkedKind>(&layer.kind)) {
      longest = std::max<uint64_t>(longest, 2 * chunked->chunk_size + 3);
    }
  }
  return longest;
}

size_t WireDriver::RandomSnapshotIndex() { return Uniform(0, snapshots_.size() - 1); }

void WireDriver::Forget(const std::string& id) {
  std::erase_if(snapshots_, [&](const TrackedSnapshot& s) { return s.id == id; });
}

WireDriver::Op WireDriver::PickOp() {
  // Weights in Op order; a torn step needs two layers; Recreate resets history;
  // batch operations only when configured. Speculation rounds are about 5% of
  // the operations (each is several streams and reads).
  const double torn = reference_->num_layers() > 1 ? 3 : 0;
  const double batch = config_.batch_ops ? 3 : 0;
  const double speculate = config_.batch_ops ? 5.8 : 5.2;
  const std::vector<double> weights = {24, 5, torn, 10, 6, 6, 10, 9, 5, 6, 5, 4, 6, 0.3,
                                       batch, batch, batch, batch, speculate};
  std::discrete_distribution<int> pick(weights.begin(), weights.end());
  return static_cast<Op>(pick(rng_));
}

void WireDriver::Run() {
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

void WireDriver::Step(Op op) {
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
  }
}

void WireDriver::Recreate() {
  const std::string old_id = cache_id_;
  ASSERT_TRUE(client_.DeleteCache(old_id).ok());
  EXPECT_EQ(client_.GetCache(old_id).status().code(), Code::kNotFound);
  EXPECT_EQ(client_.DeleteCache(old_id).code(), Code::kNotFound);
  const StepPart part = RandomPart(reference_->spec(), 0, 1);
  const LayerUpdate update = UpdateOf(reference_->spec(), part);
  EXPECT_EQ(client_.Update(old_id, {&update, 1}).status().code(), Code::kNotFound);
  CreateCache();
  if (!snapshots_.empty()) FetchSnapshot();  // snapshots outlive their cache
}

// Bounds memory: past the cap, trims where every layer allows it, else starts over.
bool WireDriver::KeepStandardLayersSmall(uint64_t tokens) {
  if (!has_standard_layer_ || Offset() + tokens <= kStandardOffsetCap) return false;
  if (!reference_->Trim(0).has_value()) {
    Recreate();
    return true;
  }
  const uint64_t n = Uniform(Offset() / 2, Offset());
  const std::optional<uint64_t> expected = reference_->Trim(n);
  absl::StatusOr<v1::TrimResponse> trimmed = client_.Trim(cache_id_, n);
  EXPECT_TRUE(trimmed.ok()) << trimmed.status();
  if (trimmed.ok()) {
    EXPECT_EQ(trimmed->trimmed(), expected.value());
  }
  // A chunked layer's start can stop the trim short: then start over.
  if (Offset() + tokens > kStandardOffsetCap) Recreate();
  return true;
}

void WireDriver::Trim() {
  const uint64_t offset = Offset();
  const uint64_t n =
      Chance(0.1) ? Uniform(offset, offset + 5) : Uniform(0, std::min<uint64_t>(offset, 12));
  const std::optional<uint64_t> expected = reference_->Trim(n);
  absl::StatusOr<v1::TrimResponse> result = client_.Trim(cache_id_, n);
  if (!expected.has_value()) {
    ASSERT_EQ(result.status().code(), Code::kFailedPrecondition) << result.status();
    ++stats_.refusals;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->trimmed(), *expected);
  const std::vector<uint64_t> offsets(result->cache().layer_offsets().begin(),
                                      result->cache().layer_offsets().end());
  ASSERT_EQ(offsets, reference_->layer_offsets());
}

void WireDriver::TakeSnapshot() {
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
  absl::StatusOr<v1::SnapshotInfo> result = client_.Snapshot(cache_id_, from, pinned);
  if (expected == nullptr) {
    ASSERT_EQ(result.status().code(), Code::kFailedPrecondition) << result.status();
    ++stats_.refusals;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->cache_id(), cache_id_);
  CheckSnapshotInfo(*result, *expected, pinned);
  snapshots_.push_back({result->snapshot_id(), expected, pinned});
}

void WireDriver::Restore() {
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

void WireDriver::Rewind() {
  const uint64_t target = Chance(0.2) ? Offset() : Uniform(0, Offset() + 2);
  CompareRestore("", nullptr, target);
}

void WireDriver::CompareRestore(const std::string& snapshot_id, const RefCacheSnapshot* reference,
                                uint64_t target) {
  SCOPED_TRACE(
      absl::StrCat("restore ", snapshot_id.empty() ? "live" : snapshot_id, " to ", target));
  const bool expected = reference_->Restore(reference, target);
  absl::StatusOr<v1::CacheInfo> result = client_.Restore(cache_id_, snapshot_id, target);
  if (!expected) {
    ASSERT_EQ(result.status().code(), Code::kFailedPrecondition) << result.status();
    ++stats_.restores_refused;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  const std::vector<uint64_t> offsets(result->layer_offsets().begin(),
                                      result->layer_offsets().end());
  ASSERT_EQ(offsets, reference_->layer_offsets());
  ++stats_.restores_ok;
}

void WireDriver::Merge() {
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
  RefCacheSnapshotPtr expected = RefCache::Merge(parent.reference, child.reference);
  absl::StatusOr<v1::SnapshotInfo> result = client_.MergeSnapshots(parent.id, child.id);
  if (expected == nullptr) {
    ASSERT_EQ(result.status().code(), Code::kFailedPrecondition) << result.status();
    ++stats_.refusals;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  CheckSnapshotInfo(*result, *expected, result->pinned());
  Forget(parent.id);
  Forget(child.id);
  snapshots_.push_back({result->snapshot_id(), expected, result->pinned()});
  // Merge consumes its inputs.
  EXPECT_EQ(client_.FetchLayer("", parent.id, 0).status().code(), Code::kNotFound);
  EXPECT_EQ(client_.ReleaseSnapshot(child.id).code(), Code::kNotFound);
  ++stats_.merges_ok;
}

void WireDriver::Split() {
  if (snapshots_.empty()) return;
  if (snapshots_.size() >= kMaxSnapshots) Release();
  const TrackedSnapshot snapshot = snapshots_[RandomSnapshotIndex()];
  const uint64_t from = snapshot.reference->from;
  const uint64_t to = snapshot.reference->to;
  const uint64_t at = (to - from >= 2 && Chance(0.75)) ? Uniform(from + 1, to - 1)
                                                       : Uniform(from > 0 ? from - 1 : 0, to + 1);
  SCOPED_TRACE(absl::StrCat("split [", from, ",", to, ") at ", at));
  auto expected = RefCache::Split(snapshot.reference, at);
  absl::StatusOr<v1::SplitSnapshotResponse> result = client_.SplitSnapshot(snapshot.id, at);
  if (!expected.has_value()) {
    ASSERT_EQ(result.status().code(), Code::kFailedPrecondition) << result.status();
    ++stats_.refusals;
    return;
  }
  ASSERT_TRUE(result.ok()) << result.status();
  CheckSnapshotInfo(result->parent(), *expected->first, result->parent().pinned());
  CheckSnapshotInfo(result->child(), *expected->second, result->child().pinned());
  Forget(snapshot.id);
  snapshots_.push_back(
      {result->parent().snapshot_id(), expected->first, result->parent().pinned()});
  snapshots_.push_back({result->child().snapshot_id(), expected->second, result->child().pinned()});
  EXPECT_EQ(client_.FetchLayer("", snapshot.id, 0).status().code(), Code::kNotFound);
  ++stats_.splits_ok;
}

void WireDriver::Release() {
  if (snapshots_.empty()) return;
  const std::string id = snapshots_[RandomSnapshotIndex()].id;
  ASSERT_TRUE(client_.ReleaseSnapshot(id).ok());
  Forget(id);
  if (Chance(0.1)) {
    EXPECT_EQ(client_.ReleaseSnapshot(id).code(), Code::kNotFound);
  }
}

}  // namespace kvcache::testing
