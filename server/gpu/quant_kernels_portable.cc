// The quantization kernels in plain C++ (gpu/quant_kernels_impl.h): any CPU,
// and the yardstick the vector builds are tested against.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "gpu/quant_kernels_impl.h"

namespace kvcache::gpu::quant_kernels {
namespace {

struct Portable {
  static constexpr int kLanes = 8;
  using F = std::array<float, kLanes>;

  template <typename Op>
  static F Map(const F& a, const F& b, Op op) {
    F out;
    for (int i = 0; i < kLanes; ++i) out[i] = op(a[i], b[i]);
    return out;
  }
  static F Set1(float value) {
    F out;
    out.fill(value);
    return out;
  }
  template <DType dtype>
  static F Load(const std::byte* p) {
    F out;
    for (int i = 0; i < kLanes; ++i) out[i] = LoadScalar(dtype, p + i * DTypeSize(dtype));
    return out;
  }
  template <DType dtype>
  static void Store(const F& x, std::byte* p) {
    for (int i = 0; i < kLanes; ++i) StoreScalar(dtype, x[i], p + i * DTypeSize(dtype));
  }
  static F Max(const F& x, const F& acc) {
    return Map(x, acc, [](float v, float a) { return std::max(a, v); });
  }
  static F Min(const F& x, const F& acc) {
    return Map(x, acc, [](float v, float a) { return std::min(a, v); });
  }
  static float ReduceMax(const F& x) {
    float out = x[0];
    for (int i = 1; i < kLanes; ++i) out = std::max(out, x[i]);
    return out;
  }
  static float ReduceMin(const F& x) {
    float out = x[0];
    for (int i = 1; i < kLanes; ++i) out = std::min(out, x[i]);
    return out;
  }
  static F Sub(const F& a, const F& b) { return Map(a, b, [](float x, float y) { return x - y; }); }
  static F Div(const F& a, const F& b) { return Map(a, b, [](float x, float y) { return x / y; }); }
  static F Mul(const F& a, const F& b) { return Map(a, b, [](float x, float y) { return x * y; }); }
  static F Add(const F& a, const F& b) { return Map(a, b, [](float x, float y) { return x + y; }); }
  static F RoundNearest(const F& x) {
    F out;
    for (int i = 0; i < kLanes; ++i) out[i] = std::rint(x[i]);
    return out;
  }
  static F LoadFloats(const float* p) {
    F out;
    std::copy(p, p + kLanes, out.begin());
    return out;
  }
  static void StoreFloats(const F& x, float* p) { std::copy(x.begin(), x.end(), p); }
  static F Abs(const F& x) {
    F out;
    for (int i = 0; i < kLanes; ++i) out[i] = std::abs(x[i]);
    return out;
  }
  static F Negate(const F& x) {
    F out;
    for (int i = 0; i < kLanes; ++i) out[i] = -x[i];
    return out;
  }
  static F SelectGreater(const F& a, const F& b, const F& x, const F& y) {
    F out;
    for (int i = 0; i < kLanes; ++i) out[i] = a[i] > b[i] ? x[i] : y[i];
    return out;
  }
  static F SelectNonZero(const F& c, const F& x, const F& y) {
    F out;
    for (int i = 0; i < kLanes; ++i) out[i] = c[i] != 0 ? x[i] : y[i];
    return out;
  }
  using M = bool;
  static M NoLanes() { return false; }
  static M Or(M a, M b) { return a || b; }
  static bool Any(M m) { return m; }
  static M NearHalves(const F& t, const F& r) {
    for (int i = 0; i < kLanes; ++i) {
      if (!(std::abs(t[i] - r[i]) < 0.5f - 0x1p-13f)) return true;
    }
    return false;
  }
  static F ClampToBins(const F& q, const F& bins) {
    return Map(q, bins, [](float v, float n) { return std::min(std::max(v, 0.0f), n); });
  }
  template <uint32_t bits>
  static void StoreQ(const F& q, std::byte* p) {
    if constexpr (bits == 8) {
      for (int i = 0; i < kLanes; ++i) p[i] = static_cast<std::byte>(static_cast<uint32_t>(q[i]));
      return;
    }
    for (int i = 0; i < kLanes; i += 2) {
      const uint32_t pair = static_cast<uint32_t>(q[i]) | static_cast<uint32_t>(q[i + 1]) << 4;
      p[i / 2] = static_cast<std::byte>(pair);
    }
  }
  template <uint32_t bits>
  static F LoadQ(const std::byte* p) {
    F out;
    for (int i = 0; i < kLanes; ++i) {
      const uint32_t byte = std::to_integer<uint32_t>(p[bits == 8 ? i : i / 2]);
      out[i] = static_cast<float>(bits == 8 ? byte : (byte >> (i % 2 * 4)) & 0xF);
    }
    return out;
  }
};

}  // namespace

void QuantizePortable(const QuantFormat& f, const std::byte* values, uint64_t groups,
                      const QuantPlanes& out) {
  QuantizeWith<Portable>(f, values, groups, out);
}

void DequantizePortable(const QuantFormat& f, const ConstQuantPlanes& in, uint64_t groups,
                        std::byte* values) {
  DequantizeWith<Portable>(f, in, groups, values);
}

}  // namespace kvcache::gpu::quant_kernels
