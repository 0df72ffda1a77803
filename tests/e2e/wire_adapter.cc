#include "wire_adapter.h"

#include <random>
#include <variant>

#include "absl/strings/str_cat.h"
#include "e2e_test_util.h"
#include "reference_recurrent.h"
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

WireAdapter::WireAdapter(ShardedClient& fleet) : fleet_(&fleet) {
  std::random_device device;
  placement_key_ = absl::StrCat("driver-", device(), "-", device());
}

Client& WireAdapter::For(absl::string_view id) {
  if (fleet_ == nullptr) return *client_;
  absl::StatusOr<Client*> owner = fleet_->Owner(id);
  if (owner.ok()) return **owner;
  // An id the driver made up to be refused: any replica refuses it.
  return client_ != nullptr ? *client_ : fleet_->client(0);
}

absl::StatusOr<CacheState> WireAdapter::CreateCache(const engine::CacheSpec& spec) {
  if (fleet_ == nullptr) return StateOr(client_->CreateCache(ToWireSpec(spec)));
  absl::StatusOr<v1::CacheInfo> created =
      fleet_->CreateCache(ToWireSpec(spec), {.placement_key = placement_key_});
  if (!created.ok()) return created.status();
  client_ = &For(created->cache_id());
  return StateOr(std::move(created));
}

absl::StatusOr<CacheState> WireAdapter::CreateCacheLike(const std::string& cache_id) {
  absl::StatusOr<v1::CacheInfo> live = For(cache_id).GetCache(cache_id);
  if (!live.ok()) return live.status();
  return StateOr(For(cache_id).CreateCache(live->spec()));
}

absl::StatusOr<CacheState> WireAdapter::GetCache(const std::string& cache_id) {
  return StateOr(For(cache_id).GetCache(cache_id));
}

absl::Status WireAdapter::DeleteCache(const std::string& cache_id) {
  return For(cache_id).DeleteCache(cache_id);
}

StreamResult WireAdapter::SendUpdates(const std::string& cache_id, const engine::CacheSpec& spec,
                                      const std::deque<StepPart>& parts, bool one_call) {
  std::vector<LayerUpdate> updates;
  for (const StepPart& part : parts) updates.push_back(UpdateOf(spec, part));
  StreamResult result;
  std::vector<v1::UpdateResponse> acks;
  if (one_call) {
    absl::StatusOr<std::vector<v1::UpdateResponse>> answer =
        For(cache_id).Update(cache_id, updates);
    result.status = answer.status();
    if (answer.ok()) acks = *std::move(answer);
  } else {
    std::unique_ptr<UpdateStream> stream = For(cache_id).OpenUpdate(cache_id);
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
  absl::StatusOr<v1::TrimResponse> trimmed = For(cache_id).Trim(cache_id, n);
  if (!trimmed.ok()) return trimmed.status();
  const auto& offsets = trimmed->cache().layer_offsets();
  return TrimResult{.trimmed = trimmed->trimmed(),
                    .layer_offsets = std::vector<uint64_t>(offsets.begin(), offsets.end())};
}

absl::StatusOr<SnapshotState> WireAdapter::Snapshot(const std::string& cache_id, uint64_t from,
                                                    bool pinned) {
  return SnapshotStateOr(For(cache_id).Snapshot(cache_id, {.from_offset = from, .pinned = pinned}));
}

absl::StatusOr<CacheState> WireAdapter::Restore(const std::string& cache_id,
                                                const std::string& snapshot_id, uint64_t target) {
  return StateOr(For(cache_id).Restore(cache_id, snapshot_id, target));
}

absl::StatusOr<SnapshotState> WireAdapter::MergeSnapshots(const std::string& parent_id,
                                                          const std::string& child_id) {
  return SnapshotStateOr(For(parent_id).MergeSnapshots(parent_id, child_id));
}

absl::StatusOr<std::pair<SnapshotState, SnapshotState>> WireAdapter::SplitSnapshot(
    const std::string& snapshot_id, uint64_t at) {
  absl::StatusOr<v1::SplitSnapshotResponse> split = For(snapshot_id).SplitSnapshot(snapshot_id, at);
  if (!split.ok()) return split.status();
  return std::make_pair(SnapshotStateOf(split->parent()), SnapshotStateOf(split->child()));
}

absl::Status WireAdapter::ReleaseSnapshot(const std::string& snapshot_id) {
  return For(snapshot_id).ReleaseSnapshot(snapshot_id);
}

absl::Status WireAdapter::ReadSnapshot(const std::string& snapshot_id) {
  return For(snapshot_id).FetchLayer("", snapshot_id, 0).status();
}

absl::StatusOr<std::vector<SnapshotState>> WireAdapter::ListSnapshots(
    const std::string& cache_id) {
  absl::StatusOr<std::vector<v1::SnapshotInfo>> listed =
      For(cache_id).ListSnapshots({.cache_id = cache_id});
  if (!listed.ok()) return listed.status();
  std::vector<SnapshotState> states;
  for (const v1::SnapshotInfo& info : *listed) states.push_back(SnapshotStateOf(info));
  return states;
}

absl::StatusOr<CacheState> WireAdapter::ExtractRow(const std::string& cache_id, uint32_t row) {
  return StateOr(For(cache_id).ExtractRow(cache_id, row));
}

absl::StatusOr<CacheState> WireAdapter::FilterRows(const std::string& cache_id,
                                                   absl::Span<const uint32_t> keep) {
  return StateOr(For(cache_id).FilterRows(cache_id, keep));
}

absl::StatusOr<CacheState> WireAdapter::MergeCaches(absl::Span<const std::string> cache_ids) {
  return StateOr(For(cache_ids.empty() ? "" : cache_ids[0]).MergeCaches(cache_ids));
}

absl::StatusOr<CacheState> WireAdapter::ExtendCache(const std::string& cache_id,
                                                    const std::string& other_id) {
  return StateOr(For(cache_id).ExtendCache(cache_id, other_id));
}

::testing::AssertionResult WireAdapter::CacheMatches(const std::string& cache_id,
                                                     const RefCache& reference) {
  return CacheMatchesReference(For(cache_id), cache_id, reference);
}

absl::StatusOr<uint64_t> WireAdapter::PagesInUse() {
  absl::StatusOr<v1::Stats> stats = client_->GetStats();
  if (!stats.ok()) return stats.status();
  return stats->pages_used();
}

absl::StatusOr<SpeculationState> WireAdapter::BeginSpeculation(const std::string& cache_id,
                                                               bool isolated) {
  absl::StatusOr<v1::BeginSpeculationResponse> begun =
      For(cache_id).BeginSpeculation(cache_id, {.isolated = isolated});
  if (!begun.ok()) return begun.status();
  return SpeculationState{.speculation_id = begun->speculation_id(),
                          .committed_offset = begun->offset()};
}

absl::StatusOr<CacheState> WireAdapter::CommitSpeculation(const std::string& speculation_id,
                                                          uint64_t accepted) {
  return StateOr(For(speculation_id).CommitSpeculation(speculation_id, accepted));
}

absl::StatusOr<CacheState> WireAdapter::AbortSpeculation(const std::string& speculation_id) {
  return StateOr(For(speculation_id).AbortSpeculation(speculation_id));
}

absl::Status WireAdapter::ReadSpeculation(const std::string& speculation_id,
                                          const std::string& cache_id,
                                          const std::string& snapshot_id) {
  v1::FetchRequest request;
  request.set_speculation_id(speculation_id);
  request.set_cache_id(cache_id);
  request.set_snapshot_id(snapshot_id);
  return For(speculation_id).FetchAll(request).status();
}

::testing::AssertionResult WireAdapter::SpeculationMatches(const std::string& speculation_id,
                                                           const std::string& cache_id,
                                                           uint32_t layer,
                                                           const RefSpeculation& reference) {
  const engine::CacheSpec& spec = reference.spec();
  v1::FetchRequest request;
  request.set_speculation_id(speculation_id);
  request.set_cache_id(cache_id);  // its own cache: allowed
  request.add_layers(layer);
  if (engine::IsRecurrent(spec.layers[layer])) {
    absl::StatusOr<std::vector<v1::FetchResponse>> chunks = For(speculation_id).FetchAll(request);
    if (!chunks.ok()) return ::testing::AssertionFailure() << "Fetch: " << chunks.status();
    const uint64_t offset = reference.layer_offsets()[layer];
    if (chunks->size() != 1 || !(*chunks)[0].has_state() || (*chunks)[0].start() != offset) {
      return ::testing::AssertionFailure()
             << chunks->size() << " chunks, not one state at " << offset;
    }
    absl::StatusOr<RefState> actual = StateOf(spec, layer, (*chunks)[0].state());
    if (!actual.ok()) return ::testing::AssertionFailure() << actual.status();
    if (!(*actual == reference.FetchState(layer).value_or(ZeroState(spec, layer)))) {
      return ::testing::AssertionFailure() << "state bytes differ";
    }
    return ::testing::AssertionSuccess();
  }
  const std::vector<RefToken> stored = reference.Fetch(layer);
  absl::StatusOr<LayerHistory> history = absl::UnknownError("not read");
  if (cache_id.empty()) {
    history = For(speculation_id).FetchSpeculation(speculation_id, layer);  // by its id alone
  } else if (absl::StatusOr<std::vector<v1::FetchResponse>> chunks =
                 For(speculation_id).FetchAll(request);
             chunks.ok()) {
    history = AssembleHistory(*chunks);
  } else {
    history = chunks.status();
  }
  ::testing::AssertionResult same =
      HistoryMatches(AsFetched(spec, layer, stored), history, ShapeOf(spec, layer));
  if (!same || !std::holds_alternative<engine::QuantizedKind>(spec.layers[layer].kind)) {
    return same;
  }
  request.set_packed(true);
  absl::StatusOr<std::vector<v1::FetchResponse>> packed = For(speculation_id).FetchAll(request);
  if (!packed.ok()) return ::testing::AssertionFailure() << "packed Fetch: " << packed.status();
  absl::StatusOr<std::vector<RefToken>> tokens = PackedTokensOf(spec, layer, *packed);
  if (!tokens.ok()) return ::testing::AssertionFailure() << tokens.status();
  return SameTokens(stored, *tokens) << " (packed)";
}

}  // namespace kvcache::testing
