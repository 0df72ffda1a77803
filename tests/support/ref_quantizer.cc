#include "support/ref_quantizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace kvcache::testing {
namespace {

uint16_t Load16(const std::byte* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

void Store16(uint16_t bits, std::byte* p) { std::memcpy(p, &bits, 2); }

uint16_t FloatToBFloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);  // stays a NaN
  bits += 0x7FFF + ((bits >> 16) & 1);                                       // nearest, ties even
  return static_cast<uint16_t>(bits >> 16);
}

// One group: the mlx CPU kernel's arithmetic, in float32 throughout.
struct GroupParams {
  float scale;
  float bias;
};

GroupParams FitGroup(const float* w, uint32_t group_size, float n_bins) {
  constexpr float kEps = 1e-7f;
  float w_min = std::numeric_limits<float>::infinity();
  float w_max = -w_min;
  for (uint32_t j = 0; j < group_size; ++j) {
    w_max = std::max(w_max, w[j]);
    w_min = std::min(w_min, w[j]);
  }
  const bool mask = std::abs(w_min) > std::abs(w_max);
  float scale = std::max((w_max - w_min) / n_bins, kEps);
  scale = mask ? scale : -scale;
  const float edge = mask ? w_min : w_max;
  const float q0 = std::rint(edge / scale);
  float bias = 0;
  if (q0 != 0) {
    scale = edge / q0;
    bias = edge;
  }
  return {scale, bias};
}

void QuantizeGroup(const RefQuantFormat& f, const float* w, uint32_t* words, std::byte* scale,
                   std::byte* bias) {
  const float n_bins = static_cast<float>((1u << f.bits) - 1);
  const GroupParams params = FitGroup(w, f.group_size, n_bins);
  const uint32_t per_word = 32 / f.bits;
  for (uint32_t word = 0; word < f.group_size / per_word; ++word) {
    uint32_t packed = 0;
    for (uint32_t k = 0; k < per_word; ++k) {
      float q = std::rint((w[word * per_word + k] - params.bias) / params.scale);
      q = std::min(std::max(q, 0.0f), n_bins);
      packed |= static_cast<uint32_t>(q) << (k * f.bits);
    }
    words[word] = packed;
  }
  RefStore(f.dtype, params.scale, scale);
  RefStore(f.dtype, params.bias, bias);
}

// Fills one group of float values of the kind `kind` (see the header).
void FillGroup(DType dtype, int kind, std::vector<float>& w, std::mt19937_64& rng) {
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const float magnitude = std::pow(10.0f, unit(rng) * 6.0f - 3.0f);
  const float tiny = dtype == DType::kFloat16 ? 6e-5f : 1e-38f;  // subnormals below
  const float large = dtype == DType::kFloat16 ? 6e4f : 1e30f;
  for (size_t j = 0; j < w.size(); ++j) {
    switch (kind) {
      case 1:
        w[j] = j == 0 ? normal(rng) * magnitude : w[0];
        break;  // constant
      case 2:
        w[j] = (rng() & 1) ? 0.0f : -0.0f;
        break;  // zeros
      case 3:
        w[j] = -std::abs(normal(rng)) * magnitude - magnitude;
        break;  // negative
      case 4:
        w[j] = std::abs(normal(rng)) * magnitude + magnitude;
        break;  // positive
      case 5:
        w[j] = (unit(rng) * 2 - 1) * tiny * (j % 5 == 0 ? 1.0f : 0.01f);
        break;
      case 6:
        w[j] = (unit(rng) * 2 - 1) * large;
        break;
      case 7:
        w[j] = j == w.size() / 2 ? magnitude * 1e3f : normal(rng) * magnitude;
        break;
      case 8:
        w[j] = j == 0 ? magnitude : j == 1 ? -magnitude : (unit(rng) * 2 - 1) * magnitude;
        break;
      default:
        w[j] = normal(rng) * magnitude;
        break;
    }
  }
  if (dtype == DType::kFloat16) {
    for (float& v : w) v = std::clamp(v, -65504.0f, 65504.0f);
  }
}

}  // namespace

std::vector<std::byte> RandomQuantizableValues(DType dtype, uint64_t values, uint32_t group_size,
                                               std::mt19937_64& rng) {
  const uint32_t elem = DTypeSize(dtype);
  std::vector<std::byte> out(values * elem);
  std::vector<float> w(group_size);
  std::uniform_int_distribution<int> kind(0, 16);  // 0 and 9..16: gaussian
  for (uint64_t g = 0; g < values / group_size; ++g) {
    FillGroup(dtype, kind(rng), w, rng);
    for (uint32_t j = 0; j < group_size; ++j) {
      RefStore(dtype, w[j], out.data() + (g * group_size + j) * elem);
    }
  }
  return out;
}

float RefLoad(DType dtype, const std::byte* element) {
  switch (dtype) {
    case DType::kFloat32: {
      float value;
      std::memcpy(&value, element, 4);
      return value;
    }
    case DType::kFloat16: {
      _Float16 half;
      std::memcpy(&half, element, 2);
      return static_cast<float>(half);
    }
    case DType::kBFloat16: {
      const uint32_t bits = uint32_t{Load16(element)} << 16;
      float value;
      std::memcpy(&value, &bits, 4);
      return value;
    }
  }
  return 0;
}

void RefStore(DType dtype, float value, std::byte* element) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(element, &value, 4);
      return;
    case DType::kFloat16: {
      const _Float16 half = static_cast<_Float16>(value);
      std::memcpy(element, &half, 2);
      return;
    }
    case DType::kBFloat16:
      Store16(FloatToBFloat16(value), element);
      return;
  }
}

double RefErrorBound(const RefQuantFormat& f, float scale, float bias, float x) {
  const double unit = f.dtype == DType::kFloat32   ? 0x1p-24
                      : f.dtype == DType::kFloat16 ? 0x1p-11
                                                   : 0x1p-8;
  // Absolute rounding at the bottom of the range: f16 subnormals, f32 denormals.
  const double floor =
      f.dtype == DType::kFloat16 ? 0x1p-24 : std::numeric_limits<float>::denorm_min();
  const double n_bins = (1u << f.bits) - 1;
  return std::abs(scale) * (1 + unit * (n_bins + 2)) + 2 * unit * (std::abs(bias) + std::abs(x)) +
         (n_bins + 2) * floor;
}

RefPacked RefQuantize(const RefQuantFormat& f, absl::Span<const std::byte> input) {
  const uint32_t elem = DTypeSize(f.dtype);
  const uint64_t groups = input.size() / elem / f.group_size;
  const uint32_t words_per_group = f.group_size * f.bits / 32;
  RefPacked packed;
  packed.wq.resize(groups * words_per_group * 4);
  packed.scales.resize(groups * elem);
  packed.biases.resize(groups * elem);
  std::vector<float> w(f.group_size);
  std::vector<uint32_t> words(words_per_group);
  for (uint64_t g = 0; g < groups; ++g) {
    for (uint32_t j = 0; j < f.group_size; ++j) {
      w[j] = RefLoad(f.dtype, input.data() + (g * f.group_size + j) * elem);
    }
    QuantizeGroup(f, w.data(), words.data(), packed.scales.data() + g * elem,
                  packed.biases.data() + g * elem);
    std::memcpy(packed.wq.data() + g * words_per_group * 4, words.data(), words_per_group * 4);
  }
  return packed;
}

std::vector<std::byte> RefDequantize(const RefQuantFormat& f, const RefPacked& packed) {
  const uint32_t elem = DTypeSize(f.dtype);
  const uint64_t groups = packed.scales.size() / elem;
  const uint32_t per_word = 32 / f.bits;
  const uint32_t mask = (1u << f.bits) - 1;
  std::vector<std::byte> out(groups * f.group_size * elem);
  for (uint64_t g = 0; g < groups; ++g) {
    const float scale = RefLoad(f.dtype, packed.scales.data() + g * elem);
    const float bias = RefLoad(f.dtype, packed.biases.data() + g * elem);
    for (uint32_t j = 0; j < f.group_size; ++j) {
      const uint64_t value = g * f.group_size + j;
      uint32_t word;
      std::memcpy(&word, packed.wq.data() + value / per_word * 4, 4);
      const uint32_t q = (word >> (value % per_word * f.bits)) & mask;
      RefStore(f.dtype, scale * static_cast<float>(q) + bias, out.data() + value * elem);
    }
  }
  return out;
}

}  // namespace kvcache::testing
