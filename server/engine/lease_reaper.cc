#include "engine/lease_reaper.h"

#include "core/log.h"

namespace kvcache::engine {

LeaseReaper::LeaseReaper(Engine& engine, absl::Duration interval)
    : engine_(engine), interval_(interval), thread_([this] { Run(); }) {}

LeaseReaper::~LeaseReaper() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  thread_.join();
}

void LeaseReaper::Run() {
  for (;;) {
    const auto [caches, snapshots] = engine_.ExpireLeases();
    if (caches + snapshots > 0) {
      LogInfo("leases ran out: deleted %d caches, released %d snapshots", caches, snapshots);
    }
    absl::MutexLock lock(&mutex_);
    mutex_.AwaitWithTimeout(absl::Condition(&stopping_), interval_);
    if (stopping_) return;
  }
}

}  // namespace kvcache::engine
