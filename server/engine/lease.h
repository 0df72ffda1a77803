// Leases on caches and snapshots: a handle with a time to live is released
// once no call has named it for that long. Renewal is what every call that
// names a handle does, so it must cost nothing on the Update path: a handle
// holds its deadline in an atomic, and only the reaper looks for expired
// ones, through a queue of deadlines (no scan over the handles).
#pragma once

#include <atomic>
#include <cstdint>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvcache::engine {

// Where the engine reads the time; tests substitute a manual clock.
class LeaseClock {
 public:
  virtual ~LeaseClock() = default;
  virtual absl::Time Now() const = 0;
  // absl::Now().
  static const LeaseClock& System();
};

// One handle's lease. ttl zero: none, it never expires. Renewals may run
// concurrently with each other and with the reaper's reads; the engine
// serialises renewal against expiry by doing both under the lock that finds
// the handle by id.
class Lease {
 public:
  explicit Lease(absl::Duration ttl = absl::ZeroDuration()) : ttl_(ttl) {}
  Lease(const Lease& other) : ttl_(other.ttl_), expires_ns_(other.expires_ns_.load()) {}

  absl::Duration ttl() const { return ttl_; }
  bool has_ttl() const { return ttl_ > absl::ZeroDuration(); }
  // Sets the deadline to `now` + ttl (nothing without a ttl).
  void Renew(absl::Time now) {
    if (has_ttl()) expires_ns_.store(absl::ToUnixNanos(now + ttl_), std::memory_order_relaxed);
  }
  // InfiniteFuture without a ttl.
  absl::Time expires_at() const {
    if (!has_ttl()) return absl::InfiniteFuture();
    return absl::FromUnixNanos(expires_ns_.load(std::memory_order_relaxed));
  }
  // What a call that names the handle does: false if the lease has run out
  // (the handle is gone for callers, even before the reaper releases it),
  // else renews it. Reads the clock only for a lease that has a ttl.
  bool RenewIfLive(const LeaseClock& clock) {
    if (!has_ttl()) return true;
    const absl::Time now = clock.Now();
    if (ExpiredAt(now)) return false;
    Renew(now);
    return true;
  }
  bool ExpiredAt(absl::Time now) const { return expires_at() <= now; }

 private:
  absl::Duration ttl_;
  std::atomic<int64_t> expires_ns_{0};
};

// Deadlines the reaper checks, earliest first. An entry is a hint: the
// handle may have been renewed (push it again at its new deadline) or
// released since (skip it). Not thread-safe; its owner's lock guards it.
class LeaseQueue {
 public:
  void Push(absl::Time deadline, std::string id) {
    if (deadline != absl::InfiniteFuture()) due_.emplace(deadline, std::move(id));
  }
  // Removes and returns up to `limit` ids whose deadline is at or before `now`.
  std::vector<std::string> PopDue(absl::Time now, size_t limit) {
    std::vector<std::string> ids;
    while (!due_.empty() && due_.top().first <= now && ids.size() < limit) {
      ids.push_back(due_.top().second);
      due_.pop();
    }
    return ids;
  }
  // The earliest deadline, InfiniteFuture when none.
  absl::Time Next() const { return due_.empty() ? absl::InfiniteFuture() : due_.top().first; }
  size_t size() const { return due_.size(); }

 private:
  using Due = std::pair<absl::Time, std::string>;
  std::priority_queue<Due, std::vector<Due>, std::greater<Due>> due_;
};

// How many expired handles one pass of the reaper retires under one hold of
// a registry's lock, so that the calls that look ids up wait briefly.
inline constexpr size_t kExpiriesPerLock = 64;

}  // namespace kvcache::engine
