// The quantization kernels for x86-64 with AVX-512 F/BW/DQ/VL (Skylake-SP,
// Zen 4 and later): sixteen lanes. Built with those flags and run only where
// the CPU has them all (gpu/quant_kernels.cc checks).
#include <immintrin.h>

#include "gpu/quant_kernels_impl.h"

namespace kvcache::gpu::quant_kernels {
namespace {

struct Avx512 {
  static constexpr int kLanes = 16;
  using F = __m512;

  static F Set1(float value) { return _mm512_set1_ps(value); }
  template <DType dtype>
  static F Load(const std::byte* p) {
    switch (dtype) {
      case DType::kFloat32:
        return _mm512_loadu_ps(p);
      case DType::kFloat16:
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      case DType::kBFloat16: {
        const __m512i wide =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
      }
    }
    return _mm512_setzero_ps();
  }
  template <DType dtype>
  static void Store(F x, std::byte* p) {
    switch (dtype) {
      case DType::kFloat32:
        _mm512_storeu_ps(p, x);
        return;
      case DType::kFloat16:
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                            _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        return;
      case DType::kBFloat16:
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), ToBFloat16(x));
        return;
    }
  }
  // Round to nearest even; a NaN keeps its top bits and gets the quiet bit.
  static __m256i ToBFloat16(F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i high = _mm512_srli_epi32(bits, 16);
    const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i halves =
        _mm512_mask_or_epi32(rounded, nan, high, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(halves);
  }
  // maxps / minps return the second operand when either is NaN.
  static F Max(F x, F acc) { return _mm512_max_ps(x, acc); }
  static F Min(F x, F acc) { return _mm512_min_ps(x, acc); }
  static float ReduceMax(F x) {
    __m256 m = _mm256_max_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
    __m128 n = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    n = _mm_max_ps(n, _mm_movehl_ps(n, n));
    return _mm_cvtss_f32(_mm_max_ss(n, _mm_shuffle_ps(n, n, 1)));
  }
  static float ReduceMin(F x) {
    __m256 m = _mm256_min_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
    __m128 n = _mm_min_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    n = _mm_min_ps(n, _mm_movehl_ps(n, n));
    return _mm_cvtss_f32(_mm_min_ss(n, _mm_shuffle_ps(n, n, 1)));
  }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F RoundNearest(F x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static F LoadFloats(const float* p) { return _mm512_loadu_ps(p); }
  static void StoreFloats(F x, float* p) { _mm512_storeu_ps(p, x); }
  static F Abs(F x) { return _mm512_abs_ps(x); }
  static F Negate(F x) { return _mm512_xor_ps(x, _mm512_set1_ps(-0.0f)); }
  static F SelectGreater(F a, F b, F x, F y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), y, x);
  }
  static F SelectNonZero(F c, F x, F y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, _mm512_setzero_ps(), _CMP_NEQ_UQ), y, x);
  }
  using M = __mmask16;
  static M NoLanes() { return 0; }
  static M Or(M a, M b) { return static_cast<M>(a | b); }
  static bool Any(M m) { return m != 0; }
  static M NearHalves(F t, F r) {
    const F off = Abs(_mm512_sub_ps(t, r));
    return _mm512_cmp_ps_mask(off, _mm512_set1_ps(0.5f - 0x1p-13f), _CMP_NLT_UQ);
  }
  static F ClampToBins(F q, F bins) {
    return _mm512_min_ps(_mm512_max_ps(q, _mm512_setzero_ps()), bins);
  }
  template <uint32_t bits>
  static void StoreQ(F q, std::byte* p) {
    const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q));
    if constexpr (bits == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bytes);
      return;
    }
    // Byte pairs (even, odd) as 16-bit lanes: even | odd << 4, then narrowed.
    const __m128i even = _mm_and_si128(bytes, _mm_set1_epi16(0xFF));
    const __m128i odd = _mm_srli_epi16(bytes, 8);
    const __m128i pairs = _mm_or_si128(even, _mm_slli_epi16(odd, 4));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(pairs, pairs));
  }
  template <uint32_t bits>
  static F LoadQ(const std::byte* p) {
    if constexpr (bits == 8) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
    }
    const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0xF);
    const __m128i low = _mm_and_si128(packed, mask);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    const __m128i nibbles = _mm_unpacklo_epi8(low, high);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles));
  }
};

}  // namespace

void QuantizeAvx512(const QuantFormat& f, const std::byte* values, uint64_t groups,
                    const QuantPlanes& out) {
  QuantizeWith<Avx512>(f, values, groups, out);
}

void DequantizeAvx512(const QuantFormat& f, const ConstQuantPlanes& in, uint64_t groups,
                      std::byte* values) {
  DequantizeWith<Avx512>(f, in, groups, values);
}

}  // namespace kvcache::gpu::quant_kernels
