// Answers kept by request_id, so that a retried request is answered once.
//
// A caller that got no answer (its connection dropped, UNAVAILABLE) cannot
// tell whether the server did the work; a create sent again would then make
// a second handle and a Trim would drop twice as many tokens. A request that
// carries a request_id is therefore answered here the second time, from the
// response its first run gave. Only successes are kept: a request that fails
// changes nothing, so running it again is safe. One log per tenant, so one
// tenant's ids never meet another's.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvcache::service {

struct RequestLogLimits {
  // How long an answer is kept after it was given: longer than any client
  // keeps retrying.
  absl::Duration window = absl::Minutes(10);
  // Most bytes of answers (and their ids) a tenant's log holds; past it the
  // oldest go first. A response larger than this is not kept.
  uint64_t max_bytes = 8 << 20;

  // InvalidArgument naming the field (as its flag, request_log_...) that is out of range.
  absl::Status Validate() const;
};

struct RequestLogCounts {
  uint64_t entries = 0;  // answers kept now
  uint64_t bytes = 0;    // what they hold, as counted against max_bytes
  uint64_t replayed = 0;  // requests answered from the log since start
};

class RequestLog {
 public:
  explicit RequestLog(RequestLogLimits limits) : limits_(limits) {}

  // What to do with a request that carries `request_id`: its earlier answer
  // (a serialized response) to send again; nullopt to run it, after which
  // Finish must be called with the same id. `method` and `fingerprint` (of
  // the request without its id) tell the same request from another one
  // reusing the id: INVALID_ARGUMENT naming request_id. UNAVAILABLE naming
  // request_id while the first run is still under way (the caller retries).
  absl::StatusOr<std::optional<std::string>> Begin(absl::string_view request_id,
                                                   absl::string_view method,
                                                   uint64_t fingerprint, absl::Time now);
  // The end of a run that Begin allowed: `response` is kept for replays when
  // the run succeeded, else the id is forgotten.
  void Finish(absl::string_view request_id, bool succeeded, std::string response,
              absl::Time now);

  RequestLogCounts Counts(absl::Time now);

 private:
  struct Entry {
    std::string method;
    uint64_t fingerprint = 0;
    bool running = true;
    std::string response;  // set once answered
  };
  // Bytes an answered entry is counted at: its id, its response, and a
  // fixed cost for the map slot and order entry around them.
  static uint64_t CostOf(absl::string_view request_id, const Entry& entry);
  // Drops answers past the window, then the oldest while over max_bytes.
  void Prune(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropOldest() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RequestLogLimits limits_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  // Answered ids, oldest first: the window is the same for all, so this is
  // also the order they expire in.
  struct Answered {
    std::string request_id;
    absl::Time at;
  };
  std::deque<Answered> answered_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t replayed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvcache::service
