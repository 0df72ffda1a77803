// Host copies into and out of mapped pages that are large enough to share out
// among the HostWorkers. One core's memcpy into memory it has not just read
// reaches about half of what the memory system gives two (bench/RESULTS.md:
// a prompt-cache load wrote its pages at 7 GB/s on one core), so a call that
// moves megabytes runs on the caller and the idle workers; the small calls
// that Update and Fetch make per layer stay on the calling thread.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/functional/function_ref.h"

namespace kvcache::gpu {

// A call moving at least this many bytes is shared out...
inline constexpr uint64_t kSharedCopyBytes = 2 << 20;
// ...in batches of whole runs of about this many bytes each.
inline constexpr uint64_t kCopyBatchBytes = 512 << 10;

// Calls copy(begin, end) for consecutive index ranges that together cover
// [0, count) once: one range on this thread when the runs' bytes (bytes_of)
// add up to less than kSharedCopyBytes, else batches on the HostWorkers.
// Returns when every range has been copied. A copy that uses streaming stores
// fences them itself: they are ordered per thread.
void CopyRunsInBatches(size_t count, absl::FunctionRef<uint64_t(size_t)> bytes_of,
                       absl::FunctionRef<void(size_t begin, size_t end)> copy);

}  // namespace kvcache::gpu
