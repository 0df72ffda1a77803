// K/V as a model computes it, for prefix-sharing tests: position i's bytes
// are a function of the tokens [0, i], so sequences that share a prefix
// share its K/V, and a worker can check every restored byte against what it
// would have computed itself. Header-only: the engine tests and the worker
// process of the end-to-end test (no googletest) both use it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvcache::testing::prefix_kv {

inline uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// One running hash per position: position i's depends on tokens [0, i].
inline std::vector<uint64_t> PrefixHashes(const std::vector<uint32_t>& tokens) {
  std::vector<uint64_t> hashes;
  hashes.reserve(tokens.size());
  uint64_t hash = 0;
  for (uint32_t token : tokens) hashes.push_back(hash = Mix(hash ^ (uint64_t{token} << 1 | 1)));
  return hashes;
}

// Byte `b` of head `head` at the position of `hash` on `layer`, of the keys
// (side 0) or the values (side 1).
inline std::byte KvByte(uint64_t hash, uint32_t layer, uint32_t side, uint32_t head, uint32_t b) {
  return static_cast<std::byte>(Mix(hash ^ (layer * 131 + side * 31 + head * 7 + b)) & 0xff);
}

// Positions [begin, end) of one side of one layer as a [1, heads, L,
// row_bytes] tensor (the layout Update takes and Fetch returns).
inline std::vector<std::byte> SideTensor(const std::vector<uint64_t>& hashes, uint32_t layer,
                                         uint32_t side, uint32_t heads, uint32_t row_bytes,
                                         uint64_t begin, uint64_t end) {
  std::vector<std::byte> out;
  out.reserve(heads * (end - begin) * row_bytes);
  for (uint32_t head = 0; head < heads; ++head) {
    for (uint64_t i = begin; i < end; ++i) {
      for (uint32_t b = 0; b < row_bytes; ++b)
        out.push_back(KvByte(hashes[i], layer, side, head, b));
    }
  }
  return out;
}

}  // namespace kvcache::testing::prefix_kv
