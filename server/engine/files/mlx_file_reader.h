// Reading a PromptCacheFile defensively (mlx_state.h's CacheFromPromptCache):
// every lookup names the key it checks, and the reader remembers what was
// read so that whatever a layer's class does not explain is refused.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/files/prompt_cache.h"

namespace kvcache::engine::mlx_file {

// A non-negative decimal as Python's str(int) writes it: digits only, at most
// 18 of them (no sign, no spaces); nullopt otherwise.
std::optional<uint64_t> ParseDecimal(absl::string_view text);

class FileReader {
 public:
  explicit FileReader(const PromptCacheFile& file) : file_(file) {}

  // INVALID_ARGUMENT `tensor "<key>": missing` unless present; checks that
  // its bytes match its shape and dtype and that it has `rank` dims.
  absl::StatusOr<const FileTensor*> Tensor(const std::string& key, size_t rank);
  // INVALID_ARGUMENT `metadata "<key>": missing` unless present.
  absl::StatusOr<std::string> Meta(const std::string& key);
  // A decimal meta value no larger than `max`.
  absl::StatusOr<uint64_t> MetaNumber(const std::string& key, uint64_t max);
  // A class without meta_state: "0.<layer>" absent or "" and no "0.<layer>.*".
  absl::Status NoMeta(uint32_t layer, const std::string& mlx_class);
  // The user's metadata value for `key` ("1.<key>"), or "".
  std::string UserMeta(const std::string& key) const;
  // The number of layers: "2.<i>" keys for i = 0..n-1, no gaps.
  absl::StatusOr<uint32_t> CountLayers(uint32_t max_layers);

  // INVALID_ARGUMENT naming the first tensor or "0." / "2." metadata key no
  // layer read (`classes` names each layer's class, for the message), and any
  // metadata key outside "0.", "1." and "2.".
  absl::Status CheckAllRead(const std::vector<std::string>& classes) const;

 private:
  const PromptCacheFile& file_;
  std::set<std::string> read_tensors_;
  std::set<std::string> read_meta_;
};

// INVALID_ARGUMENT `tensor "<key>": <why>`.
absl::Status BadTensor(const std::string& key, absl::string_view why);
// INVALID_ARGUMENT `metadata "<key>": <why>`.
absl::Status BadMeta(const std::string& key, absl::string_view why);

}  // namespace kvcache::engine::mlx_file
