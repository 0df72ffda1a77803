#include "wire_adapter.h"

#include "e2e_test_util.h"
#include "wire_forms_util.h"

namespace kvcache::testing {
namespace {

absl::StatusOr<CacheState> StateOr(const absl::StatusOr<v1::CacheInfo>& info) {
  if (!info.ok()) return info.status();
  return StateOf(*info);
}

SnapshotState SnapshotStateOf(const v1::SnapshotInfo& info) {
  return {.snapshot_id = info.snapshot_id(),
          .cache_id = info.cache_id(),
          .from = info.from_offset(),
          .to = info.to_offset(),
          .pinned = info.pinned()};
}

absl::StatusOr<SnapshotState> SnapshotStateOr(const absl::StatusOr<v1::SnapshotInfo>& info) {
  if (!info.ok()) return info.status();
  return SnapshotStateOf(*info);
}

}  // namespace

CacheState StateOf(const v1::CacheInfo& info) {
  return {.cache_id = info.cache_id(),
          .num_layers = static_cast<uint32_t>(info.spec().layers_size()),
          .batch_size = info.spec().batch_size(),
          .left_padding = {info.spec().left_padding().begin(), info.spec().left_padding().end()},
          .layer_offsets = {info.layer_offsets().begin(), info.layer_offsets().end()},
          .offset = info.offset(),
          .in_step = info.in_step(),
          .size_bytes = info.size_bytes()};
}

LayerUpdate UpdateOf(const engine::CacheSpec& spec, const StepPart& part) {
  const uint64_t b = spec.batch_size;
  LayerUpdate update;
  if (part.recurrent == part.wrong_kind) {
    // Tokens: right for an attention layer; for a recurrent one, wrong.
    if (!part.wrong_kind) {
      update = MakeLayerUpdate(spec, part.layer, part.kv);
    } else {
      update = LayerUpdate{.layer = part.layer,
                           .dtype = static_cast<v1::DType>(spec.dtype),
                           .keys_shape = {b, 1, part.kv.tokens, 4},
                           .keys = part.kv.keys,
                           .values_shape = {b, 1, part.kv.tokens, 4},
                           .values = part.kv.values};
    }
  } else if (!part.wrong_kind) {
    update = MakeStateUpdate(spec, part.layer, part.state, part.advance);
  } else {
    const uint64_t elem = DTypeSize(spec.dtype);
    update = LayerUpdate{.layer = part.layer,
                         .dtype = static_cast<v1::DType>(spec.dtype),
                         .state = RecurrentStateUpdate{.conv_shape = {b, 12 / elem},
                                                       .conv = part.state.conv,
                                                       .delta_shape = {b, 8 / elem},
                                                       .delta = part.state.delta,
                                                       .advance = part.advance}};
  }
  update.expected_offset = part.expected_offset;
  update.speculation_id = part.speculation_id;
  return update;
}

absl::StatusOr<CacheState> WireAdapter::CreateCache(const engine::CacheSpec& spec) {
  return StateOr(client_.CreateCache(ToWireSpec(spec)));
}

absl::StatusOr<CacheState> WireAdapter::CreateCacheLike(const std::string& cache_id) {
  absl::StatusOr<v1::CacheInfo> live = client_.GetCache(cache_id);
  if (!live.ok()) return live.status();
  return StateOr(client_.CreateCache(live->spec()));
}

absl::StatusOr<CacheState> WireAdapter::GetCache(const std::string& cache_id) {
  return StateOr(client_.GetCache(cache_id));
}

absl::Status WireAdapter::DeleteCache(const std::string& cache_id) {
  return client_.DeleteCache(cache_id);
}

StreamResult WireAdapter::SendUpdates(const std::string& cache_id, const engine::CacheSpec& spec,
                                      const std::deque<StepPart>& parts, bool one_call) {
  std::vector<LayerUpdate> updates;
  for (const StepPart& part : parts) updates.push_back(UpdateOf(spec, part));
  StreamResult result;
  std::vector<v1::UpdateResponse> acks;
  if (one_call) {
    absl::StatusOr<std::vector<v1::UpdateResponse>> answer = client_.Update(cache_id, updates);
    result.status = answer.status();
    if (answer.ok()) acks = *std::move(answer);
  } else {
    std::unique_ptr<UpdateStream> stream = client_.OpenUpdate(cache_id);
    for (const LayerUpdate& update : updates) {
      if (!stream->Write(update)) break;  // the server has ended the stream
    }
    result.status = stream->Finish().status();
    acks = stream->acknowledged();
  }
  for (const v1::UpdateResponse& ack : acks) result.acks.emplace_back(ack.layer(), ack.offset());
  return result;
}

absl::StatusOr<TrimResult> WireAdapter::Trim(const std::string& cache_id, uint64_t n) {
  absl::StatusOr<v1::TrimResponse> trimmed = client_.Trim(cache_id, n);
  if (!trimmed.ok()) return trimmed.status();
  const auto& offsets = trimmed->cache().layer_offsets();
  return TrimResult{.trimmed = trimmed->trimmed(),
                    .layer_offsets = std::vector<uint64_t>(offsets.begin(), offsets.end())};
}

absl::StatusOr<SnapshotState> WireAdapter::Snapshot(const std::string& cache_id, uint64_t from,
                                                    bool pinned) {
  return SnapshotStateOr(client_.Snapshot(cache_id, from, pinned));
}

absl::StatusOr<CacheState> WireAdapter::Restore(const std::string& cache_id,
                                                const std::string& snapshot_id, uint64_t target) {
  return StateOr(client_.Restore(cache_id, snapshot_id, target));
}

absl::StatusOr<SnapshotState> WireAdapter::MergeSnapshots(const std::string& parent_id,
                                                          const std::string& child_id) {
  return SnapshotStateOr(client_.MergeSnapshots(parent_id, child_id));
}

absl::StatusOr<std::pair<SnapshotState, SnapshotState>> WireAdapter::SplitSnapshot(
    const std::string& snapshot_id, uint64_t at) {
  absl::StatusOr<v1::SplitSnapshotResponse> split = client_.SplitSnapshot(snapshot_id, at);
  if (!split.ok()) return split.status();
  return std::make_pair(SnapshotStateOf(split->parent()), SnapshotStateOf(split->child()));
}

absl::Status WireAdapter::ReleaseSnapshot(const std::string& snapshot_id) {
  return client_.ReleaseSnapshot(snapshot_id);
}

absl::Status WireAdapter::ReadSnapshot(const std::string& snapshot_id) {
  return client_.FetchLayer("", snapshot_id, 0).status();
}

absl::StatusOr<std::vector<SnapshotState>> WireAdapter::ListSnapshots(
    const std::string& cache_id) {
  absl::StatusOr<std::vector<v1::SnapshotInfo>> listed = client_.ListSnapshots(cache_id);
  if (!listed.ok()) return listed.status();
  std::vector<SnapshotState> states;
  for (const v1::SnapshotInfo& info : *listed) states.push_back(SnapshotStateOf(info));
  return states;
}

absl::StatusOr<CacheState> WireAdapter::ExtractRow(const std::string& cache_id, uint32_t row) {
  return StateOr(client_.ExtractRow(cache_id, row));
}

absl::StatusOr<CacheState> WireAdapter::FilterRows(const std::string& cache_id,
                                                   absl::Span<const uint32_t> keep) {
  return StateOr(client_.FilterRows(cache_id, keep));
}

absl::StatusOr<CacheState> WireAdapter::MergeCaches(absl::Span<const std::string> cache_ids) {
  return StateOr(client_.MergeCaches(cache_ids));
}

absl::StatusOr<CacheState> WireAdapter::ExtendCache(const std::string& cache_id,
                                                    const std::string& other_id) {
  return StateOr(client_.ExtendCache(cache_id, other_id));
}

::testing::AssertionResult WireAdapter::CacheMatches(const std::string& cache_id,
                                                     const RefCache& reference) {
  return CacheMatchesReference(client_, cache_id, reference);
}

}  // namespace kvcache::testing
