#include "gpu/shared_copies.h"

#include <utility>
#include <vector>

#include "gpu/host_workers.h"

namespace kvcache::gpu {

void CopyRunsInBatches(size_t count, absl::FunctionRef<uint64_t(size_t)> bytes_of,
                       absl::FunctionRef<void(size_t begin, size_t end)> copy) {
  uint64_t total = 0;
  for (size_t i = 0; i < count && total < kSharedCopyBytes; ++i) total += bytes_of(i);
  // Small calls never start the workers.
  if (total < kSharedCopyBytes || HostWorkers::Shared().threads() == 0) {
    copy(0, count);
    return;
  }
  std::vector<std::pair<size_t, size_t>> batches;
  size_t begin = 0;
  uint64_t batch_bytes = 0;
  for (size_t i = 0; i < count; ++i) {
    batch_bytes += bytes_of(i);
    if (batch_bytes >= kCopyBatchBytes || i + 1 == count) {
      batches.emplace_back(begin, i + 1);
      begin = i + 1;
      batch_bytes = 0;
    }
  }
  HostWorkers::Shared().ParallelFor(batches.size(),
                                    [&](size_t b) { copy(batches[b].first, batches[b].second); });
}

}  // namespace kvcache::gpu
