// The quantize / dequantize loops of gpu/quant_kernels.h, written once over an
// instruction-set policy `Isa` and instantiated by quant_kernels_<isa>.cc, each
// compiled for its own target. Only those files include this one: everything
// here has internal linkage, so an AVX-512 copy can never stand in for the
// portable one at link time.
//
// Isa provides, for a vector F of Isa::kLanes floats:
//   Set1(float)            Load<dtype>(p) / Store<dtype>(F, p)   kLanes values
//   Max(x, acc) Min(x, acc)   acc where x is NaN (std::max(acc, x)'s order)
//   ReduceMax(F) ReduceMin(F) Sub Div Mul Add Abs Negate
//   LoadFloats(p) / StoreFloats(F, p)     kLanes floats
//   SelectGreater(a, b, x, y)  x where a > b, else y
//   SelectNonZero(c, x, y)     x where c != 0, else y
//   RoundNearest(F)        ties to even, as std::rint in the default mode
//   M NearHalves(t, r)     lanes of t (rounded: r) within 2^-13 of a
//                          half-integer: !(|t - r| < 0.5 - 2^-13), so NaN
//                          and infinities too; M NoLanes(), Or(M, M), Any(M)
//   ClampToBins(q, n)      min(max(q, 0), n)
//   LoadQ<bits>(p) / StoreQ<bits>(F, p)   kLanes * bits / 8 bytes, little end first
//
// The order of operations is the reference's (tests/support/ref_quantizer.cc),
// with no fused multiply-add (the files build with -ffp-contract=off).
//
// No std:: function templates or inline functions here: an unoptimised build
// would emit them as shared (COMDAT) symbols compiled for AVX-512, which the
// linker may then hand to code that runs on any CPU. Builtins and the
// internal helpers below instead.
#pragma once

#include <cstdint>

#include "gpu/quant_kernels.h"

namespace kvcache::gpu::quant_kernels {
namespace {

// std::max / std::min's choice: the first operand unless the second is larger
// (smaller); NaN operands therefore lose only in the second place.
inline float MaxOf(float a, float b) { return a < b ? b : a; }
inline float MinOf(float a, float b) { return b < a ? b : a; }
inline uint64_t MinOf(uint64_t a, uint64_t b) { return b < a ? b : a; }

inline float LoadScalar(DType dtype, const std::byte* p) {
  switch (dtype) {
    case DType::kFloat32: {
      float value;
      __builtin_memcpy(&value, p, 4);
      return value;
    }
    case DType::kFloat16: {
      _Float16 half;
      __builtin_memcpy(&half, p, 2);
      return static_cast<float>(half);
    }
    case DType::kBFloat16: {
      uint16_t half;
      __builtin_memcpy(&half, p, 2);
      const uint32_t bits = uint32_t{half} << 16;
      float value;
      __builtin_memcpy(&value, &bits, 4);
      return value;
    }
  }
  return 0;
}

// Round to nearest, ties to even; a NaN stays a NaN.
inline uint16_t FloatToBFloat16(float value) {
  uint32_t bits;
  __builtin_memcpy(&bits, &value, 4);
  if (__builtin_isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline void StoreScalar(DType dtype, float value, std::byte* p) {
  switch (dtype) {
    case DType::kFloat32:
      __builtin_memcpy(p, &value, 4);
      return;
    case DType::kFloat16: {
      const _Float16 half = static_cast<_Float16>(value);
      __builtin_memcpy(p, &half, 2);
      return;
    }
    case DType::kBFloat16: {
      const uint16_t half = FloatToBFloat16(value);
      __builtin_memcpy(p, &half, 2);
      return;
    }
  }
}

// The loops below take dtype, group size and bits as template arguments, so
// that no switch is left inside them and the group loops unroll.

// The smallest and largest value of the group at `values`.
template <class Isa, DType kDType, uint32_t kGroup>
void GroupRange(const std::byte* values, float& lo_out, float& hi_out) {
  constexpr uint32_t kElem = DTypeSize(kDType);
  typename Isa::F hi = Isa::Set1(-__builtin_inff());
  typename Isa::F lo = Isa::Set1(__builtin_inff());
  for (uint32_t j = 0; j < kGroup; j += Isa::kLanes) {
    const typename Isa::F x = Isa::template Load<kDType>(values + j * kElem);
    hi = Isa::Max(x, hi);
    lo = Isa::Min(x, lo);
  }
  lo_out = Isa::ReduceMin(lo);
  hi_out = Isa::ReduceMax(hi);
}

// mlx's fit, for kLanes groups at once (one per lane): the edge with the
// larger magnitude is represented exactly (bias = edge, or 0 when it rounds
// to bin 0). Lanes, not branches: which edge wins is a coin toss per group,
// and as a branch it was mispredicted half the time.
template <class Isa>
void FitGroups(const float* lo, const float* hi, float n_bins, float* scales, float* biases) {
  using F = typename Isa::F;
  const F w_min = Isa::LoadFloats(lo);
  const F w_max = Isa::LoadFloats(hi);
  const F zero = Isa::Set1(0.0f);
  // MaxOf(range / n_bins, eps): the second operand of Max wins ties and NaN.
  const F positive = Isa::Max(Isa::Set1(1e-7f), Isa::Div(Isa::Sub(w_max, w_min), Isa::Set1(n_bins)));
  const F abs_min = Isa::Abs(w_min);
  const F abs_max = Isa::Abs(w_max);
  const F scale = Isa::SelectGreater(abs_min, abs_max, positive, Isa::Negate(positive));
  const F edge = Isa::SelectGreater(abs_min, abs_max, w_min, w_max);
  const F q0 = Isa::RoundNearest(Isa::Div(edge, scale));
  Isa::StoreFloats(Isa::SelectNonZero(q0, Isa::Div(edge, q0), scale), scales);
  Isa::StoreFloats(Isa::SelectNonZero(q0, edge, zero), biases);
}

// Quantizes one group into kGroup * kBits / 8 bytes of wq.
template <class Isa, DType kDType, uint32_t kGroup, uint32_t kBits>
void QuantizeGroup(const std::byte* in, float scale_value, float bias_value, std::byte* wq) {
  using F = typename Isa::F;
  constexpr uint32_t kElem = DTypeSize(kDType);
  const F bins = Isa::Set1(static_cast<float>((1u << kBits) - 1));
  const F scale = Isa::Set1(scale_value);
  const F bias = Isa::Set1(bias_value);
  const F inverse = Isa::Set1(1.0f / scale_value);
  // rint(d / scale) is the reference's; rint(d * (1 / scale)) is the same
  // integer unless the quotient lies within their rounding errors (3 ulps,
  // under 2^-13 for |t| <= 257) of a half-integer; beyond 257 both clamp to
  // the same bin. Divisions cost several multiplies, so the group goes by
  // multiplication and is done again by division only when a lane came near.
  typename Isa::M near = Isa::NoLanes();
  for (uint32_t j = 0; j < kGroup; j += Isa::kLanes) {
    const F t = Isa::Mul(Isa::Sub(Isa::template Load<kDType>(in + j * kElem), bias), inverse);
    const F q = Isa::RoundNearest(t);
    near = Isa::Or(near, Isa::NearHalves(t, q));
    Isa::template StoreQ<kBits>(Isa::ClampToBins(q, bins), wq + j * kBits / 8);
  }
  if (!Isa::Any(near)) [[likely]] return;
  for (uint32_t j = 0; j < kGroup; j += Isa::kLanes) {
    const F d = Isa::Sub(Isa::template Load<kDType>(in + j * kElem), bias);
    const F q = Isa::RoundNearest(Isa::Div(d, scale));
    Isa::template StoreQ<kBits>(Isa::ClampToBins(q, bins), wq + j * kBits / 8);
  }
}

template <class Isa, DType kDType, uint32_t kGroup, uint32_t kBits>
void QuantizeTyped(const std::byte* values, uint64_t groups, const QuantPlanes& out) {
  static_assert(32 % Isa::kLanes == 0, "lanes must divide the smallest group");
  constexpr uint64_t kBlock = Isa::kLanes;  // groups fitted at once
  constexpr uint32_t kElem = DTypeSize(kDType);
  constexpr uint64_t kGroupBytes = uint64_t{kGroup} * kElem;
  constexpr uint64_t kGroupWqBytes = uint64_t{kGroup} * kBits / 8;
  constexpr float kBins = static_cast<float>((1u << kBits) - 1);
  alignas(64) float lo[kBlock] = {}, hi[kBlock] = {}, scales[kBlock], biases[kBlock];
  alignas(64) std::byte tail[2][kBlock * kElem];
  for (uint64_t first = 0; first < groups; first += kBlock) {
    const uint64_t block = MinOf(kBlock, groups - first);
    const std::byte* in = values + first * kGroupBytes;
    for (uint64_t b = 0; b < block; ++b) {
      GroupRange<Isa, kDType, kGroup>(in + b * kGroupBytes, lo[b], hi[b]);
    }
    FitGroups<Isa>(lo, hi, kBins, scales, biases);
    for (uint64_t b = 0; b < block; ++b) {
      QuantizeGroup<Isa, kDType, kGroup, kBits>(in + b * kGroupBytes, scales[b], biases[b],
                                                out.wq + (first + b) * kGroupWqBytes);
    }
    // Scales and biases in the dtype, kLanes at a time; a last partial block
    // goes through `tail` so that nothing past the planes is written.
    const bool whole = block == kBlock;
    std::byte* scales_out = whole ? out.scales + first * kElem : tail[0];
    std::byte* biases_out = whole ? out.biases + first * kElem : tail[1];
    Isa::template Store<kDType>(Isa::LoadFloats(scales), scales_out);
    Isa::template Store<kDType>(Isa::LoadFloats(biases), biases_out);
    if (!whole) {
      __builtin_memcpy(out.scales + first * kElem, tail[0], block * kElem);
      __builtin_memcpy(out.biases + first * kElem, tail[1], block * kElem);
    }
  }
}

template <class Isa, DType kDType, uint32_t kGroup, uint32_t kBits>
void DequantizeTyped(const ConstQuantPlanes& in, uint64_t groups, std::byte* values) {
  constexpr uint32_t kElem = DTypeSize(kDType);
  constexpr uint64_t kGroupBytes = uint64_t{kGroup} * kElem;
  constexpr uint64_t kGroupWqBytes = uint64_t{kGroup} * kBits / 8;
  for (uint64_t g = 0; g < groups; ++g) {
    const typename Isa::F scale = Isa::Set1(LoadScalar(kDType, in.scales + g * kElem));
    const typename Isa::F bias = Isa::Set1(LoadScalar(kDType, in.biases + g * kElem));
    const std::byte* wq = in.wq + g * kGroupWqBytes;
    std::byte* out = values + g * kGroupBytes;
    for (uint32_t j = 0; j < kGroup; j += Isa::kLanes) {
      const typename Isa::F q = Isa::template LoadQ<kBits>(wq + j * kBits / 8);
      Isa::template Store<kDType>(Isa::Add(Isa::Mul(scale, q), bias), out + j * kElem);
    }
  }
}

// Calls visit.template operator()<dtype, group, bits>() for the format's values.
template <typename Visit>
void ForFormat(const QuantFormat& f, Visit&& visit) {
  const auto with_bits = [&]<DType kDType, uint32_t kGroup>() {
    if (f.bits == 4) return visit.template operator()<kDType, kGroup, 4>();
    return visit.template operator()<kDType, kGroup, 8>();
  };
  const auto with_group = [&]<DType kDType>() {
    if (f.group_size == 32) return with_bits.template operator()<kDType, 32>();
    if (f.group_size == 64) return with_bits.template operator()<kDType, 64>();
    return with_bits.template operator()<kDType, 128>();
  };
  if (f.dtype == DType::kFloat32) return with_group.template operator()<DType::kFloat32>();
  if (f.dtype == DType::kFloat16) return with_group.template operator()<DType::kFloat16>();
  return with_group.template operator()<DType::kBFloat16>();
}

template <class Isa>
void QuantizeWith(const QuantFormat& f, const std::byte* values, uint64_t groups,
                  const QuantPlanes& out) {
  ForFormat(f, [&]<DType kDType, uint32_t kGroup, uint32_t kBits>() {
    QuantizeTyped<Isa, kDType, kGroup, kBits>(values, groups, out);
  });
}

template <class Isa>
void DequantizeWith(const QuantFormat& f, const ConstQuantPlanes& in, uint64_t groups,
                    std::byte* values) {
  ForFormat(f, [&]<DType kDType, uint32_t kGroup, uint32_t kBits>() {
    DequantizeTyped<Isa, kDType, kGroup, kBits>(in, groups, values);
  });
}

}  // namespace
}  // namespace kvcache::gpu::quant_kernels
