// Internals of safetensors.cc: the JSON header's parsing and validation, the
// data section's layout check, and the checksum. Not part of the engine's API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/files/prompt_cache.h"

namespace kvcache::engine::safetensors_internal {

struct TensorEntry {
  std::string name;
  FileDType dtype = FileDType::kF32;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // data_offsets, relative to the data section
  uint64_t end = 0;
};

struct ParsedHeader {
  std::vector<TensorEntry> tensors;             // in key order
  std::map<std::string, std::string> metadata;  // without the checksum key
  std::optional<std::string> checksum_hex;      // the stored value, when present
  std::string canonical_without_checksum;       // what the checksum covers (when present)
};

std::optional<FileDType> FileDTypeFromName(absl::string_view name);

// Parses and validates the header: a JSON object without duplicate keys, each
// tensor entry exactly {dtype, shape, data_offsets} with a known dtype, at least
// one element and a span of shape × dtype size bytes, metadata string→string.
// A header carrying a checksum must be byte for byte its canonical dump, so no
// change to it can go unnoticed.
absl::StatusOr<ParsedHeader> ParseHeader(absl::string_view header_json);

// The tensors must tile [0, data_bytes) exactly: no gap, no overlap, nothing
// after the last tensor (INVALID_ARGUMENT); fewer bytes than the tensors need
// is truncation (DATA_LOSS).
absl::Status CheckDataLayout(const std::vector<TensorEntry>& tensors, uint64_t data_bytes);

}  // namespace kvcache::engine::safetensors_internal
