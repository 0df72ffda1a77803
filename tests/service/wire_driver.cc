// The operations of WireDriver (wire_driver.h); the comparisons that follow
// them are in wire_driver_checks.cc.
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
      "Step",    "StreamSteps", "TornStep", "Fetch", "FetchWindow", "Trim",          "Snapshot",
      "Restore", "Rewind",      "Merge",    "Split", "Release",     "FetchSnapshot", "Recreate"};
  return kNames[op];
}

}  // namespace

WireDriver::WireDriver(Client& client, const WireConfig& config)
    : client_(client), config_(config), rng_(config.seed) {
  for (const engine::LayerSpec& layer : config_.spec.layers) {
    has_standard_layer_ |= std::holds_alternative<engine::StandardKind>(layer.kind);
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

uint64_t WireDriver::MaxUpdateTokens() const { return LongestUsefulUpdate(config_.spec); }

size_t WireDriver::RandomSnapshotIndex() { return Uniform(0, snapshots_.size() - 1); }

void WireDriver::Forget(const std::string& id) {
  std::erase_if(snapshots_, [&](const TrackedSnapshot& s) { return s.id == id; });
}

WireDriver::Op WireDriver::PickOp() {
  // Weights in Op order; a torn step needs two layers; Recreate resets history.
  const double torn = reference_->num_layers() > 1 ? 3 : 0;
  const std::vector<double> weights = {24, 5, torn, 10, 6, 6, 10, 9, 5, 6, 5, 4, 6, 0.3};
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
  }
}

void WireDriver::Recreate() {
  const std::string old_id = cache_id_;
  ASSERT_TRUE(client_.DeleteCache(old_id).ok());
  EXPECT_EQ(client_.GetCache(old_id).status().code(), Code::kNotFound);
  EXPECT_EQ(client_.DeleteCache(old_id).code(), Code::kNotFound);
  const KvTensors kv = RandomKv(config_.spec, 0, 1, rng_);
  const LayerUpdate update = MakeLayerUpdate(config_.spec, 0, kv);
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
  return true;
}

void WireDriver::ApplyToReference(uint32_t layer, const KvTensors& kv) {
  reference_->Update(
      layer, TokensFromTensors(ShapeOf(config_.spec, layer), kv.keys, kv.values, kv.tokens));
}

void WireDriver::SendStream(const std::vector<LayerUpdate>& updates,
                            const std::vector<KvTensors>& data, size_t applied) {
  absl::Status status;
  std::vector<v1::UpdateResponse> acks;
  if (applied == updates.size() && Chance(0.5)) {
    absl::StatusOr<std::vector<v1::UpdateResponse>> result = client_.Update(cache_id_, updates);
    status = result.status();
    if (result.ok()) acks = *std::move(result);
  } else {
    std::unique_ptr<UpdateStream> stream = client_.OpenUpdate(cache_id_);
    for (const LayerUpdate& update : updates) {
      if (!stream->Write(update)) break;  // the server has ended the stream
    }
    status = stream->Finish().status();
    acks = stream->acknowledged();
  }
  if (applied < updates.size()) {
    ASSERT_EQ(status.code(), Code::kFailedPrecondition) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("expected_offset"));
    ++stats_.failed_streams;
  } else {
    ASSERT_TRUE(status.ok()) << status;
  }
  ASSERT_EQ(acks.size(), applied) << "acknowledgements of a stream of " << updates.size();
  for (size_t i = 0; i < applied; ++i) {
    ApplyToReference(updates[i].layer, data[i]);
    ASSERT_EQ(acks[i].layer(), updates[i].layer) << "ack " << i;
    ASSERT_EQ(acks[i].offset(), reference_->layer(updates[i].layer).offset()) << "ack " << i;
  }
}

// One step of every layer in one stream. Sometimes with expected_offset set
// right; sometimes one layer's is wrong, which ends the stream there: the
// layers before it stay applied (the cache is then out of step).
void WireDriver::UpdateStep() {
  const uint64_t tokens = Chance(0.45) ? 1 : Uniform(2, MaxUpdateTokens());
  if (KeepStandardLayersSmall(tokens)) return;
  const uint32_t layers = reference_->num_layers();
  std::vector<KvTensors> data;
  for (uint32_t l = 0; l < layers; ++l) data.push_back(RandomKv(config_.spec, l, tokens, rng_));
  std::vector<LayerUpdate> updates;
  for (uint32_t l = 0; l < layers; ++l) {
    updates.push_back(MakeLayerUpdate(config_.spec, l, data[l]));
    if (Chance(0.25)) updates.back().expected_offset = reference_->layer(l).offset();
  }
  size_t applied = layers;
  if (Chance(0.06)) {
    applied = Uniform(0, layers - 1);
    const uint64_t before = reference_->layer(applied).offset();
    updates[applied].expected_offset = before > 0 && Chance(0.5) ? before - 1 : before + 1;
  }
  SendStream(updates, data, applied);
  ++stats_.steps;
  if (!::testing::Test::HasFailure() && !reference_->CommonOffset().has_value()) {
    ++stats_.torn_steps;
    ProbeOutOfStep();
    Repair();
  }
}

// Several single-token decode steps pipelined through one stream.
void WireDriver::StreamSteps() {
  const uint64_t steps = Uniform(2, 4);
  if (KeepStandardLayersSmall(steps)) return;
  std::vector<KvTensors> data;
  for (uint64_t s = 0; s < steps; ++s) {
    for (uint32_t l = 0; l < reference_->num_layers(); ++l) {
      data.push_back(RandomKv(config_.spec, l, 1, rng_));
    }
  }
  std::vector<LayerUpdate> updates;
  for (size_t i = 0; i < data.size(); ++i) {
    updates.push_back(MakeLayerUpdate(config_.spec, i % reference_->num_layers(), data[i]));
  }
  SendStream(updates, data, updates.size());
  stats_.steps += steps;
}

// A worker that updates one layer and stops: the cache is out of step until
// the step is finished or the cache restored.
void WireDriver::TornStep() {
  const uint64_t tokens = Chance(0.5) ? 1 : Uniform(2, MaxUpdateTokens());
  if (KeepStandardLayersSmall(tokens)) return;
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  const std::vector<KvTensors> data = {RandomKv(config_.spec, layer, tokens, rng_)};
  SendStream({MakeLayerUpdate(config_.spec, layer, data[0])}, data, 1);
  ++stats_.torn_steps;
  ProbeOutOfStep();
  Repair();
}

void WireDriver::ProbeOutOfStep() {
  SCOPED_TRACE("out of step");
  CheckOffsets();
  ASSERT_EQ(reference_->Snapshot(0), nullptr);
  ASSERT_FALSE(reference_->Trim(0).has_value());
  const absl::Status snapshot = client_.Snapshot(cache_id_, 0).status();
  EXPECT_EQ(snapshot.code(), Code::kFailedPrecondition) << snapshot;
  EXPECT_THAT(std::string(snapshot.message()), HasSubstr("out of step"));
  const absl::Status trim = client_.Trim(cache_id_, 0).status();
  EXPECT_EQ(trim.code(), Code::kFailedPrecondition) << trim;
  FetchLive();  // reads still work, layer by layer
}

// Back in step: a restore (from a snapshot or a live rewind to the lowest
// layer's offset) where the reference allows it, else the missing updates.
void WireDriver::Repair() {
  const std::vector<uint64_t> offsets = reference_->layer_offsets();
  const uint64_t lowest = *std::min_element(offsets.begin(), offsets.end());
  if (!snapshots_.empty() && Chance(0.3)) {
    const TrackedSnapshot& snapshot = snapshots_[RandomSnapshotIndex()];
    CompareRestore(snapshot.id, snapshot.reference.get(), snapshot.reference->to);
  } else if (Chance(0.5)) {
    CompareRestore("", nullptr, lowest);
  }
  if (!::testing::Test::HasFailure() && !reference_->CommonOffset().has_value()) FinishStep();
}

void WireDriver::FinishStep() {
  const std::vector<uint64_t> offsets = reference_->layer_offsets();
  const uint64_t highest = *std::max_element(offsets.begin(), offsets.end());
  std::vector<KvTensors> data;
  std::vector<uint32_t> layers;
  for (uint32_t l = 0; l < offsets.size(); ++l) {
    if (offsets[l] == highest) continue;
    data.push_back(RandomKv(config_.spec, l, highest - offsets[l], rng_));
    layers.push_back(l);
  }
  std::vector<LayerUpdate> updates;
  for (size_t i = 0; i < data.size(); ++i) {
    updates.push_back(MakeLayerUpdate(config_.spec, layers[i], data[i]));
  }
  SendStream(updates, data, updates.size());
  ASSERT_TRUE(reference_->CommonOffset().has_value());
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
