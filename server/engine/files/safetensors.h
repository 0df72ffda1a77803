// The bytes of an mlx-lm prompt-cache file: safetensors as mlx writes and reads
// it (mlx/io/safetensors.cpp).
//
//   [u64 LE header length N][N bytes: JSON header][data section]
//
//   header  {"<tensor>": {"dtype": "F16", "shape": [..], "data_offsets": [begin, end]},
//            ..., "__metadata__": {"<key>": "<string>", ...}}
//           keys sorted (nlohmann::json::dump()), no padding; offsets are
//           relative to the data section, which the tensors tile exactly.
//
// Integrity: safetensors has no checksum, so files kvcached writes carry one in
// user metadata, under kSafetensorsChecksumKey: XXH3-128 over the header's
// canonical JSON without that key and the data section (engine/files/file_checksum.h
// has the exact forms; the data hashes on several cores). mlx-lm loads
// such a file and sees one extra "1.*" metadata key. A file without the key
// (written by mlx-lm) is accepted after the structural checks.
//
// Status rule for decoding: DATA_LOSS when the bytes are damaged (shorter than
// the file says it is, or they no longer match the checksum, or a checksummed
// header is not in canonical form); INVALID_ARGUMENT for every other way the
// bytes fail to be a file we accept. Either way the message names what is wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/files/prompt_cache.h"

namespace kvcache::engine {

// User-metadata key of kvcached's checksum ("1." is mlx-lm's user namespace; no
// further '.' so mlx-lm does not re-nest it). Encode adds it, decode strips it.
inline constexpr absl::string_view kSafetensorsChecksumKey = "1.kvcached_checksum";
// mlx refuses headers above this many bytes.
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

size_t FileDTypeSize(FileDType dtype);
absl::string_view FileDTypeName(FileDType dtype);  // "F32", "F16", ...

// An encoded file in pieces, so a writer can writev it without copying tensor
// bytes: `prefix` (length + header) is owned, `tensor_data` borrows the
// PromptCacheFile's tensors (which must outlive this) in file order.
struct EncodedSafetensors {
  std::string prefix;
  std::vector<absl::Span<const std::byte>> tensor_data;
  uint64_t size_bytes = 0;   // prefix plus every tensor's bytes
  std::string checksum_hex;  // the value stored under kSafetensorsChecksumKey

  std::string ToBytes() const;  // the whole file, contiguous
};

// Refuses (INVALID_ARGUMENT, naming the tensor or key) a tensor whose data is
// not shape × dtype size bytes, a tensor without elements, a tensor named
// "__metadata__", metadata under kSafetensorsChecksumKey, and names or values
// that are not valid UTF-8.
absl::StatusOr<EncodedSafetensors> EncodeSafetensors(const PromptCacheFile& file);
absl::StatusOr<std::string> EncodeSafetensorsBytes(const PromptCacheFile& file);

struct DecodedSafetensors {
  PromptCacheFile file;            // metadata without kSafetensorsChecksumKey
  bool checksum_verified = false;  // false: the file carried no checksum
};

// Every structural check, the checksum when present, then one copy of each
// tensor's bytes.
absl::StatusOr<DecodedSafetensors> DecodeSafetensors(absl::string_view bytes);
// The same checks, but the tensors borrow `bytes` (no copy); `backing` owns
// them and the decoded file keeps it alive.
absl::StatusOr<DecodedSafetensors> DecodeSafetensorsInPlace(absl::string_view bytes,
                                                            std::shared_ptr<const void> backing);

// The checks of DecodeSafetensors without building the file (for validating an
// upload before it is stored). Returns whether a checksum was verified.
absl::StatusOr<bool> VerifySafetensors(absl::string_view bytes);

}  // namespace kvcache::engine
