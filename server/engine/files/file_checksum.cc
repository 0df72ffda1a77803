#include "engine/files/file_checksum.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvcache::engine {
namespace {

// Above this many chunks a second thread pays for its start; at most this
// many threads, so that concurrent loads share the cores.
constexpr uint64_t kChunksPerThread = 4;
constexpr unsigned kMaxHashThreads = 4;

std::string CanonicalHex(XXH128_hash_t hash) {
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, hash);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(canonical.digest), sizeof(canonical.digest)));
}

uint64_t TotalBytes(DataPieces data) {
  uint64_t total = 0;
  for (absl::Span<const std::byte> piece : data) total += piece.size();
  return total;
}

// Hashes [begin, end) of the data section (which runs across pieces).
class RangeHasher {
 public:
  explicit RangeHasher(DataPieces data) : data_(data) {
    uint64_t at = 0;
    for (absl::Span<const std::byte> piece : data) {
      starts_.push_back(at);
      at += piece.size();
    }
  }

  XXH128_hash_t Hash(uint64_t begin, uint64_t end) const {
    XXH3_state_t state;
    XXH3_128bits_reset(&state);
    // The last piece starting at or before `begin` (pieces may be empty).
    size_t piece = std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin() - 1;
    for (uint64_t at = begin; at < end; ++piece) {
      const absl::Span<const std::byte> bytes = data_[piece];
      const uint64_t from = at - starts_[piece];
      if (from >= bytes.size()) continue;
      const uint64_t take = std::min<uint64_t>(bytes.size() - from, end - at);
      XXH3_128bits_update(&state, bytes.data() + from, take);
      at += take;
    }
    return XXH3_128bits_digest(&state);
  }

 private:
  DataPieces data_;
  std::vector<uint64_t> starts_;
};

// Each chunk's canonical digest, in order; contiguous runs of chunks on up to
// kMaxHashThreads threads (the caller's among them).
std::string ChunkDigests(DataPieces data) {
  const uint64_t total = TotalBytes(data);
  const uint64_t chunks = (total + kChecksumChunkBytes - 1) / kChecksumChunkBytes;
  std::string digests(chunks * sizeof(XXH128_canonical_t), '\0');
  const RangeHasher hasher(data);
  const auto hash_chunks = [&](uint64_t first, uint64_t last) {
    for (uint64_t chunk = first; chunk < last; ++chunk) {
      const uint64_t begin = chunk * kChecksumChunkBytes;
      XXH128_canonicalFromHash(reinterpret_cast<XXH128_canonical_t*>(digests.data()) + chunk,
                               hasher.Hash(begin, std::min(total, begin + kChecksumChunkBytes)));
    }
  };
  const uint64_t threads =
      std::max<uint64_t>(1, std::min<uint64_t>({std::max(1u, std::thread::hardware_concurrency()),
                                                kMaxHashThreads, chunks / kChunksPerThread}));
  std::vector<std::thread> helpers;
  for (uint64_t t = 1; t < threads; ++t) {
    helpers.emplace_back(hash_chunks, chunks * t / threads, chunks * (t + 1) / threads);
  }
  hash_chunks(0, chunks / threads);
  for (std::thread& helper : helpers) helper.join();
  return digests;
}

std::string LegacyChecksum(absl::string_view canonical_header, DataPieces data) {
  XXH3_state_t state;
  XXH3_128bits_reset(&state);
  XXH3_128bits_update(&state, canonical_header.data(), canonical_header.size());
  for (absl::Span<const std::byte> piece : data) {
    XXH3_128bits_update(&state, piece.data(), piece.size());
  }
  return CanonicalHex(XXH3_128bits_digest(&state));
}

bool IsHex32(absl::string_view text) {
  return text.size() == 32 && std::all_of(text.begin(), text.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

}  // namespace

std::string FileChecksum(absl::string_view canonical_header, DataPieces data) {
  const std::string covered = absl::StrCat(canonical_header, ChunkDigests(data));
  return absl::StrCat(kChunkedChecksumPrefix,
                      CanonicalHex(XXH3_128bits(covered.data(), covered.size())));
}

std::optional<std::string> RecomputeFileChecksum(absl::string_view stored,
                                                 absl::string_view canonical_header,
                                                 DataPieces data) {
  if (absl::StartsWith(stored, kChunkedChecksumPrefix)) {
    return FileChecksum(canonical_header, data);
  }
  if (IsHex32(stored)) return LegacyChecksum(canonical_header, data);
  return std::nullopt;
}

}  // namespace kvcache::engine
