// The data lane's bounds on connections (DataLane), and what it reports of
// them.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvcache::service {

// How many connections the lane holds and how long one may take to open.
struct LaneLimits {
  // Connections held at once; each holds a thread and a buffer as large as
  // its largest frame. A new connection past it cuts the one that has been
  // opening longest, or is refused where all have opened.
  int max_connections = 1024;
  // Of those, how many may still be opening (TLS handshake, preamble, AUTH
  // where the server has tenants). A new connection past it cuts the one
  // that has been opening longest: peers that never authenticate hold at
  // most this many slots, and a worker gets in as long as fewer than this
  // many connections arrive while it opens (a round trip or two).
  int max_opening = 64;
  // A connection that has not opened within this of its connect is cut.
  absl::Duration opening_timeout = absl::Seconds(10);

  // InvalidArgument naming the field (as its flag, lane_max_...) that is out of range.
  absl::Status Validate() const;
};

// Connections the lane holds and has closed unasked, read for metrics.
struct LaneCounts {
  int open = 0;     // opened: serving their tenant
  int opening = 0;  // accepted, not yet opened
  uint64_t refused_busy = 0;         // max_connections had opened
  uint64_t cut_opening_timeout = 0;  // did not open within opening_timeout
  uint64_t cut_displaced = 0;        // cut to make room for a newer one
};

}  // namespace kvcache::service
