// An mlx-lm prompt-cache file in memory (mlx_lm.models.cache.save_prompt_cache):
// flattened tensors and flattened string metadata, as safetensors holds them.
//
//   tensors   "<layer>.<i>" (quantized "<layer>.<i>.<j>"): each layer's `state`
//   metadata  "0.<layer>[.<k>]": meta_state; "1.<key>": the user's metadata;
//             "2.<layer>": the class name (KVCache, RotatingKVCache, ...)
//
// engine/files/safetensors.h reads and writes the bytes; engine/files/mlx_state.h turns a
// snapshot into one and back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/types/span.h"

namespace kvcache::engine {

// safetensors element types that prompt caches use.
enum class FileDType : uint8_t { kF32, kF16, kBF16, kU32, kI32, kI64, kU8, kBool };

// A tensor's bytes: owned, or borrowed from a loaded file's mapping (which the
// PromptCacheFile keeps alive), so that loading a file copies no tensor twice.
// Reads see either the same way; a write to borrowed bytes copies them first.
class FileBytes {
 public:
  FileBytes() = default;
  FileBytes(std::vector<std::byte> owned) : owned_(std::move(owned)) {}  // NOLINT: implicit
  static FileBytes Borrow(absl::Span<const std::byte> bytes) {
    FileBytes borrowed;
    borrowed.borrowed_ = bytes;
    borrowed.is_borrowed_ = true;
    return borrowed;
  }

  const std::byte* data() const { return is_borrowed_ ? borrowed_.data() : owned_.data(); }
  size_t size() const { return is_borrowed_ ? borrowed_.size() : owned_.size(); }
  bool empty() const { return size() == 0; }
  const std::byte* begin() const { return data(); }
  const std::byte* end() const { return data() + size(); }
  const std::byte& operator[](size_t i) const { return data()[i]; }
  operator absl::Span<const std::byte>() const { return {data(), size()}; }  // NOLINT: implicit
  bool borrowed() const { return is_borrowed_; }

  std::byte* data() { return Owned().data(); }
  std::byte& operator[](size_t i) { return Owned()[i]; }
  void resize(size_t size) { Owned().resize(size); }
  void push_back(std::byte value) { Owned().push_back(value); }
  void pop_back() { Owned().pop_back(); }

  friend bool operator==(const FileBytes& a, const FileBytes& b) {
    return absl::Span<const std::byte>(a) == absl::Span<const std::byte>(b);
  }

 private:
  std::vector<std::byte>& Owned() {
    if (is_borrowed_) {
      owned_.assign(borrowed_.begin(), borrowed_.end());
      borrowed_ = {};
      is_borrowed_ = false;
    }
    return owned_;
  }

  std::vector<std::byte> owned_;
  absl::Span<const std::byte> borrowed_;
  bool is_borrowed_ = false;
};

struct FileTensor {
  FileDType dtype = FileDType::kF32;
  std::vector<uint64_t> shape;  // outermost first; never empty of elements
  FileBytes data;               // row-major, little-endian
};

struct PromptCacheFile {
  // Ordered maps: files written from the same state have the same header.
  std::map<std::string, FileTensor> tensors;
  std::map<std::string, std::string> metadata;
  // What borrowed tensor bytes point into (a mapped file); null when all are owned.
  std::shared_ptr<const void> backing;
};

}  // namespace kvcache::engine
