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
struct StandardKind {};
// mlx-lm RotatingKVCache: the first `keep` tokens (attention sinks) and the most
// recent ones, max_size in all (more, transiently, after a multi-token update).
struct RotatingKind {
  uint32_t max_size = 0;
  uint32_t keep = 0;
};

struct LayerSpec {
  uint32_t num_kv_heads = 0;
  uint32_t k_head_dim = 0;
  uint32_t v_head_dim = 0;  // 0 means k_head_dim
  std::variant<StandardKind, RotatingKind> kind;
};

struct CacheSpec {
  std::vector<LayerSpec> layers;
  DType dtype = DType::kFloat16;
  uint32_t batch_size = 1;
  std::string model;
};

// Upper bounds on what one cache may ask for; the server exposes them as flags.
struct SpecLimits {
  uint32_t max_layers = 1024;
  uint32_t max_kv_heads = 1024;
  uint32_t max_head_dim = 4096;
  uint32_t max_batch_size = 1024;
  uint32_t max_window = 1u << 24;
};

// INVALID_ARGUMENT naming the offending field ("spec.layers[2].rotating.keep")
// unless every layer is well formed and within `limits`.
absl::Status ValidateSpec(const CacheSpec& spec, const SpecLimits& limits);

// Fills in defaults (v_head_dim 0 -> k_head_dim). Call after ValidateSpec.
CacheSpec NormalizeSpec(CacheSpec spec);

bool SameLayout(const CacheSpec& a, const CacheSpec& b);

// Where a layer's K and V bytes sit inside one page of P tokens:
//
//   page = [ K: B x H x P x Dk elements | V: B x H x P x Dv elements | slack ]
//   K(b, h, slot) at ((b*H + h)*P + slot) * Dk * elem_bytes
//   V(b, h, slot) at v_base + ((b*H + h)*P + slot) * Dv * elem_bytes
//
// so the tokens [s0, s1) of one (row, head) are one contiguous run, as are the
// same tokens of that (row, head) in a [B, H, L, D] tensor: a copy of L tokens is
// B*H runs for K and B*H for V per page touched.
struct PageGeometry {
  uint32_t batch = 1;
  uint32_t heads = 1;
  uint32_t k_dim = 1;
  uint32_t v_dim = 1;
  uint32_t elem_bytes = 2;
  uint32_t page_tokens = 1;

  uint64_t token_bytes() const;  // K+V bytes of one token, all rows and heads
  uint64_t used_bytes() const { return token_bytes() * page_tokens; }
  uint64_t v_base() const;
  uint64_t KOffset(uint32_t row_head, uint32_t slot) const;
  uint64_t VOffset(uint32_t row_head, uint32_t slot) const;
  uint64_t KBytes(uint64_t tokens) const { return tokens * batch * heads * k_dim * elem_bytes; }
  uint64_t VBytes(uint64_t tokens) const { return tokens * batch * heads * v_dim * elem_bytes; }
};

// The geometry of `layer` in pages of `page_bytes`, with at most `max_page_tokens`
// tokens per page; INVALID_ARGUMENT naming `field` if one token does not fit.
absl::StatusOr<PageGeometry> GeometryFor(const CacheSpec& spec, size_t layer, uint64_t page_bytes,
                                         uint32_t max_page_tokens);

}  // namespace kvcache::engine
