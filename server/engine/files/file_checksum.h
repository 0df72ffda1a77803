// The checksum kvcached stores in its prompt-cache files, hashed on several
// cores so that verifying a load keeps up with reading it.
//
//   current  "xxh3-128/4MiB:<32 hex>": XXH3-128 of the canonical header followed
//            by the canonical XXH3-128 digest (16 bytes) of each 4 MiB chunk of
//            the data section in order (the last chunk may be shorter; no data,
//            no chunks). Chunks hash independently, so in parallel: one stream
//            runs at memory speed on one core, below what a read of the file
//            costs.
//   legacy   "<32 hex>": XXH3-128 of the canonical header followed by the whole
//            data section, as kvcached wrote it before; still verified.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvcache::engine {

inline constexpr uint64_t kChecksumChunkBytes = 4 << 20;
inline constexpr absl::string_view kChunkedChecksumPrefix = "xxh3-128/4MiB:";

// The data section in pieces (tensors in file order), read as one byte string.
using DataPieces = absl::Span<const absl::Span<const std::byte>>;

// The current form, for a new file.
std::string FileChecksum(absl::string_view canonical_header, DataPieces data);

// What `data` hashes to in the form of `stored` (current or legacy); nullopt
// when `stored` is neither form. Equal to `stored` iff nothing changed.
std::optional<std::string> RecomputeFileChecksum(absl::string_view stored,
                                                 absl::string_view canonical_header,
                                                 DataPieces data);

}  // namespace kvcache::engine
