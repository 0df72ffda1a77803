#include "engine/cache_spec.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

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

absl::Status ValidateLayer(const LayerSpec& layer, size_t index, const SpecLimits& limits) {
  const std::string at = absl::StrCat("layers[", index, "]");
  if (auto s = CheckRange(at + ".num_kv_heads", layer.num_kv_heads, 1, limits.max_kv_heads); !s.ok()) {
    return s;
  }
  if (auto s = CheckRange(at + ".k_head_dim", layer.k_head_dim, 1, limits.max_head_dim); !s.ok()) {
    return s;
  }
  if (auto s = CheckRange(at + ".v_head_dim", layer.v_head_dim, 0, limits.max_head_dim); !s.ok()) {
    return s;
  }
  if (const auto* rotating = std::get_if<RotatingKind>(&layer.kind)) {
    if (auto s = CheckRange(at + ".rotating.max_size", rotating->max_size, 1, limits.max_window);
        !s.ok()) {
      return s;
    }
    if (rotating->keep >= rotating->max_size) {
      return Invalid(at + ".rotating.keep",
                     absl::StrFormat("%d must be below max_size (%d)", rotating->keep,
                                     rotating->max_size));
    }
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
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    if (auto s = ValidateLayer(spec.layers[i], i, limits); !s.ok()) return s;
  }
  return absl::OkStatus();
}

CacheSpec NormalizeSpec(CacheSpec spec) {
  for (LayerSpec& layer : spec.layers) {
    if (layer.v_head_dim == 0) layer.v_head_dim = layer.k_head_dim;
  }
  return spec;
}

namespace {
bool SameKind(const LayerSpec& a, const LayerSpec& b) {
  if (a.kind.index() != b.kind.index()) return false;
  const auto* ra = std::get_if<RotatingKind>(&a.kind);
  const auto* rb = std::get_if<RotatingKind>(&b.kind);
  return ra == nullptr || (ra->max_size == rb->max_size && ra->keep == rb->keep);
}
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

uint64_t PageGeometry::token_bytes() const {
  return uint64_t{batch} * heads * (k_dim + v_dim) * elem_bytes;
}

uint64_t PageGeometry::v_base() const {
  return uint64_t{batch} * heads * page_tokens * k_dim * elem_bytes;
}

uint64_t PageGeometry::KOffset(uint32_t row_head, uint32_t slot) const {
  return (uint64_t{row_head} * page_tokens + slot) * k_dim * elem_bytes;
}

uint64_t PageGeometry::VOffset(uint32_t row_head, uint32_t slot) const {
  return v_base() + (uint64_t{row_head} * page_tokens + slot) * v_dim * elem_bytes;
}

absl::StatusOr<PageGeometry> GeometryFor(const CacheSpec& spec, size_t layer, uint64_t page_bytes,
                                         uint32_t max_page_tokens) {
  const LayerSpec& l = spec.layers[layer];
  PageGeometry geometry{.batch = spec.batch_size,
                        .heads = l.num_kv_heads,
                        .k_dim = l.k_head_dim,
                        .v_dim = l.v_head_dim == 0 ? l.k_head_dim : l.v_head_dim,
                        .elem_bytes = DTypeSize(spec.dtype),
                        .page_tokens = 1};
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
