// CopyRunsInBatches (gpu/shared_copies.h): small calls stay whole on the
// caller; large ones are cut into consecutive batches of whole runs that cover
// every run once.
#include "gpu/shared_copies.h"

#include <algorithm>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gpu/host_workers.h"
#include "gtest/gtest.h"

namespace kvcache::gpu {
namespace {

struct Recorded {
  absl::Mutex mutex;
  std::vector<std::pair<size_t, size_t>> ranges;
  std::vector<std::thread::id> threads;
};

void RecordBatches(const std::vector<uint64_t>& bytes, Recorded& recorded) {
  CopyRunsInBatches(
      bytes.size(), [&](size_t i) { return bytes[i]; },
      [&](size_t begin, size_t end) {
        absl::MutexLock lock(&recorded.mutex);
        recorded.ranges.emplace_back(begin, end);
        recorded.threads.push_back(std::this_thread::get_id());
      });
}

TEST(SharedCopiesTest, ASmallCallIsOneRangeOnTheCaller) {
  const std::vector<uint64_t> bytes(100, (kSharedCopyBytes - 1) / 100);
  Recorded recorded;
  RecordBatches(bytes, recorded);
  ASSERT_EQ(recorded.ranges.size(), 1u);
  EXPECT_EQ(recorded.ranges[0], std::make_pair(size_t{0}, bytes.size()));
  EXPECT_EQ(recorded.threads[0], std::this_thread::get_id());
}

TEST(SharedCopiesTest, NoRunsIsOneEmptyRange) {
  Recorded recorded;
  RecordBatches({}, recorded);
  ASSERT_EQ(recorded.ranges.size(), 1u);
  EXPECT_EQ(recorded.ranges[0], std::make_pair(size_t{0}, size_t{0}));
}

TEST(SharedCopiesTest, ALargeCallIsCutIntoBatchesThatCoverEveryRunOnce) {
  if (HostWorkers::Shared().threads() == 0) GTEST_SKIP() << "one core: every call stays whole";
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<uint64_t> size(0, 300 << 10);
  std::vector<uint64_t> bytes(200);
  uint64_t total = 0;
  for (uint64_t& b : bytes) total += b = size(rng);
  ASSERT_GE(total, kSharedCopyBytes);
  Recorded recorded;
  RecordBatches(bytes, recorded);
  std::sort(recorded.ranges.begin(), recorded.ranges.end());
  ASSERT_GT(recorded.ranges.size(), 1u);
  size_t next = 0;
  for (size_t r = 0; r < recorded.ranges.size(); ++r) {
    const auto [begin, end] = recorded.ranges[r];
    ASSERT_EQ(begin, next) << "range " << r << " leaves a gap or overlaps";
    ASSERT_LT(begin, end);
    uint64_t range_bytes = 0;
    for (size_t i = begin; i < end; ++i) range_bytes += bytes[i];
    // Every batch but the last reaches the batch size, and only its last run
    // takes it there.
    if (end != bytes.size()) {
      EXPECT_GE(range_bytes, kCopyBatchBytes) << "range " << r;
      EXPECT_LT(range_bytes - bytes[end - 1], kCopyBatchBytes) << "range " << r;
    }
    next = end;
  }
  EXPECT_EQ(next, bytes.size());
}

}  // namespace
}  // namespace kvcache::gpu
