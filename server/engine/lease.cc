#include "engine/lease.h"

namespace kvcache::engine {
namespace {

class SystemClock final : public LeaseClock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

}  // namespace

const LeaseClock& LeaseClock::System() {
  static const SystemClock clock;
  return clock;
}

}  // namespace kvcache::engine
