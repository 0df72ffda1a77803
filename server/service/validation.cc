#include "service/validation.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvcache::service {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

absl::Status CheckTensor(absl::string_view name, const v1::Tensor& tensor, DType dtype,
                         const uint64_t (&expected)[4]) {
  if (tensor.dtype() != static_cast<int>(dtype)) {
    return Invalid(absl::StrCat(name, ".dtype"),
                   absl::StrCat(v1::DType_Name(tensor.dtype()), " but the cache holds ",
                                v1::DType_Name(static_cast<v1::DType>(dtype))));
  }
  if (tensor.shape_size() != 4) {
    return Invalid(absl::StrCat(name, ".shape"),
                   absl::StrFormat("[%s] must have 4 dimensions [B, H, L, D]",
                                   absl::StrJoin(tensor.shape(), ", ")));
  }
  static constexpr const char* kDims[] = {"B (batch_size)", "H (num_kv_heads)", "L (tokens)",
                                          "D (head dim)"};
  for (int d = 0; d < 4; ++d) {
    if (tensor.shape(d) != expected[d]) {
      return Invalid(absl::StrCat(name, ".shape[", d, "]"),
                     absl::StrFormat("%d, but %s must be %d", tensor.shape(d), kDims[d],
                                     expected[d]));
    }
  }
  const uint64_t bytes = expected[0] * expected[1] * expected[2] * expected[3] * DTypeSize(dtype);
  if (tensor.data().size() != bytes) {
    return Invalid(absl::StrCat(name, ".data"),
                   absl::StrFormat("%d bytes, but shape [%s] of %s is %d bytes",
                                   tensor.data().size(), absl::StrJoin(tensor.shape(), ", "),
                                   DTypeName(dtype), bytes));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RequireId(absl::string_view field, const std::string& id) {
  if (id.empty()) return Invalid(field, "required");
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> CheckKvTensors(const engine::CacheSpec& spec, uint32_t layer,
                                        const v1::Tensor& keys, const v1::Tensor& values) {
  if (layer >= spec.layers.size()) {
    return Invalid("layer", absl::StrFormat("%d is out of range; the cache has %d layers", layer,
                                            spec.layers.size()));
  }
  const engine::LayerSpec& l = spec.layers[layer];
  if (keys.shape_size() != 4) {
    return Invalid("keys.shape", "must have 4 dimensions [B, H, L, D]");
  }
  const uint64_t tokens = keys.shape(2);
  if (tokens == 0) return Invalid("keys.shape[2]", "an update needs at least one token");
  const uint64_t k_shape[4] = {spec.batch_size, l.num_kv_heads, tokens, l.k_head_dim};
  const uint64_t v_shape[4] = {spec.batch_size, l.num_kv_heads, tokens, l.v_head_dim};
  if (auto status = CheckTensor("keys", keys, spec.dtype, k_shape); !status.ok()) return status;
  if (auto status = CheckTensor("values", values, spec.dtype, v_shape); !status.ok()) {
    return status;
  }
  return tokens;
}

}  // namespace kvcache::service
