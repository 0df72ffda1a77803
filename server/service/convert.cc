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

}  // namespace kvcache::service
