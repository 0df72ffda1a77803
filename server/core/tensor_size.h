// A tensor's size in bytes, computed in one place for every layer above.
#pragma once

#include <cstdint>

#include "absl/types/span.h"
#include "core/dtype.h"

namespace kvcache {

// What TensorByteSize answers where a tensor's true size reaches 2^64 (no
// message or page holds one). No true size equals it: every element size is even.
inline constexpr uint64_t kUnaddressableBytes = UINT64_MAX;

// Bytes of a tensor of `dtype` and `shape`: the element size times every
// dimension, or kUnaddressableBytes where that reaches 2^64. The one place a
// tensor's size is computed, for the service's checks and its Fetch chunks.
constexpr uint64_t TensorByteSize(DType dtype, absl::Span<const uint64_t> shape) {
  for (uint64_t dim : shape) {
    if (dim == 0) return 0;  // empty, however large the other dimensions
  }
  uint64_t bytes = DTypeSize(dtype);
  for (uint64_t dim : shape) {
    if (__builtin_mul_overflow(bytes, dim, &bytes)) return kUnaddressableBytes;
  }
  return bytes;
}

}  // namespace kvcache
