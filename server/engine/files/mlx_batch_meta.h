// mlx-lm BatchRotatingKVCache's meta_state as save_prompt_cache writes it into
// a prompt-cache file: (max_size, _offset, _idx, rotated), each value str()'d.
//
// mlx-lm reads it back with `self.rotated = bool(v[3])`, and in Python
// bool("False") is True: every saved cache loads as rotated, so an unrotated
// one is then read in the wrong order. Here "True" and "False" mean what they
// say and anything else is refused, naming the entry; the numbers must be
// plain unsigned decimals. (BatchKVCache has no meta_state of its own: its
// offsets and left padding are arrays of its state.)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvcache::engine {

struct BatchRotatingMeta {
  uint64_t max_size = 0;
  uint64_t offset = 0;  // mlx-lm `_offset`
  uint64_t idx = 0;     // mlx-lm `_idx`
  bool rotated = false;
  bool operator==(const BatchRotatingMeta&) const = default;
};

// Python's str() of each value: {"8", "12", "4", "True"}.
std::vector<std::string> BatchRotatingMetaState(const BatchRotatingMeta& meta);

// The inverse; INVALID_ARGUMENT naming meta_state[i] for a wrong count, a
// malformed number or a `rotated` that is not "True" or "False".
absl::StatusOr<BatchRotatingMeta> ParseBatchRotatingMetaState(
    absl::Span<const std::string> meta_state);

// A Python bool as str() writes it: "True" or "False", nothing else.
absl::StatusOr<bool> ParsePythonBool(absl::string_view text);

}  // namespace kvcache::engine
