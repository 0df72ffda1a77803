// The thread that expires leases: every `interval` it asks the engine to
// delete the caches and release the snapshots whose leases ran out. Calls
// never wait for it beyond the brief holds of Engine::ExpireLeases, which
// looks at due deadlines only.
#pragma once

#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/engine.h"

namespace kvcache::engine {

class LeaseReaper {
 public:
  // Starts the thread.
  LeaseReaper(Engine& engine, absl::Duration interval);
  // Stops it and waits for it.
  ~LeaseReaper();
  LeaseReaper(const LeaseReaper&) = delete;
  LeaseReaper& operator=(const LeaseReaper&) = delete;

 private:
  void Run();

  Engine& engine_;
  const absl::Duration interval_;
  absl::Mutex mutex_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::thread thread_;
};

}  // namespace kvcache::engine
