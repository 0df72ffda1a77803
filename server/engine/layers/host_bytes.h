// What an object costs in host memory, for the metadata budget
// (engine/metadata_budget.h).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvcache::engine {

// What glibc's malloc takes for a block of `bytes`: a size word, rounded up to
// 16 bytes, at least 32.
constexpr uint64_t HeapBlockBytes(uint64_t bytes) {
  const uint64_t block = (bytes + sizeof(size_t) + 15) / 16 * 16;
  return block < 32 ? 32 : block;
}

// The control block make_shared puts beside the object (two counts and a vtable pointer).
constexpr uint64_t kSharedCountBytes = 16;

}  // namespace kvcache::engine
