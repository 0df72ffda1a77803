// HostWorkers (gpu/host_workers.h): every item runs exactly once, the workers
// really share the work, and concurrent callers do not mix up their items.
#include "gpu/host_workers.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace kvcache::gpu {
namespace {

TEST(HostWorkersTest, EveryItemRunsOnce) {
  HostWorkers workers(3);
  std::vector<std::atomic<int>> runs(10000);
  workers.ParallelFor(runs.size(), [&](size_t i) { runs[i].fetch_add(1); });
  for (size_t i = 0; i < runs.size(); ++i) ASSERT_EQ(runs[i].load(), 1) << "item " << i;
}

TEST(HostWorkersTest, WorkersTakeItemsBesideTheCaller) {
  HostWorkers workers(1);
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> other_ran{false};
  // The caller's first item waits until another thread has run one: it can
  // only return if a worker took part.
  workers.ParallelFor(2, [&](size_t) {
    if (std::this_thread::get_id() != caller) {
      other_ran = true;
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!other_ran && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  });
  EXPECT_TRUE(other_ran);
}

TEST(HostWorkersTest, ConcurrentCallersEachGetTheirOwnItems) {
  HostWorkers workers(2);
  constexpr int kCallers = 4;
  constexpr size_t kItems = 2000;
  std::vector<std::vector<std::atomic<int>>> runs(kCallers);
  for (auto& per_caller : runs) per_caller = std::vector<std::atomic<int>>(kItems);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < 5; ++round) {
        workers.ParallelFor(kItems, [&](size_t i) { runs[c][i].fetch_add(1); });
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  for (int c = 0; c < kCallers; ++c) {
    for (size_t i = 0; i < kItems; ++i) ASSERT_EQ(runs[c][i].load(), 5) << c << "/" << i;
  }
}

TEST(HostWorkersTest, NoWorkersRunsEverythingOnTheCaller) {
  HostWorkers workers(0);
  int ran = 0;
  workers.ParallelFor(7, [&](size_t) { ++ran; });
  EXPECT_EQ(ran, 7);
}

}  // namespace
}  // namespace kvcache::gpu
