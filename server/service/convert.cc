#include "service/convert.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvcache::service {

absl::StatusOr<engine::CacheSpec> FromProto(const v1::CacheSpec& spec) {
  engine::CacheSpec out;
  if (!IsValidDType(spec.dtype())) {
    return absl::InvalidArgumentError("spec.dtype: must be FLOAT32, FLOAT16 or BFLOAT16");
  }
  out.dtype = static_cast<DType>(spec.dtype());
  out.batch_size = spec.batch_size() == 0 ? 1 : spec.batch_size();
  out.model = spec.model();
  out.left_padding.assign(spec.left_padding().begin(), spec.left_padding().end());
  for (int i = 0; i < spec.layers_size(); ++i) {
    const v1::LayerSpec& layer = spec.layers(i);
    engine::LayerSpec converted{.num_kv_heads = layer.num_kv_heads(),
                                .k_head_dim = layer.k_head_dim(),
                                .v_head_dim = layer.v_head_dim()};
    switch (layer.kind_case()) {
      case v1::LayerSpec::kStandard:
        converted.kind = engine::StandardKind{};
        break;
      case v1::LayerSpec::kRotating:
        converted.kind = engine::RotatingKind{.max_size = layer.rotating().max_size(),
                                              .keep = layer.rotating().keep()};
        break;
      case v1::LayerSpec::kQuantized:
        converted.kind = engine::QuantizedKind{.group_size = layer.quantized().group_size(),
                                               .bits = layer.quantized().bits()};
        break;
      case v1::LayerSpec::kChunked:
        converted.kind = engine::ChunkedKind{.chunk_size = layer.chunked().chunk_size()};
        break;
      case v1::LayerSpec::kRecurrent: {
        const v1::RecurrentLayer& r = layer.recurrent();
        converted.kind = engine::RecurrentKind{.conv_tail = r.conv_tail(),
                                               .conv_dim = r.conv_dim(),
                                               .num_v_heads = r.num_v_heads(),
                                               .head_v_dim = r.head_v_dim(),
                                               .head_k_dim = r.head_k_dim()};
        break;
      }
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "spec.layers[", i, "].kind: set standard, rotating, quantized, chunked or recurrent"));
    }
    out.layers.push_back(converted);
  }
  return out;
}

namespace {

struct KindToProto {
  v1::LayerSpec* out;
  void operator()(const engine::StandardKind&) const { out->mutable_standard(); }
  void operator()(const engine::RotatingKind& k) const {
    out->mutable_rotating()->set_max_size(k.max_size);
    out->mutable_rotating()->set_keep(k.keep);
  }
  void operator()(const engine::QuantizedKind& k) const {
    out->mutable_quantized()->set_group_size(k.group_size);
    out->mutable_quantized()->set_bits(k.bits);
  }
  void operator()(const engine::ChunkedKind& k) const {
    out->mutable_chunked()->set_chunk_size(k.chunk_size);
  }
  void operator()(const engine::RecurrentKind& k) const {
    v1::RecurrentLayer* r = out->mutable_recurrent();
    r->set_conv_tail(k.conv_tail);
    r->set_conv_dim(k.conv_dim);
    r->set_num_v_heads(k.num_v_heads);
    r->set_head_v_dim(k.head_v_dim);
    r->set_head_k_dim(k.head_k_dim);
  }
};

void SetKind(const decltype(engine::LayerSpec::kind)& kind, v1::LayerSpec* out) {
  std::visit(KindToProto{out}, kind);
}

}  // namespace

v1::DType ToProto(DType dtype) { return static_cast<v1::DType>(dtype); }

void ToProto(const engine::CacheSpec& spec, v1::CacheSpec* out) {
  out->set_dtype(ToProto(spec.dtype));
  out->set_batch_size(spec.batch_size);
  out->set_model(spec.model);
  for (uint32_t pad : spec.left_padding) out->add_left_padding(pad);
  for (const engine::LayerSpec& layer : spec.layers) {
    v1::LayerSpec* converted = out->add_layers();
    converted->set_num_kv_heads(layer.num_kv_heads);
    converted->set_k_head_dim(layer.k_head_dim);
    converted->set_v_head_dim(layer.v_head_dim);
    SetKind(layer.kind, converted);
  }
}

namespace {

// ttl_seconds is uint32: a longer lease (set by a flag, not a request) shows
// as the longest it can say instead of wrapping.
uint32_t TtlSeconds(absl::Duration ttl) {
  return static_cast<uint32_t>(
      std::clamp<int64_t>(absl::ToInt64Seconds(ttl), 0, std::numeric_limits<uint32_t>::max()));
}

}  // namespace

void ToProto(absl::Time time, google::protobuf::Timestamp* out) {
  const int64_t nanos = absl::ToUnixNanos(time);
  out->set_seconds(nanos / 1'000'000'000);
  out->set_nanos(static_cast<int32_t>(nanos % 1'000'000'000));
}

void ToProto(const engine::CacheInfo& info, v1::CacheInfo* out) {
  out->set_cache_id(info.cache_id);
  ToProto(info.spec, out->mutable_spec());
  for (uint64_t offset : info.layer_offsets) out->add_layer_offsets(offset);
  out->set_offset(info.offset);
  out->set_size_bytes(info.size_bytes);
  out->set_in_step(info.in_step);
  out->set_ttl_seconds(TtlSeconds(info.ttl));
  if (info.expires_at != absl::InfiniteFuture())
    ToProto(info.expires_at, out->mutable_expires_at());
}

void ToProto(const engine::SnapshotInfo& info, v1::SnapshotInfo* out) {
  out->set_snapshot_id(info.snapshot_id);
  out->set_cache_id(info.cache_id);
  out->set_from_offset(info.from_offset);
  out->set_to_offset(info.to_offset);
  out->set_size_bytes(info.size_bytes);
  out->set_device_bytes(info.tiers.device);
  out->set_host_bytes(info.tiers.host);
  out->set_disk_bytes(info.tiers.disk);
  out->set_pinned(info.pinned);
  out->set_ttl_seconds(TtlSeconds(info.ttl));
  if (info.expires_at != absl::InfiniteFuture())
    ToProto(info.expires_at, out->mutable_expires_at());
}

void ToProto(const engine::LeaseInfo& lease, v1::Lease* out) {
  out->set_id(lease.id);
  out->set_ttl_seconds(TtlSeconds(lease.ttl));
  if (lease.expires_at != absl::InfiniteFuture()) {
    ToProto(lease.expires_at, out->mutable_expires_at());
  }
}

void ToProto(const engine::EngineStats& stats, v1::Stats* out) {
  out->set_page_bytes(stats.pool.page_bytes);
  out->set_pages_total(stats.pool.max_pages);
  out->set_pages_used(stats.pool.used_pages);
  out->set_pool_bytes_total(uint64_t{stats.pool.max_pages} * stats.pool.page_bytes);
  out->set_pool_bytes_used(uint64_t{stats.pool.used_pages} * stats.pool.page_bytes);
  out->set_caches(stats.caches);
  out->set_snapshots(stats.snapshots);
  out->set_evictions(stats.pool.evictions);
  out->set_host_pages_used(stats.pool.host_pages);
  out->set_host_pages_total(stats.pool.max_host_pages);
  out->set_disk_pages_used(stats.pool.disk_pages);
  out->set_disk_pages_total(stats.pool.max_disk_pages);
  out->set_demotions(stats.pool.demotions);
  out->set_promotions_from_host(stats.pool.promotions_from_host);
  out->set_promotions_from_disk(stats.pool.promotions_from_disk);
  out->set_caches_expired(stats.caches_expired);
  out->set_snapshots_expired(stats.snapshots_expired);
  out->set_pinned_bytes(stats.pinned_bytes);
  out->set_max_pinned_bytes(stats.max_pinned_bytes);
  out->set_metadata_bytes(stats.metadata_bytes);
  out->set_max_metadata_bytes(stats.max_metadata_bytes);
  out->set_prefix_entries(stats.prefixes.entries);
  out->set_prefix_tokens(stats.prefixes.stored_tokens);
  out->set_prefix_lookups(stats.prefixes.lookups);
  out->set_prefix_hits(stats.prefixes.hits);
  out->set_prefix_matched_tokens(stats.prefixes.matched_tokens);
  out->set_prefix_entries_dropped(stats.prefixes.dropped);
  const uint64_t page_bytes = stats.pool.page_bytes;
  out->set_tenant_device_bytes(stats.account.device_pages * page_bytes);
  out->set_tenant_host_bytes(stats.account.host_pages * page_bytes);
  out->set_tenant_disk_bytes(stats.account.disk_pages * page_bytes);
  out->set_tenant_max_device_bytes(stats.account.limits.device_pages * page_bytes);
  out->set_tenant_max_host_bytes(stats.account.limits.host_pages * page_bytes);
  out->set_tenant_max_disk_bytes(stats.account.limits.disk_pages * page_bytes);
  out->set_saved_bytes(stats.saved_bytes);
  out->set_max_saved_bytes(stats.max_saved_bytes);
}

}  // namespace kvcache::service
