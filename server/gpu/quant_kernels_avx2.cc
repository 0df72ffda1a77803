// The quantization kernels for x86-64 with AVX2 and F16C (Haswell, Zen and
// later): eight lanes. Built with -mavx2 -mf16c and run only where the CPU has
// both (gpu/quant_kernels.cc checks).
#include <immintrin.h>

#include "gpu/quant_kernels_impl.h"

namespace kvcache::gpu::quant_kernels {
namespace {

struct Avx2 {
  static constexpr int kLanes = 8;
  using F = __m256;

  static F Set1(float value) { return _mm256_set1_ps(value); }
  template <DType dtype>
  static F Load(const std::byte* p) {
    switch (dtype) {
      case DType::kFloat32:
        return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
      case DType::kFloat16:
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      case DType::kBFloat16: {
        const __m256i wide =
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
      }
    }
    return _mm256_setzero_ps();
  }
  template <DType dtype>
  static void Store(F x, std::byte* p) {
    switch (dtype) {
      case DType::kFloat32:
        _mm256_storeu_ps(reinterpret_cast<float*>(p), x);
        return;
      case DType::kFloat16:
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                         _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        return;
      case DType::kBFloat16:
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), ToBFloat16(x));
        return;
    }
  }
  // Round to nearest even; a NaN keeps its top bits and gets the quiet bit.
  static __m128i ToBFloat16(F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i halves = _mm256_blendv_epi8(rounded, quiet, nan);
    const __m256i packed = _mm256_packus_epi32(halves, halves);  // per 128-bit lane
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0b1000));
  }
  // maxps / minps return the second operand when either is NaN.
  static F Max(F x, F acc) { return _mm256_max_ps(x, acc); }
  static F Min(F x, F acc) { return _mm256_min_ps(x, acc); }
  static float ReduceMax(F x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
  }
  static float ReduceMin(F x) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_min_ss(m, _mm_shuffle_ps(m, m, 1)));
  }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F RoundNearest(F x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static F LoadFloats(const float* p) { return _mm256_loadu_ps(p); }
  static void StoreFloats(F x, float* p) { _mm256_storeu_ps(p, x); }
  static F Abs(F x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
  static F Negate(F x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }
  static F SelectGreater(F a, F b, F x, F y) {
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
  }
  static F SelectNonZero(F c, F x, F y) {
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_NEQ_UQ));
  }
  using M = __m256;  // all-ones lanes
  static M NoLanes() { return _mm256_setzero_ps(); }
  static M Or(M a, M b) { return _mm256_or_ps(a, b); }
  static bool Any(M m) { return _mm256_movemask_ps(m) != 0; }
  static M NearHalves(F t, F r) {
    const F off = Abs(_mm256_sub_ps(t, r));
    return _mm256_cmp_ps(off, _mm256_set1_ps(0.5f - 0x1p-13f), _CMP_NLT_UQ);
  }
  static F ClampToBins(F q, F bins) {
    return _mm256_min_ps(_mm256_max_ps(q, _mm256_setzero_ps()), bins);
  }
  template <uint32_t bits>
  static void StoreQ(F q, std::byte* p) {
    const __m256i ints = _mm256_cvttps_epi32(q);
    if constexpr (bits == 8) {
      const __m128i words =
          _mm_packus_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(words, words));
      return;
    }
    const __m256i shifted = _mm256_sllv_epi32(ints, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    __m128i word = _mm_or_si128(_mm256_castsi256_si128(shifted), _mm256_extracti128_si256(shifted, 1));
    word = _mm_or_si128(word, _mm_unpackhi_epi64(word, word));
    word = _mm_or_si128(word, _mm_shuffle_epi32(word, 1));
    const uint32_t packed = static_cast<uint32_t>(_mm_cvtsi128_si32(word));
    __builtin_memcpy(p, &packed, 4);
  }
  template <uint32_t bits>
  static F LoadQ(const std::byte* p) {
    if constexpr (bits == 8) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    }
    uint32_t packed;
    __builtin_memcpy(&packed, p, 4);
    const __m256i nibbles = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(packed)),
                          _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
        _mm256_set1_epi32(0xF));
    return _mm256_cvtepi32_ps(nibbles);
  }
};

}  // namespace

void QuantizeAvx2(const QuantFormat& f, const std::byte* values, uint64_t groups,
                  const QuantPlanes& out) {
  QuantizeWith<Avx2>(f, values, groups, out);
}

void DequantizeAvx2(const QuantFormat& f, const ConstQuantPlanes& in, uint64_t groups,
                    std::byte* values) {
  DequantizeWith<Avx2>(f, in, groups, values);
}

}  // namespace kvcache::gpu::quant_kernels
