// The CPU reference for mlx affine quantization (mlx's CPU `quantize` kernel,
// written from its algorithm): the GPU shader tests and the engine's reference
// model both check against it.
//
// Per group of group_size consecutive values w of a row, in float32:
//
//   scale = max((max(w) - min(w)) / (2^bits - 1), 1e-7), negated unless
//           |min(w)| > |max(w)|;  edge = the larger-magnitude end
//   q0 = rint(edge / scale);  if q0 != 0: scale = edge / q0, bias = edge (else 0)
//   q  = clamp(rint((w - bias) / scale), 0, 2^bits - 1)
//
// q packed little end first, 32/bits values per uint32 word (dim*bits/32 words a
// row); scale and bias rounded (to nearest even) to the input dtype. Dequantize:
// scale * q + bias in float32, rounded once to the dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/types/span.h"
#include "core/dtype.h"

namespace kvcache::testing {

struct RefQuantFormat {
  DType dtype = DType::kFloat16;
  uint32_t group_size = 64;
  uint32_t bits = 8;
};

// The three planes of `rows` quantized rows of `dim` values each.
struct RefPacked {
  std::vector<std::byte> wq;      // rows x dim*bits/32 uint32 words
  std::vector<std::byte> scales;  // rows x dim/group_size dtype elements
  std::vector<std::byte> biases;  // likewise
};

// Element conversions: float32 <-> the dtype's bytes, round to nearest even
// (f16 through the compiler's _Float16, bf16 by bit arithmetic).
float RefLoad(DType dtype, const std::byte* element);
void RefStore(DType dtype, float value, std::byte* element);

// Groups never straddle rows (a row's dim is a multiple of group_size), so
// `input`, whole rows of dtype elements, quantizes as one run of groups.
RefPacked RefQuantize(const RefQuantFormat& format, absl::Span<const std::byte> input);
// The inverse: the rows as dtype elements.
std::vector<std::byte> RefDequantize(const RefQuantFormat& format, const RefPacked& packed);

// `values` finite dtype elements (a whole number of groups), each group drawn
// from one of: gaussian at a random magnitude (1e-3 .. 1e3), a constant, zeros
// of both signs, all negative, all positive, tiny values (f32 / bf16 denormals,
// f16 subnormals), the dtype's largest magnitudes, one outlier, or ends of equal
// magnitude and opposite sign.
std::vector<std::byte> RandomQuantizableValues(DType dtype, uint64_t values, uint32_t group_size,
                                               std::mt19937_64& rng);

// The most |dequantized - x| may be for a value x of a group stored with
// `scale` and `bias`: one quantization step (the group's far end may be clamped
// by up to a step, as mlx's snapping of the scale allows), plus the dtype's
// rounding of scale (times up to 2^bits - 1), bias and result.
double RefErrorBound(const RefQuantFormat& format, float scale, float bias, float x);

// One row's bytes in each plane.
inline uint64_t WqRowBytes(const RefQuantFormat& f, uint32_t dim) {
  return uint64_t{dim} * f.bits / 8;
}
inline uint64_t ScaleRowBytes(const RefQuantFormat& f, uint32_t dim) {
  return uint64_t{dim} / f.group_size * DTypeSize(f.dtype);
}

}  // namespace kvcache::testing
