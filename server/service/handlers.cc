#include "service/handlers.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "core/status_macros.h"
#include "core/tensor_size.h"
#include "service/convert.h"
#include "service/validation.h"

namespace kvcache::service {

Handlers::Handlers(engine::Engine& engine, ServiceOptions options)
    : engine_(engine), options_(std::move(options)), request_log_(options_.request_log) {}

absl::StatusOr<std::optional<std::string>> Handlers::BeginOnce(
    absl::string_view method, const std::string& request_id,
    const google::protobuf::Message& without_id, absl::string_view payload) {
  RETURN_IF_ERROR(CheckIdLength("request_id", request_id));
  // Deterministic, so the same request always has the same fingerprint.
  std::string request_bytes;
  {
    google::protobuf::io::StringOutputStream stream(&request_bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    without_id.SerializeToCodedStream(&coded);
  }
  return request_log_.Begin(request_id, method, absl::HashOf(request_bytes, payload),
                            absl::Now());
}

void Handlers::FinishOnce(const std::string& request_id, const absl::Status& status,
                          const google::protobuf::Message& response) {
  request_log_.Finish(request_id, status.ok(), status.ok() ? response.SerializeAsString() : "",
                      absl::Now());
}

absl::Status Handlers::AnswerOnce(absl::string_view method, const std::string& request_id,
                                  const google::protobuf::Message& without_id,
                                  absl::string_view payload, google::protobuf::Message* response,
                                  absl::FunctionRef<absl::Status()> run) {
  ASSIGN_OR_RETURN(std::optional<std::string> earlier,
                   BeginOnce(method, request_id, without_id, payload));
  if (earlier.has_value()) {
    response->Clear();
    if (!response->ParseFromString(*earlier)) {
      return absl::InternalError(absl::StrCat("request_id: the kept answer to ", method,
                                              " does not parse"));
    }
    return absl::OkStatus();
  }
  const absl::Status status = run();
  FinishOnce(request_id, status, *response);
  return status;
}

absl::Status Handlers::CreateCache(const v1::CreateCacheRequest& request,
                                   v1::CacheInfo* response) {
  ASSIGN_OR_RETURN(engine::CacheSpec spec, FromProto(request.spec()));
  ASSIGN_OR_RETURN(engine::CacheInfo info,
                   engine_.CreateCache(spec, absl::Seconds(request.ttl_seconds())));
  ToProto(info, response);
  return absl::OkStatus();
}

absl::Status Handlers::GetCache(const v1::GetCacheRequest& request, v1::CacheInfo* response) {
  RETURN_IF_ERROR(RequireId("cache_id", request.cache_id()));
  ASSIGN_OR_RETURN(engine::CacheInfo info, engine_.GetCache(request.cache_id()));
  ToProto(info, response);
  return absl::OkStatus();
}

absl::Status Handlers::ListCaches(const v1::ListCachesRequest&, v1::ListCachesResponse* response) {
  for (const engine::CacheInfo& info : engine_.ListCaches()) ToProto(info, response->add_caches());
  return absl::OkStatus();
}

absl::Status Handlers::DeleteCache(const v1::DeleteCacheRequest& request,
                                   v1::DeleteCacheResponse*) {
  RETURN_IF_ERROR(RequireId("cache_id", request.cache_id()));
  return engine_.DeleteCache(request.cache_id());
}

absl::Status Handlers::Update(const UpdateView& request, KnownSpec* known,
                              v1::UpdateResponse* response) {
  // Not copied unless the speculation names it (no allocation per message).
  const std::string* cache_id = &request.cache_id;
  engine::SpeculationInfo speculation;
  // Every id's length before any lookup (validation.h).
  RETURN_IF_ERROR(CheckIdLength("cache_id", request.cache_id));
  RETURN_IF_ERROR(CheckIdLength("speculation_id", request.speculation_id));
  if (!request.speculation_id.empty()) {
    // The speculation first: an unknown one, or one named with another
    // cache_id, is NOT_FOUND naming speculation_id, never a mismatch with
    // that other cache's layers. An empty cache_id means its cache.
    ASSIGN_OR_RETURN(speculation,
                     engine_.GetSpeculation(request.speculation_id, request.cache_id));
    cache_id = &speculation.cache_id;
  }
  RETURN_IF_ERROR(RequireId("cache_id", *cache_id));
  KnownSpec looked_up;
  if (known == nullptr) known = &looked_up;
  RETURN_IF_ERROR(engine_.RefreshSpec(*cache_id, known->layout_id, known->spec));
  const engine::CacheSpec& spec = known->spec;
  RETURN_IF_ERROR(CheckLayerIndex(spec, request.layer));
  uint64_t offset = 0;
  if (engine::IsRecurrent(spec.layers[request.layer])) {
    ASSIGN_OR_RETURN(offset, ApplyStateUpdate(request, spec, *cache_id));
  } else {
    ASSIGN_OR_RETURN(offset, ApplyKvUpdate(request, spec, *cache_id));
  }
  response->set_layer(request.layer);
  response->set_offset(offset);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Handlers::ApplyStateUpdate(const UpdateView& request,
                                                    const engine::CacheSpec& spec,
                                                    const std::string& cache_id) {
  RETURN_IF_ERROR(CheckStateUpdate(spec, request));
  const engine::StateInput state{.conv = request.state->conv_state.data,
                                 .delta = request.state->delta_state.data,
                                 .advance = request.state->advance};
  if (request.speculation_id.empty()) {
    return engine_.UpdateState(cache_id, request.layer, state, request.expected_offset);
  }
  return engine_.UpdateSpeculationState(request.speculation_id, cache_id, request.layer, state,
                                        request.expected_offset);
}

absl::StatusOr<uint64_t> Handlers::ApplyKvUpdate(const UpdateView& request,
                                                 const engine::CacheSpec& spec,
                                                 const std::string& cache_id) {
  ASSIGN_OR_RETURN(const uint64_t tokens, CheckKvUpdate(spec, request));
  const engine::KvInput kv{
      .keys = request.keys->data, .values = request.values->data, .tokens = tokens};
  if (request.speculation_id.empty()) {
    return engine_.Update(cache_id, request.layer, kv, request.expected_offset);
  }
  return engine_.UpdateSpeculation(request.speculation_id, cache_id, request.layer, kv,
                                   request.expected_offset);
}

absl::Status Handlers::Update(const v1::UpdateRequest& request, KnownSpec* known,
                              v1::UpdateResponse* response) {
  return Update(ViewOf(request), known, response);
}

uint64_t Handlers::ChunkTokens(const engine::CacheSpec& spec, uint32_t layer,
                               uint32_t requested) const {
  const engine::LayerSpec& l = spec.layers[layer];
  const uint64_t b = spec.batch_size, h = l.num_kv_heads;
  // A one-token chunk's keys and values.
  const uint64_t token_bytes = TensorByteSize(spec.dtype, {b, h, 1, l.k_head_dim}) +
                               TensorByteSize(spec.dtype, {b, h, 1, l.v_head_dim});
  // Leave room for the message's own fields under the size limit.
  const uint64_t fits = std::max<uint64_t>(1, (options_.max_message_bytes - 4096) / token_bytes);
  const uint64_t wanted =
      requested != 0 ? requested : std::max<uint64_t>(1, options_.fetch_chunk_bytes / token_bytes);
  return std::min(wanted, fits);
}

absl::Status Handlers::CheckFetchLayers(const v1::FetchRequest& request,
                                        const engine::CacheSpec& spec,
                                        std::vector<uint32_t>& layers) const {
  for (int i = 0; i < request.layers_size(); ++i) {
    if (request.layers(i) >= spec.layers.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "layers[%d]: %d is out of range; the cache has %d layers", i, request.layers(i),
          spec.layers.size()));
    }
    layers.push_back(request.layers(i));
  }
  if (layers.empty()) {
    for (uint32_t l = 0; l < spec.layers.size(); ++l) layers.push_back(l);
  }
  return absl::OkStatus();
}

absl::StatusOr<FetchPlan> Handlers::PlanFetch(const v1::FetchRequest& request) {
  if (request.cache_id().empty() && request.snapshot_id().empty() &&
      request.speculation_id().empty()) {
    return absl::InvalidArgumentError("cache_id: set cache_id, snapshot_id or speculation_id");
  }
  RETURN_IF_ERROR(CheckIdLength("cache_id", request.cache_id()));
  RETURN_IF_ERROR(CheckIdLength("snapshot_id", request.snapshot_id()));
  RETURN_IF_ERROR(CheckIdLength("speculation_id", request.speculation_id()));
  const uint64_t end = request.has_end() ? request.end() : UINT64_MAX;
  if (end < request.start()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("end: %d is below start %d", end, request.start()));
  }
  FetchPlan plan;
  ASSIGN_OR_RETURN(plan.snapshot, engine_.Freeze(request.cache_id(), request.snapshot_id(),
                                                 request.speculation_id()));
  std::vector<uint32_t> layers;
  RETURN_IF_ERROR(CheckFetchLayers(request, plan.snapshot->spec, layers));
  for (uint32_t layer : layers) PlanLayer(request, layer, end, plan);
  return plan;
}

void Handlers::FetchChunkHeader(const FetchPlan& plan, size_t index, v1::FetchResponse* header,
                                uint64_t* key_bytes, uint64_t* value_bytes) const {
  const FetchPlan::Chunk& chunk = plan.chunks[index];
  const engine::CacheSpec& spec = plan.snapshot->spec;
  const engine::LayerSpec& layer = spec.layers[chunk.layer];
  const uint64_t tokens = chunk.range.size();
  const std::tuple<v1::Tensor*, uint32_t, uint64_t*> sides[] = {
      {header->mutable_keys(), layer.k_head_dim, key_bytes},
      {header->mutable_values(), layer.v_head_dim, value_bytes}};
  for (auto [tensor, dim, bytes] : sides) {
    const uint64_t shape[] = {spec.batch_size, layer.num_kv_heads, tokens, dim};
    tensor->set_dtype(ToProto(spec.dtype));
    for (uint64_t d : shape) tensor->add_shape(d);
    *bytes = TensorByteSize(spec.dtype, shape);
  }
  header->set_layer(chunk.layer);
  header->set_start(chunk.range.begin);
}

absl::Status Handlers::ReadFetchChunk(const FetchPlan& plan, size_t index,
                                      const engine::KvOutput& out) const {
  const FetchPlan::Chunk& chunk = plan.chunks[index];
  return plan.snapshot->Read(chunk.layer, chunk.range, out);
}

absl::Status Handlers::MappedFetchChunk(const FetchPlan& plan, size_t index,
                                        engine::KvMappedPieces& out) const {
  const FetchPlan::Chunk& chunk = plan.chunks[index];
  return plan.snapshot->Mapped(chunk.layer, chunk.range, out);
}

absl::Status Handlers::FillFetchChunk(const FetchPlan& plan, size_t index,
                                      v1::FetchResponse* response) {
  switch (plan.chunks[index].form) {
    case FetchPlan::Form::kPacked:
      return FillPackedChunk(plan, index, response);
    case FetchPlan::Form::kState:
      return FillStateChunk(plan, index, response);
    case FetchPlan::Form::kTokens:
      break;
  }
  uint64_t key_bytes = 0, value_bytes = 0;
  FetchChunkHeader(plan, index, response, &key_bytes, &value_bytes);
  std::string* keys = response->mutable_keys()->mutable_data();
  std::string* values = response->mutable_values()->mutable_data();
  keys->resize(key_bytes);
  values->resize(value_bytes);
  return ReadFetchChunk(
      plan, index,
      {.keys = absl::MakeSpan(reinterpret_cast<std::byte*>(keys->data()), keys->size()),
       .values = absl::MakeSpan(reinterpret_cast<std::byte*>(values->data()), values->size())});
}

absl::Status Handlers::Trim(const v1::TrimRequest& request, v1::TrimResponse* response) {
  RETURN_IF_ERROR(RequireId("cache_id", request.cache_id()));
  // The cache as the trim left it: a second read could see another client's
  // update made in between.
  engine::CacheInfo info;
  ASSIGN_OR_RETURN(const uint64_t trimmed, engine_.Trim(request.cache_id(), request.n(), &info));
  response->set_trimmed(trimmed);
  ToProto(info, response->mutable_cache());
  return absl::OkStatus();
}

absl::Status Handlers::Snapshot(const v1::SnapshotRequest& request, v1::SnapshotInfo* response) {
  RETURN_IF_ERROR(RequireId("cache_id", request.cache_id()));
  ASSIGN_OR_RETURN(engine::SnapshotInfo info,
                   engine_.Snapshot(request.cache_id(), request.from_offset(), request.pinned(),
                                    absl::Seconds(request.ttl_seconds())));
  ToProto(info, response);
  return absl::OkStatus();
}

absl::Status Handlers::Restore(const v1::RestoreRequest& request, v1::CacheInfo* response) {
  RETURN_IF_ERROR(RequireId("cache_id", request.cache_id()));
  RETURN_IF_ERROR(CheckIdLength("snapshot_id", request.snapshot_id()));
  ASSIGN_OR_RETURN(engine::CacheInfo info,
                   engine_.Restore(request.cache_id(), request.snapshot_id(),
                                   request.target_offset()));
  ToProto(info, response);
  return absl::OkStatus();
}

absl::Status Handlers::MergeSnapshots(const v1::MergeSnapshotsRequest& request,
                                      v1::SnapshotInfo* response) {
  RETURN_IF_ERROR(RequireId("parent_id", request.parent_id()));
  RETURN_IF_ERROR(RequireId("child_id", request.child_id()));
  ASSIGN_OR_RETURN(engine::SnapshotInfo info,
                   engine_.MergeSnapshots(request.parent_id(), request.child_id()));
  ToProto(info, response);
  return absl::OkStatus();
}

absl::Status Handlers::SplitSnapshot(const v1::SplitSnapshotRequest& request,
                                     v1::SplitSnapshotResponse* response) {
  RETURN_IF_ERROR(RequireId("snapshot_id", request.snapshot_id()));
  ASSIGN_OR_RETURN(auto halves, engine_.SplitSnapshot(request.snapshot_id(), request.at()));
  ToProto(halves.first, response->mutable_parent());
  ToProto(halves.second, response->mutable_child());
  return absl::OkStatus();
}

absl::Status Handlers::ReleaseSnapshot(const v1::ReleaseSnapshotRequest& request,
                                       v1::ReleaseSnapshotResponse*) {
  RETURN_IF_ERROR(RequireId("snapshot_id", request.snapshot_id()));
  return engine_.ReleaseSnapshot(request.snapshot_id());
}

absl::Status Handlers::ListSnapshots(const v1::ListSnapshotsRequest& request,
                                     v1::ListSnapshotsResponse* response) {
  RETURN_IF_ERROR(CheckIdLength("cache_id", request.cache_id()));
  for (const engine::SnapshotInfo& info : engine_.ListSnapshots(request.cache_id())) {
    ToProto(info, response->add_snapshots());
  }
  return absl::OkStatus();
}

absl::Status Handlers::GetStats(const v1::GetStatsRequest&, v1::Stats* response) {
  ToProto(engine_.Stats(), response);
  response->set_device(options_.device_name);
  response->set_transfer_path(options_.transfer_path);
  response->set_data_lane_address(options_.data_lane_address);
  response->set_replica_name(options_.replica_name);
  const RequestLogCounts log = request_log_.Counts(absl::Now());
  response->set_request_log_entries(log.entries);
  response->set_request_log_bytes(log.bytes);
  response->set_requests_replayed(log.replayed);
  return absl::OkStatus();
}

absl::Status Handlers::RenewLease(const v1::RenewLeaseRequest& request,
                                  v1::RenewLeaseResponse* response) {
  const std::vector<std::string> cache_ids(request.cache_ids().begin(), request.cache_ids().end());
  const std::vector<std::string> snapshot_ids(request.snapshot_ids().begin(),
                                              request.snapshot_ids().end());
  for (size_t i = 0; i < cache_ids.size(); ++i) {
    RETURN_IF_ERROR(RequireId(absl::StrCat("cache_ids[", i, "]"), cache_ids[i]));
  }
  for (size_t i = 0; i < snapshot_ids.size(); ++i) {
    RETURN_IF_ERROR(RequireId(absl::StrCat("snapshot_ids[", i, "]"), snapshot_ids[i]));
  }
  ASSIGN_OR_RETURN(const engine::RenewedLeases renewed,
                   engine_.RenewLease(cache_ids, snapshot_ids));
  for (const engine::LeaseInfo& lease : renewed.caches) ToProto(lease, response->add_caches());
  for (const engine::LeaseInfo& lease : renewed.snapshots) {
    ToProto(lease, response->add_snapshots());
  }
  return absl::OkStatus();
}

absl::Status Handlers::EvictSnapshots(const v1::EvictSnapshotsRequest& request,
                                      v1::EvictSnapshotsResponse* response) {
  ASSIGN_OR_RETURN(const uint32_t moved, engine_.EvictIdleBytes(request.bytes()));
  response->set_pages_moved(moved);
  response->set_bytes_moved(uint64_t{moved} * engine_.pool().page_bytes());
  return absl::OkStatus();
}

absl::Status Handlers::SetPinned(const v1::SetPinnedRequest& request, v1::SnapshotInfo* response) {
  RETURN_IF_ERROR(RequireId("snapshot_id", request.snapshot_id()));
  ASSIGN_OR_RETURN(const engine::SnapshotInfo info,
                   engine_.SetPinned(request.snapshot_id(), request.pinned()));
  ToProto(info, response);
  return absl::OkStatus();
}

}  // namespace kvcache::service
