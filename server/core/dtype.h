// Element types of K/V tensors. Values match kvcache.v1.DType on the wire.
#pragma once

#include <cstdint>
#include <string_view>

namespace kvcache {

enum class DType : uint8_t { kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };

constexpr uint32_t DTypeSize(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : 2;
}

constexpr std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

constexpr bool IsValidDType(uint32_t wire_value) {
  return wire_value >= 1 && wire_value <= 3;
}

}  // namespace kvcache
