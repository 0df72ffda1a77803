#include "engine/layers/cache_spec.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"

namespace kvcache::engine {
namespace {

absl::Status Invalid(const std::string& field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("spec.", field, ": ", why));
}

absl::Status CheckRange(const std::string& field, uint64_t value, uint64_t low, uint64_t high) {
  if (value < low || value > high) {
    return Invalid(field, absl::StrFormat("%d is outside [%d, %d]", value, low, high));
  }
  return absl::OkStatus();
}

absl::Status ValidateAttentionDims(const LayerSpec& layer, const std::string& at,
                                   const SpecLimits& limits) {
  RETURN_IF_ERROR(CheckRange(at + ".num_kv_heads", layer.num_kv_heads, 1, limits.max_kv_heads));
  RETURN_IF_ERROR(CheckRange(at + ".k_head_dim", layer.k_head_dim, 1, limits.max_head_dim));
  return CheckRange(at + ".v_head_dim", layer.v_head_dim, 0, limits.max_head_dim);
}

absl::Status ValidateRotating(const RotatingKind& rotating, const std::string& at, bool padded,
                              const SpecLimits& limits) {
  RETURN_IF_ERROR(CheckRange(at + ".rotating.max_size", rotating.max_size, 1, limits.max_window));
  if (rotating.keep >= rotating.max_size) {
    return Invalid(at + ".rotating.keep", absl::StrFormat("%d must be below max_size (%d)",
                                                          rotating.keep, rotating.max_size));
  }
  // mlx-lm BatchRotatingKVCache keeps no sinks: with left padding they would be padding.
  if (padded && rotating.keep != 0) {
    return Invalid(at + ".rotating.keep", "must be 0 in a cache with left_padding");
  }
  return absl::OkStatus();
}

// mlx affine quantization: group_size divides both head dims; bits 4 or 8.
absl::Status ValidateQuantized(const QuantizedKind& q, const LayerSpec& layer,
                               const std::string& at) {
  const uint32_t g = q.group_size;
  if (g != 32 && g != 64 && g != 128) {
    return Invalid(at + ".quantized.group_size", absl::StrFormat("%d is not 32, 64 or 128", g));
  }
  if (q.bits != 4 && q.bits != 8) {
    return Invalid(at + ".quantized.bits", absl::StrFormat("%d is not 4 or 8", q.bits));
  }
  const uint32_t v_dim = layer.v_head_dim == 0 ? layer.k_head_dim : layer.v_head_dim;
  for (auto [field, dim] : {std::pair{".k_head_dim", layer.k_head_dim}, std::pair{".v_head_dim", v_dim}}) {
    if (dim % g != 0) {
      return Invalid(at + field, absl::StrFormat("%d is not a multiple of quantized.group_size %d",
                                                 dim, g));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateRecurrent(const RecurrentKind& r, const std::string& at,
                               const SpecLimits& limits) {
  const std::string base = at + ".recurrent.";
  RETURN_IF_ERROR(CheckRange(base + "conv_tail", r.conv_tail, 1, limits.max_head_dim));
  RETURN_IF_ERROR(CheckRange(base + "conv_dim", r.conv_dim, 1, limits.max_state_dim));
  RETURN_IF_ERROR(CheckRange(base + "num_v_heads", r.num_v_heads, 1, limits.max_kv_heads));
  RETURN_IF_ERROR(CheckRange(base + "head_v_dim", r.head_v_dim, 1, limits.max_head_dim));
  return CheckRange(base + "head_k_dim", r.head_k_dim, 1, limits.max_head_dim);
}

absl::Status ValidateLayer(const LayerSpec& layer, size_t index, bool padded,
                           const SpecLimits& limits) {
  const std::string at = absl::StrCat("layers[", index, "]");
  if (const auto* recurrent = std::get_if<RecurrentKind>(&layer.kind)) {
    return ValidateRecurrent(*recurrent, at, limits);
  }
  RETURN_IF_ERROR(ValidateAttentionDims(layer, at, limits));
  if (const auto* rotating = std::get_if<RotatingKind>(&layer.kind)) {
    return ValidateRotating(*rotating, at, padded, limits);
  }
  if (const auto* quantized = std::get_if<QuantizedKind>(&layer.kind)) {
    return ValidateQuantized(*quantized, layer, at);
  }
  if (const auto* chunked = std::get_if<ChunkedKind>(&layer.kind)) {
    return CheckRange(at + ".chunked.chunk_size", chunked->chunk_size, 1, limits.max_window);
  }
  return absl::OkStatus();
}

absl::Status ValidateLeftPadding(const CacheSpec& spec, const SpecLimits& limits) {
  if (spec.left_padding.empty()) return absl::OkStatus();
  if (spec.left_padding.size() != spec.batch_size) {
    return Invalid("left_padding", absl::StrFormat("has %d entries for batch_size %d",
                                                   spec.left_padding.size(), spec.batch_size));
  }
  for (size_t r = 0; r < spec.left_padding.size(); ++r) {
    RETURN_IF_ERROR(CheckRange(absl::StrCat("left_padding[", r, "]"), spec.left_padding[r], 0,
                               limits.max_window));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateSpec(const CacheSpec& spec, const SpecLimits& limits) {
  if (spec.layers.empty()) return Invalid("layers", "a cache needs at least one layer");
  if (auto s = CheckRange("layers", spec.layers.size(), 1, limits.max_layers); !s.ok()) return s;
  if (!IsValidDType(static_cast<uint32_t>(spec.dtype))) {
    return Invalid("dtype", "must be FLOAT32, FLOAT16 or BFLOAT16");
  }
  if (auto s = CheckRange("batch_size", spec.batch_size, 1, limits.max_batch_size); !s.ok()) {
    return s;
  }
  RETURN_IF_ERROR(ValidateLeftPadding(spec, limits));
  // All-zero padding is no padding (NormalizeSpec drops it), so sinks stay allowed.
  const bool padded = std::any_of(spec.left_padding.begin(), spec.left_padding.end(),
                                  [](uint32_t pad) { return pad != 0; });
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    RETURN_IF_ERROR(ValidateLayer(spec.layers[i], i, padded, limits));
  }
  return absl::OkStatus();
}

CacheSpec NormalizeSpec(CacheSpec spec) {
  for (LayerSpec& layer : spec.layers) {
    if (IsRecurrent(layer)) {
      layer.num_kv_heads = layer.k_head_dim = layer.v_head_dim = 0;  // attention dims unused
    } else if (layer.v_head_dim == 0) {
      layer.v_head_dim = layer.k_head_dim;
    }
  }
  if (!spec.left_padding.empty() &&
      std::all_of(spec.left_padding.begin(), spec.left_padding.end(),
                  [](uint32_t pad) { return pad == 0; })) {
    spec.left_padding.clear();  // all zero is no padding
  }
  return spec;
}

namespace {
bool SameKind(const LayerSpec& a, const LayerSpec& b) { return a.kind == b.kind; }
}  // namespace

bool SameLayout(const CacheSpec& a, const CacheSpec& b) {
  if (a.dtype != b.dtype || a.batch_size != b.batch_size || a.layers.size() != b.layers.size()) {
    return false;
  }
  for (size_t i = 0; i < a.layers.size(); ++i) {
    const LayerSpec& x = a.layers[i];
    const LayerSpec& y = b.layers[i];
    if (x.num_kv_heads != y.num_kv_heads || x.k_head_dim != y.k_head_dim ||
        x.v_head_dim != y.v_head_dim || !SameKind(x, y)) {
      return false;
    }
  }
  return true;
}

uint64_t PageGeometry::PlaneRowBytes(uint32_t plane) const {
  const bool is_v = plane >= first_v_plane();
  const uint64_t dim = is_v ? v_dim : k_dim;
  if (!quantized()) return dim * elem_bytes;
  if (plane % 3 == 0) return dim * bits / 8;  // packed words
  return dim / group_size * elem_bytes;        // scales or biases
}

uint64_t PageGeometry::PlaneBase(uint32_t plane) const {
  uint64_t base = 0;
  for (uint32_t i = 0; i < plane; ++i) {
    base += uint64_t{batch} * heads * page_tokens * PlaneRowBytes(i);
  }
  return base;
}

uint64_t PageGeometry::PlaneOffset(uint32_t plane, uint32_t row_head, uint32_t slot) const {
  return PlaneBase(plane) + (uint64_t{row_head} * page_tokens + slot) * PlaneRowBytes(plane);
}

uint64_t PageGeometry::token_bytes() const {
  uint64_t row = 0;
  for (uint32_t i = 0; i < num_planes(); ++i) row += PlaneRowBytes(i);
  return uint64_t{batch} * heads * row;
}

absl::StatusOr<PageGeometry> GeometryFor(const CacheSpec& spec, size_t layer, uint64_t page_bytes,
                                         uint32_t max_page_tokens) {
  const LayerSpec& l = spec.layers[layer];
  if (IsRecurrent(l)) {
    return absl::InternalError("recurrent layers hold a state, not tokens in pages");
  }
  PageGeometry geometry{.batch = spec.batch_size,
                        .heads = l.num_kv_heads,
                        .k_dim = l.k_head_dim,
                        .v_dim = l.v_head_dim == 0 ? l.k_head_dim : l.v_head_dim,
                        .elem_bytes = DTypeSize(spec.dtype),
                        .page_tokens = 1,
                        .dtype = spec.dtype};
  if (const auto* quantized = std::get_if<QuantizedKind>(&l.kind)) {
    geometry.group_size = quantized->group_size;
    geometry.bits = quantized->bits;
  }
  const uint64_t fit = page_bytes / geometry.token_bytes();
  if (fit == 0) {
    return Invalid(absl::StrCat("layers[", layer, "]"),
                   absl::StrFormat("one token takes %d bytes (all rows and heads, K and V), more "
                                   "than a pool page (%d bytes); raise the page size",
                                   geometry.token_bytes(), page_bytes));
  }
  geometry.page_tokens = static_cast<uint32_t>(std::min<uint64_t>(fit, std::max(1u, max_page_tokens)));
  return geometry;
}

}  // namespace kvcache::engine
