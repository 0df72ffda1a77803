// The format of one mlx affine-quantized tensor side (keys or values): rows of
// `dim` values, quantized per group of `group_size` along the row.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace kvcache::gpu {

struct QuantFormat {
  DType dtype = DType::kFloat16;  // of the values, scales and biases
  uint32_t dim = 0;               // values per row: a multiple of group_size
  uint32_t group_size = 64;       // 32, 64 or 128
  uint32_t bits = 8;              // 4 or 8

  uint64_t row_bytes() const { return uint64_t{dim} * DTypeSize(dtype); }
  uint64_t wq_row_bytes() const { return uint64_t{dim} * bits / 8; }
  uint64_t scale_row_bytes() const { return uint64_t{dim} / group_size * DTypeSize(dtype); }
};

}  // namespace kvcache::gpu
