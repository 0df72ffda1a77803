// What a cache is made of: the engine's mirror of kvcache.v1.CacheSpec (engine/
// knows no protobuf), its validation, and how each layer's tokens lie in a page.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace kvcache::engine {

// mlx-lm KVCache / ollama KVCache: every token is kept.
struct StandardKind {
  bool operator==(const StandardKind&) const = default;
};
// mlx-lm RotatingKVCache: the first `keep` tokens (attention sinks) and the most
// recent ones, max_size in all (more, transiently, after a multi-token update).
struct RotatingKind {
  uint32_t max_size = 0;
  uint32_t keep = 0;
  bool operator==(const RotatingKind&) const = default;
};
// mlx-lm QuantizedKVCache: K/V stored affine-quantized per group of group_size
// values along head_dim, bits per value, scales and biases in the cache dtype.
struct QuantizedKind {
  uint32_t group_size = 64;
  uint32_t bits = 8;
  bool operator==(const QuantizedKind&) const = default;
};
// mlx-lm ChunkedKVCache: every token is kept until the front is trimmed to the
// last chunk_size tokens (start_position moves up).
struct ChunkedKind {
  uint32_t chunk_size = 0;
  bool operator==(const ChunkedKind&) const = default;
};
// ollama RecurrentCache / mlx-lm ArraysCache(2): no K/V, a conv state
// [B, conv_tail, conv_dim] and a delta state [B, num_v_heads, head_v_dim,
// head_k_dim], replaced whole by each update.
struct RecurrentKind {
  uint32_t conv_tail = 0;
  uint32_t conv_dim = 0;
  uint32_t num_v_heads = 0;
  uint32_t head_v_dim = 0;
  uint32_t head_k_dim = 0;
  bool operator==(const RecurrentKind&) const = default;
};

struct LayerSpec {
  uint32_t num_kv_heads = 0;
  uint32_t k_head_dim = 0;
  uint32_t v_head_dim = 0;  // 0 means k_head_dim
  std::variant<StandardKind, RotatingKind, QuantizedKind, ChunkedKind, RecurrentKind> kind;
};

inline bool IsRecurrent(const LayerSpec& layer) {
  return std::holds_alternative<RecurrentKind>(layer.kind);
}

struct CacheSpec {
  std::vector<LayerSpec> layers;
  DType dtype = DType::kFloat16;
  uint32_t batch_size = 1;
  std::string model;
  // mlx-lm BatchKVCache: per row, how many leading positions are padding
  // (empty: none). Row r's own sequence starts at position left_padding[r].
  std::vector<uint32_t> left_padding;
};

// Upper bounds on what one cache may ask for; the server exposes them as flags.
struct SpecLimits {
  uint32_t max_layers = 1024;
  uint32_t max_kv_heads = 1024;
  uint32_t max_head_dim = 4096;
  uint32_t max_batch_size = 1024;
  uint32_t max_window = 1u << 24;
  uint32_t max_state_dim = 1u << 20;  // recurrent conv_dim
};

// INVALID_ARGUMENT naming the offending field ("spec.layers[2].rotating.keep")
// unless every layer is well formed and within `limits`.
absl::Status ValidateSpec(const CacheSpec& spec, const SpecLimits& limits);

// Fills in defaults (v_head_dim 0 -> k_head_dim). Call after ValidateSpec.
CacheSpec NormalizeSpec(CacheSpec spec);

bool SameLayout(const CacheSpec& a, const CacheSpec& b);

// Where a layer's K and V bytes sit inside one page of P tokens. A page is a
// sequence of planes; each plane holds one row of row_bytes per (row, head, slot):
//
//   page = [ plane 0 | plane 1 | ... | slack ]
//   plane i = B x H x P rows of PlaneRowBytes(i) bytes
//   row (b, h, slot) of plane i at PlaneBase(i) + ((b*H + h)*P + slot) * PlaneRowBytes(i)
//
//   standard:  planes K [Dk elements], V [Dv elements]
//   quantized: planes K wq [Dk*bits/32 words], K scales [Dk/group], K biases [Dk/group],
//                     then the same three for V
//
// so the tokens [s0, s1) of one (row, head) are one contiguous run in each plane,
// as are the same tokens of that (row, head) in a [B, H, L, D] tensor: a copy of
// L tokens is B*H runs per plane per page touched.
struct PageGeometry {
  uint32_t batch = 1;
  uint32_t heads = 1;
  uint32_t k_dim = 1;
  uint32_t v_dim = 1;
  uint32_t elem_bytes = 2;
  uint32_t page_tokens = 1;
  // Quantized layers (mlx affine); bits == 0 means plain elements.
  uint32_t group_size = 0;
  uint32_t bits = 0;
  // The element type (quantized layers convert values on the device).
  DType dtype = DType::kFloat16;

  bool quantized() const { return bits != 0; }
  uint32_t num_planes() const { return quantized() ? 6 : 2; }
  // The first plane of V (K's planes come first).
  uint32_t first_v_plane() const { return num_planes() / 2; }
  uint64_t PlaneRowBytes(uint32_t plane) const;
  uint64_t PlaneBase(uint32_t plane) const;
  uint64_t PlaneOffset(uint32_t plane, uint32_t row_head, uint32_t slot) const;

  uint64_t token_bytes() const;  // bytes of one token, all rows, heads and planes
  uint64_t used_bytes() const { return token_bytes() * page_tokens; }
  // Unquantized layers: the K and V planes.
  uint64_t KOffset(uint32_t row_head, uint32_t slot) const { return PlaneOffset(0, row_head, slot); }
  uint64_t VOffset(uint32_t row_head, uint32_t slot) const { return PlaneOffset(1, row_head, slot); }
  // Bytes of L tokens of K / V as [B, H, L, D] tensors in the cache dtype.
  uint64_t KBytes(uint64_t tokens) const { return tokens * batch * heads * k_dim * elem_bytes; }
  uint64_t VBytes(uint64_t tokens) const { return tokens * batch * heads * v_dim * elem_bytes; }
};

// The geometry of `layer` in pages of `page_bytes`, with at most `max_page_tokens`
// tokens per page; INVALID_ARGUMENT naming `field` if one token does not fit.
absl::StatusOr<PageGeometry> GeometryFor(const CacheSpec& spec, size_t layer, uint64_t page_bytes,
                                         uint32_t max_page_tokens);

}  // namespace kvcache::engine
