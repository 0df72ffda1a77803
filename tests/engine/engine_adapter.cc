#include "engine_adapter.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "chunked_recurrent_test_util.h"
#include "reference_quantized.h"

namespace kvcache::testing {
namespace {

template <typename T>
absl::StatusOr<CacheState> StateOr(const absl::StatusOr<T>& info) {
  if (!info.ok()) return info.status();
  return StateOf(*info);
}

SnapshotState SnapshotStateOf(const engine::SnapshotInfo& info) {
  return {.snapshot_id = info.snapshot_id,
          .cache_id = info.cache_id,
          .from = info.from_offset,
          .to = info.to_offset,
          .pinned = info.pinned};
}

// Layer `layer` of `view` holds `tokens` in its stored form, or, recurrent,
// no tokens and `state` (zeros when nullopt).
::testing::AssertionResult ViewLayerMatches(const engine::CacheSnapshot& view,
                                            const engine::CacheSpec& spec, uint32_t layer,
                                            const std::vector<RefToken>& tokens,
                                            const std::optional<RefState>& state) {
  if (!engine::IsRecurrent(spec.layers[layer])) {
    absl::StatusOr<std::vector<RefToken>> actual = FetchStoredLayer(view, layer, kEverything);
    if (!actual.ok()) return ::testing::AssertionFailure() << actual.status();
    return SameTokens(tokens, *actual) << " (layer " << layer << ")";
  }
  absl::StatusOr<RefState> actual = ReadLayerState(view, layer);
  if (!actual.ok()) return ::testing::AssertionFailure() << actual.status();
  if (!(*actual == state.value_or(ZeroState(spec, layer))) ||
      !view.Ranges(layer, kEverything).empty()) {
    return ::testing::AssertionFailure() << "recurrent layer " << layer << " differs";
  }
  return ::testing::AssertionSuccess();
}

// The engine drops all-zero padding from a spec.
std::vector<uint32_t> NormalizedPadding(const engine::CacheSpec& spec) {
  const auto& padding = spec.left_padding;
  if (std::all_of(padding.begin(), padding.end(), [](uint32_t p) { return p == 0; })) return {};
  return padding;
}

}  // namespace

CacheState StateOf(const engine::CacheInfo& info) {
  return {.cache_id = info.cache_id,
          .num_layers = static_cast<uint32_t>(info.spec.layers.size()),
          .batch_size = info.spec.batch_size,
          .left_padding = info.spec.left_padding,
          .layer_offsets = info.layer_offsets,
          .offset = info.offset,
          .in_step = info.in_step,
          .size_bytes = info.size_bytes};
}

absl::StatusOr<CacheState> EngineAdapter::CreateCache(const engine::CacheSpec& spec) {
  return StateOr(engine_.CreateCache(spec));
}

absl::StatusOr<CacheState> EngineAdapter::CreateCacheLike(const std::string& cache_id) {
  absl::StatusOr<engine::CacheSpec> spec = engine_.GetSpec(cache_id);
  if (!spec.ok()) return spec.status();
  return CreateCache(*spec);
}

absl::StatusOr<CacheState> EngineAdapter::GetCache(const std::string& cache_id) {
  return StateOr(engine_.GetCache(cache_id));
}

absl::Status EngineAdapter::DeleteCache(const std::string& cache_id) {
  return engine_.DeleteCache(cache_id);
}

absl::StatusOr<uint64_t> EngineAdapter::Send(const std::string& cache_id, const StepPart& part) {
  const bool tokens = part.recurrent == part.wrong_kind;
  const std::string& speculation = part.speculation_id;
  if (tokens && speculation.empty()) {
    return engine_.Update(cache_id, part.layer, part.kv.input(), part.expected_offset);
  }
  if (tokens) {
    return engine_.UpdateSpeculation(speculation, cache_id, part.layer, part.kv.input(),
                                     part.expected_offset);
  }
  const engine::StateInput state = StateInputOf(part.state, part.advance);
  if (speculation.empty()) {
    return engine_.UpdateState(cache_id, part.layer, state, part.expected_offset);
  }
  return engine_.UpdateSpeculationState(speculation, cache_id, part.layer, state,
                                        part.expected_offset);
}

StreamResult EngineAdapter::SendUpdates(const std::string& cache_id, const engine::CacheSpec&,
                                        const std::deque<StepPart>& parts, bool) {
  StreamResult result;
  for (const StepPart& part : parts) {
    absl::StatusOr<uint64_t> offset = Send(cache_id, part);
    if (!offset.ok()) {
      result.status = offset.status();
      break;
    }
    result.acks.emplace_back(part.layer, *offset);
  }
  return result;
}

absl::StatusOr<TrimResult> EngineAdapter::Trim(const std::string& cache_id, uint64_t n) {
  absl::StatusOr<uint64_t> trimmed = engine_.Trim(cache_id, n);
  if (!trimmed.ok()) return trimmed.status();
  return TrimResult{.trimmed = *trimmed};
}

absl::StatusOr<SnapshotState> EngineAdapter::Snapshot(const std::string& cache_id, uint64_t from,
                                                      bool pinned) {
  absl::StatusOr<engine::SnapshotInfo> info = engine_.Snapshot(cache_id, from, pinned);
  if (!info.ok()) return info.status();
  return SnapshotStateOf(*info);
}

absl::StatusOr<CacheState> EngineAdapter::Restore(const std::string& cache_id,
                                                  const std::string& snapshot_id,
                                                  uint64_t target) {
  return StateOr(engine_.Restore(cache_id, snapshot_id, target));
}

absl::StatusOr<SnapshotState> EngineAdapter::MergeSnapshots(const std::string& parent_id,
                                                            const std::string& child_id) {
  absl::StatusOr<engine::SnapshotInfo> info = engine_.MergeSnapshots(parent_id, child_id);
  if (!info.ok()) return info.status();
  return SnapshotStateOf(*info);
}

absl::StatusOr<std::pair<SnapshotState, SnapshotState>> EngineAdapter::SplitSnapshot(
    const std::string& snapshot_id, uint64_t at) {
  auto split = engine_.SplitSnapshot(snapshot_id, at);
  if (!split.ok()) return split.status();
  return std::make_pair(SnapshotStateOf(split->first), SnapshotStateOf(split->second));
}

absl::Status EngineAdapter::ReleaseSnapshot(const std::string& snapshot_id) {
  return engine_.ReleaseSnapshot(snapshot_id);
}

absl::Status EngineAdapter::ReadSnapshot(const std::string& snapshot_id) {
  return engine_.Freeze("", snapshot_id).status();
}

absl::StatusOr<std::vector<SnapshotState>> EngineAdapter::ListSnapshots(
    const std::string& cache_id) {
  std::vector<SnapshotState> states;
  for (const engine::SnapshotInfo& info : engine_.ListSnapshots(cache_id)) {
    states.push_back(SnapshotStateOf(info));
  }
  return states;
}

absl::StatusOr<CacheState> EngineAdapter::ExtractRow(const std::string& cache_id, uint32_t row) {
  return StateOr(engine_.ExtractRow(cache_id, row));
}

absl::StatusOr<CacheState> EngineAdapter::FilterRows(const std::string& cache_id,
                                                     absl::Span<const uint32_t> keep) {
  return StateOr(engine_.FilterRows(cache_id, keep));
}

absl::StatusOr<CacheState> EngineAdapter::MergeCaches(absl::Span<const std::string> cache_ids) {
  return StateOr(engine_.MergeCaches(cache_ids));
}

absl::StatusOr<CacheState> EngineAdapter::ExtendCache(const std::string& cache_id,
                                                      const std::string& other_id) {
  return StateOr(engine_.ExtendCache(cache_id, other_id));
}

::testing::AssertionResult EngineAdapter::CacheMatches(const std::string& id,
                                                       const RefCache& reference) {
  absl::StatusOr<engine::CacheInfo> info = engine_.GetCache(id);
  if (!info.ok()) return ::testing::AssertionFailure() << info.status();
  if (info->spec.batch_size != reference.spec().batch_size ||
      info->spec.left_padding != NormalizedPadding(reference.spec()) ||
      info->layer_offsets != reference.layer_offsets()) {
    return ::testing::AssertionFailure() << "rows, padding or offsets differ";
  }
  auto view = engine_.Freeze(id, "");
  if (!view.ok()) return ::testing::AssertionFailure() << view.status();
  for (uint32_t layer = 0; layer < reference.num_layers(); ++layer) {
    const bool recurrent = engine::IsRecurrent(reference.spec().layers[layer]);
    ::testing::AssertionResult same =
        ViewLayerMatches(**view, reference.spec(), layer, reference.layer(layer).Fetch(),
                         recurrent ? reference.layer(layer).FetchState() : std::nullopt);
    if (!same) return same;
  }
  return ::testing::AssertionSuccess();
}

// In every tier: evictions move pages, they do not free them.
absl::StatusOr<uint64_t> EngineAdapter::PagesInUse() {
  const gpu::PoolStats pool = engine_.Stats().pool;
  return uint64_t{pool.used_pages} + pool.host_pages + pool.disk_pages;
}

absl::StatusOr<SpeculationState> EngineAdapter::BeginSpeculation(const std::string& cache_id,
                                                                 bool isolated) {
  absl::StatusOr<engine::SpeculationInfo> info = engine_.BeginSpeculation(cache_id, isolated);
  if (!info.ok()) return info.status();
  return SpeculationState{.speculation_id = info->speculation_id,
                          .committed_offset = info->committed_offset,
                          .cache_id = info->cache_id,
                          .layer_offsets = info->layer_offsets};
}

absl::StatusOr<CacheState> EngineAdapter::CommitSpeculation(const std::string& speculation_id,
                                                            uint64_t accepted) {
  return StateOr(engine_.CommitSpeculation(speculation_id, accepted));
}

absl::StatusOr<CacheState> EngineAdapter::AbortSpeculation(const std::string& speculation_id) {
  return StateOr(engine_.AbortSpeculation(speculation_id));
}

absl::Status EngineAdapter::ReadSpeculation(const std::string& speculation_id,
                                            const std::string& cache_id,
                                            const std::string& snapshot_id) {
  const absl::Status frozen = engine_.Freeze(cache_id, snapshot_id, speculation_id).status();
  if (!snapshot_id.empty()) return frozen;
  const absl::Status described = engine_.GetSpeculation(speculation_id, cache_id).status();
  if (described.code() != frozen.code()) {
    return absl::InternalError(absl::StrCat("GetSpeculation answers ", described.ToString(),
                                            ", Freeze ", frozen.ToString()));
  }
  return frozen;
}

::testing::AssertionResult EngineAdapter::SpeculationMatches(const std::string& speculation_id,
                                                             const std::string& cache_id,
                                                             uint32_t layer,
                                                             const RefSpeculation& reference) {
  absl::StatusOr<engine::SpeculationInfo> info = engine_.GetSpeculation(speculation_id, cache_id);
  if (!info.ok()) return ::testing::AssertionFailure() << "GetSpeculation: " << info.status();
  const std::vector<uint64_t> offsets = reference.layer_offsets();
  if (info->layer_offsets != offsets || info->committed_offset != reference.committed() ||
      info->isolated != reference.isolated()) {
    return ::testing::AssertionFailure() << "GetSpeculation: offsets or isolation differ";
  }
  auto view = engine_.Freeze(cache_id, "", speculation_id);
  if (!view.ok()) return ::testing::AssertionFailure() << view.status();
  if ((*view)->to != *std::max_element(offsets.begin(), offsets.end())) {
    return ::testing::AssertionFailure() << "the view ends at " << (*view)->to;
  }
  const bool recurrent = engine::IsRecurrent(reference.spec().layers[layer]);
  return ViewLayerMatches(**view, reference.spec(), layer, reference.Fetch(layer),
                          recurrent ? reference.FetchState(layer) : std::nullopt);
}

}  // namespace kvcache::testing
