#include "service/validation.h"

#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "core/client_text.h"
#include "core/status_macros.h"
#include "core/tensor_size.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcache::service {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

// One dimension a tensor must have: its name in the shape's outline, its name
// in errors, and its size.
struct Dim {
  const char* label;
  const char* meaning;
  uint64_t size;
};

std::string DTypeLabel(int32_t dtype) {
  const std::string& name = v1::DType_Name(static_cast<v1::DType>(dtype));
  return name.empty() ? absl::StrCat("dtype ", dtype) : name;
}

absl::Status CheckTensor(absl::string_view name, const TensorView& tensor, DType dtype,
                         absl::Span<const Dim> dims) {
  if (tensor.dtype != static_cast<int32_t>(dtype)) {
    return Invalid(absl::StrCat(name, ".dtype"),
                   absl::StrCat(DTypeLabel(tensor.dtype), " but the cache holds ",
                                DTypeLabel(static_cast<int32_t>(dtype))));
  }
  const std::string shape = absl::StrJoin(tensor.shape, ", ");
  if (tensor.shape.size() != dims.size()) {
    return Invalid(absl::StrCat(name, ".shape"),
                   absl::StrFormat("[%s] must have %d dimensions [%s]", shape, dims.size(),
                                   absl::StrJoin(dims, ", ", [](std::string* out, const Dim& d) {
                                     out->append(d.label);
                                   })));
  }
  for (size_t d = 0; d < dims.size(); ++d) {
    if (tensor.shape[d] != dims[d].size) {
      return Invalid(absl::StrCat(name, ".shape[", d, "]"),
                     absl::StrFormat("%d, but %s must be %d", tensor.shape[d], dims[d].meaning,
                                     dims[d].size));
    }
  }
  const uint64_t bytes = TensorByteSize(dtype, tensor.shape);
  if (tensor.data.size() != bytes) {
    return Invalid(absl::StrCat(name, ".data"),
                   absl::StrFormat("%d bytes, but shape [%s] of %s is %s bytes",
                                   tensor.data.size(), shape, DTypeName(dtype),
                                   bytes == kUnaddressableBytes ? "over 2^64"
                                                                : absl::StrCat(bytes)));
  }
  return absl::OkStatus();
}

const TensorView& OrAbsent(const std::optional<TensorView>& tensor) {
  static const TensorView* const kAbsent = new TensorView;
  return tensor.has_value() ? *tensor : *kAbsent;
}

}  // namespace

absl::Status RequireId(absl::string_view field, const std::string& id) {
  if (id.empty()) return Invalid(field, "required");
  return CheckIdLength(field, id);
}

absl::Status CheckIdLength(absl::string_view field, absl::string_view id) {
  // Refused before any lookup, so that neither the answer nor its time
  // depends on what a too-long id holds.
  if (id.size() > kMaxIdBytes) {
    return Invalid(field,
                   absl::StrFormat("%d bytes; an id has at most %d", id.size(), kMaxIdBytes));
  }
  return absl::OkStatus();
}

absl::Status CheckLayerIndex(const engine::CacheSpec& spec, uint32_t layer) {
  if (layer >= spec.layers.size()) {
    return Invalid("layer", absl::StrFormat("%d is out of range; the cache has %d layers", layer,
                                            spec.layers.size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> CheckKvUpdate(const engine::CacheSpec& spec, const UpdateView& request) {
  if (request.state.has_value()) {
    return Invalid("state", absl::StrFormat("layer %d is an attention layer: send keys and "
                                            "values, not a recurrent state",
                                            request.layer));
  }
  const TensorView& keys = OrAbsent(request.keys);
  const TensorView& values = OrAbsent(request.values);
  if (keys.shape.size() != 4) {
    return Invalid("keys.shape", absl::StrFormat("[%s] must have 4 dimensions [B, H, L, D]",
                                                 absl::StrJoin(keys.shape, ", ")));
  }
  const uint64_t tokens = keys.shape[2];
  if (tokens == 0) return Invalid("keys.shape[2]", "an update needs at least one token");
  const engine::LayerSpec& l = spec.layers[request.layer];
  const Dim b{"B", "B (batch_size)", spec.batch_size}, h{"H", "H (num_kv_heads)", l.num_kv_heads},
      t{"L", "L (tokens)", tokens};
  const Dim k_dims[] = {b, h, t, {"D", "D (head dim)", l.k_head_dim}};
  const Dim v_dims[] = {b, h, t, {"D", "D (head dim)", l.v_head_dim}};
  RETURN_IF_ERROR(CheckTensor("keys", keys, spec.dtype, k_dims));
  RETURN_IF_ERROR(CheckTensor("values", values, spec.dtype, v_dims));
  return tokens;
}

absl::Status CheckStateUpdate(const engine::CacheSpec& spec, const UpdateView& request) {
  const auto not_kv = [&](absl::string_view field) {
    return Invalid(field, absl::StrFormat("layer %d is recurrent: send its state, not keys and "
                                          "values",
                                          request.layer));
  };
  if (request.keys.has_value()) return not_kv("keys");
  if (request.values.has_value()) return not_kv("values");
  if (!request.state.has_value()) {
    return Invalid("state", absl::StrFormat("required: layer %d is recurrent", request.layer));
  }
  const auto& r = std::get<engine::RecurrentKind>(spec.layers[request.layer].kind);
  const Dim b{"B", "B (batch_size)", spec.batch_size};
  const Dim conv_dims[] = {b, {"conv_tail", "conv_tail", r.conv_tail},
                           {"conv_dim", "conv_dim", r.conv_dim}};
  const Dim delta_dims[] = {b, {"Hv", "num_v_heads", r.num_v_heads},
                            {"Dv", "head_v_dim", r.head_v_dim}, {"Dk", "head_k_dim", r.head_k_dim}};
  const StateView& state = *request.state;
  RETURN_IF_ERROR(CheckTensor("state.conv_state", state.conv_state, spec.dtype, conv_dims));
  return CheckTensor("state.delta_state", state.delta_state, spec.dtype, delta_dims);
}

}  // namespace kvcache::service
