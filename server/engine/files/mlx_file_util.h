// Small helpers shared by the prompt-cache writer and reader (mlx_state.h):
// key names, element types and tensor construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "engine/files/prompt_cache.h"

namespace kvcache::engine::mlx_file {

// mlx-lm tree_flatten keys: "<layer>.<i>", "<layer>.<i>.<j>"; metadata "0.<layer>...".
template <typename... Parts>
std::string Key(const Parts&... parts) {
  std::string key;
  ((key += (key.empty() ? "" : "."), absl::StrAppend(&key, parts)), ...);
  return key;
}

inline FileDType ToFileDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return FileDType::kF32;
    case DType::kBFloat16:
      return FileDType::kBF16;
    case DType::kFloat16:
      break;
  }
  return FileDType::kF16;
}

// The cache dtype a K/V tensor of `dtype` means; none for other types.
inline std::optional<DType> CacheDType(FileDType dtype) {
  switch (dtype) {
    case FileDType::kF32:
      return DType::kFloat32;
    case FileDType::kF16:
      return DType::kFloat16;
    case FileDType::kBF16:
      return DType::kBFloat16;
    default:
      return std::nullopt;
  }
}

inline uint64_t ElementBytes(FileDType dtype) {
  switch (dtype) {
    case FileDType::kF16:
    case FileDType::kBF16:
      return 2;
    case FileDType::kI64:
      return 8;
    case FileDType::kU8:
    case FileDType::kBool:
      return 1;
    default:
      return 4;
  }
}

inline FileTensor MakeTensor(FileDType dtype, std::vector<uint64_t> shape,
                             std::vector<std::byte> data) {
  return FileTensor{.dtype = dtype, .shape = std::move(shape), .data = std::move(data)};
}

}  // namespace kvcache::engine::mlx_file
