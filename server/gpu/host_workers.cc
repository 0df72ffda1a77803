#include "gpu/host_workers.h"

#include <algorithm>

namespace kvcache::gpu {

struct HostWorkers::Task {
  Task(size_t count, absl::FunctionRef<void(size_t)> work) : count(count), work(work) {}
  const size_t count;
  const absl::FunctionRef<void(size_t)> work;
  std::atomic<size_t> next{0};
  absl::Mutex mutex;
  size_t finished ABSL_GUARDED_BY(mutex) = 0;
  bool AllFinished() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex) { return finished == count; }
};

HostWorkers& HostWorkers::Shared() {
  // Never destroyed: workers may still be parked in it when the process exits.
  static HostWorkers* workers = new HostWorkers(
      std::max<size_t>(std::thread::hardware_concurrency(), 1) - 1);
  return *workers;
}

HostWorkers::HostWorkers(size_t threads) {
  for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { WorkerLoop(); });
}

HostWorkers::~HostWorkers() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

void HostWorkers::Drain(Task& task) {
  size_t ran = 0;
  for (size_t i = task.next.fetch_add(1); i < task.count; i = task.next.fetch_add(1)) {
    task.work(i);
    ++ran;
  }
  absl::MutexLock lock(&task.mutex);
  task.finished += ran;
}

void HostWorkers::ParallelFor(size_t count, absl::FunctionRef<void(size_t)> work) {
  auto task = std::make_shared<Task>(count, work);
  if (count > 1 && !threads_.empty()) {
    absl::MutexLock lock(&mutex_);
    tasks_.push_back(task);
  }
  Drain(*task);
  absl::MutexLock lock(&task->mutex);
  task->mutex.Await(absl::Condition(task.get(), &Task::AllFinished));
}

void HostWorkers::WorkerLoop() {
  while (true) {
    std::shared_ptr<Task> task;
    {
      absl::MutexLock lock(&mutex_);
      mutex_.Await(absl::Condition(this, &HostWorkers::HasWorkOrStopping));
      if (stopping_) return;
      task = tasks_.front();
      // Every item claimed: no one else need look at it.
      if (task->next.load() >= task->count) {
        tasks_.pop_front();
        continue;
      }
    }
    Drain(*task);
  }
}

}  // namespace kvcache::gpu
