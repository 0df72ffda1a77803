#include "service/convert.h"

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
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("spec.layers[", i, "].kind: set standard or rotating"));
    }
    out.layers.push_back(converted);
  }
  return out;
}

v1::DType ToProto(DType dtype) { return static_cast<v1::DType>(dtype); }

void ToProto(const engine::CacheSpec& spec, v1::CacheSpec* out) {
  out->set_dtype(ToProto(spec.dtype));
  out->set_batch_size(spec.batch_size);
  out->set_model(spec.model);
  for (const engine::LayerSpec& layer : spec.layers) {
    v1::LayerSpec* converted = out->add_layers();
    converted->set_num_kv_heads(layer.num_kv_heads);
    converted->set_k_head_dim(layer.k_head_dim);
    converted->set_v_head_dim(layer.v_head_dim);
    if (const auto* rotating = std::get_if<engine::RotatingKind>(&layer.kind)) {
      converted->mutable_rotating()->set_max_size(rotating->max_size);
      converted->mutable_rotating()->set_keep(rotating->keep);
    } else {
      converted->mutable_standard();
    }
  }
}

void ToProto(const engine::CacheInfo& info, v1::CacheInfo* out) {
  out->set_cache_id(info.cache_id);
  ToProto(info.spec, out->mutable_spec());
  for (uint64_t offset : info.layer_offsets) out->add_layer_offsets(offset);
  out->set_offset(info.offset);
  out->set_size_bytes(info.size_bytes);
  out->set_in_step(info.in_step);
}

void ToProto(const engine::SnapshotInfo& info, v1::SnapshotInfo* out) {
  out->set_snapshot_id(info.snapshot_id);
  out->set_cache_id(info.cache_id);
  out->set_from_offset(info.from_offset);
  out->set_to_offset(info.to_offset);
  out->set_size_bytes(info.size_bytes);
  out->set_pinned(info.pinned);
}

}  // namespace kvcache::service
