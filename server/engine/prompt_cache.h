// An mlx-lm prompt-cache file in memory (mlx_lm.models.cache.save_prompt_cache):
// flattened tensors and flattened string metadata, as safetensors holds them.
//
//   tensors   "<layer>.<i>" (quantized "<layer>.<i>.<j>"): each layer's `state`
//   metadata  "0.<layer>[.<k>]": meta_state; "1.<key>": the user's metadata;
//             "2.<layer>": the class name (KVCache, RotatingKVCache, ...)
//
// engine/safetensors.h reads and writes the bytes; engine/mlx_state.h turns a
// snapshot into one and back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvcache::engine {

// safetensors element types that prompt caches use.
enum class FileDType : uint8_t { kF32, kF16, kBF16, kU32, kI32, kI64, kU8, kBool };

struct FileTensor {
  FileDType dtype = FileDType::kF32;
  std::vector<uint64_t> shape;  // outermost first; never empty of elements
  std::vector<std::byte> data;  // row-major, little-endian
};

struct PromptCacheFile {
  // Ordered maps: files written from the same state have the same header.
  std::map<std::string, FileTensor> tensors;
  std::map<std::string, std::string> metadata;
};

}  // namespace kvcache::engine
