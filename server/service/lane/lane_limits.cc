#include "service/lane/lane_limits.h"

#include "absl/strings/str_cat.h"

namespace kvcache::service {

absl::Status LaneLimits::Validate() const {
  if (max_connections < 1) {
    return absl::InvalidArgumentError("lane_max_connections: must be at least 1");
  }
  if (max_opening < 1 || max_opening > max_connections) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lane_max_opening: must be from 1 to lane_max_connections (", max_connections, ")"));
  }
  if (opening_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("lane_opening_timeout: must be positive");
  }
  return absl::OkStatus();
}

}  // namespace kvcache::service
