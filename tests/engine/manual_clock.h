// A lease clock that moves only when a test moves it.
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"
#include "engine/lease.h"

namespace kvcache::testing {

class ManualClock final : public engine::LeaseClock {
 public:
  absl::Time Now() const override { return absl::FromUnixNanos(now_ns_.load()); }
  void Advance(absl::Duration by) { now_ns_ += absl::ToInt64Nanoseconds(by); }

 private:
  std::atomic<int64_t> now_ns_{absl::ToUnixNanos(absl::FromUnixSeconds(1'800'000'000))};
};

}  // namespace kvcache::testing
