// A few threads that share out the native CPU kernels' work on large calls
// (gpu/host_quantizer.cc), the way lavapipe shares a shader dispatch among its
// threads: on a CPU device the cores are the device. One process-wide set,
// started on first use, one thread fewer than the cores (the caller works too).
#pragma once

#include <atomic>
#include <cstddef>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace kvcache::gpu {

class HostWorkers {
 public:
  static HostWorkers& Shared();
  explicit HostWorkers(size_t threads);
  ~HostWorkers();

  size_t threads() const { return threads_.size(); }
  // Runs work(i) once for every i in [0, count), on the caller and the idle
  // workers, and returns when all have run. Calls from several threads share
  // the workers.
  void ParallelFor(size_t count, absl::FunctionRef<void(size_t)> work);

 private:
  struct Task;
  void WorkerLoop();
  // Claims and runs items of `task` until none are left.
  static void Drain(Task& task);
  bool HasWorkOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    return stopping_ || !tasks_.empty();
  }

  absl::Mutex mutex_;
  std::deque<std::shared_ptr<Task>> tasks_ ABSL_GUARDED_BY(mutex_);
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvcache::gpu
