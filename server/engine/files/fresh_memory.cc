#include "engine/files/fresh_memory.h"

#include <sys/mman.h>

#include <cstdint>

namespace kvcache::engine {
namespace {

constexpr uintptr_t kPageBytes = 4096;
constexpr uintptr_t kHugePageBytes = 2 << 20;
constexpr size_t kWorthPreparing = 1 << 20;  // below this, faults cost little
constexpr int kPopulateWrite = 23;           // MADV_POPULATE_WRITE (Linux 5.14)

// The whole units of `unit` bytes inside [begin, end), as [first, last).
void InnerRange(uintptr_t begin, uintptr_t end, uintptr_t unit, uintptr_t& first, uintptr_t& last) {
  first = (begin + unit - 1) & ~(unit - 1);
  last = end & ~(unit - 1);
}

}  // namespace

void PrepareFreshBuffer(void* data, size_t size) {
  if (size < kWorthPreparing) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data), end = begin + size;
  uintptr_t first = 0, last = 0;
  InnerRange(begin, end, kHugePageBytes, first, last);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  InnerRange(begin, end, kPageBytes, first, last);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, kPopulateWrite);
}

}  // namespace kvcache::engine
