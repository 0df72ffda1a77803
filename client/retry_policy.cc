#include "retry_policy.h"

#include <algorithm>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace kvcache::internal {

// Streams are retried only before their first answer arrives (gRPC's rule),
// so a Fetch or ExportSnapshot is never sent again half-read. Not listed:
// Update (its expected_offset lets the caller resume), ImportSnapshot
// (retried by hand, RetryUnavailable, as CopySnapshot's import is) and
// EvictSnapshots (a repeat would move more pages).
constexpr const char* kRetriedMethods[] = {
    "CreateCache",      "GetCache",          "ListCaches",       "DeleteCache",
    "Trim",             "Snapshot",          "Restore",          "MergeSnapshots",
    "SplitSnapshot",    "ReleaseSnapshot",   "ListSnapshots",    "ExtractRow",
    "FilterRows",       "MergeCaches",       "ExtendCache",      "BeginSpeculation",
    "CommitSpeculation", "AbortSpeculation", "GetStats",         "RenewLease",
    "SetPinned",        "SaveSnapshot",      "LoadSnapshot",     "ListSaved",
    "DeleteSaved",      "PublishPrefix",     "LookupPrefix",     "ListPrefixes",
    "PullSnapshot",     "Fetch",             "ExportSnapshot",
};

absl::Span<const char* const> RetriedMethods() { return kRetriedMethods; }

namespace {

std::string Seconds(absl::Duration duration) {
  return absl::StrFormat("%gs", absl::ToDoubleSeconds(duration));
}

}  // namespace

std::string RetryServiceConfig() {
  const std::string names = absl::StrJoin(
      kRetriedMethods, ",", [](std::string* out, const char* method) {
        absl::StrAppend(out, R"({"service":"kvcache.v1.KvCacheService","method":")", method,
                        R"("})");
      });
  return absl::StrCat(R"({"methodConfig":[{"name":[)", names, R"(],"retryPolicy":{)",
                      R"("maxAttempts":)", kRetryPolicy.max_attempts,
                      R"(,"initialBackoff":")", Seconds(kRetryPolicy.initial_backoff),
                      R"(","maxBackoff":")", Seconds(kRetryPolicy.max_backoff),
                      R"(","backoffMultiplier":)", kRetryPolicy.backoff_multiplier,
                      R"(,"retryableStatusCodes":["UNAVAILABLE"]}}]})");
}

grpc::Status RetryUnavailable(absl::Time deadline, absl::FunctionRef<grpc::Status()> attempt) {
  thread_local absl::BitGen random;
  absl::Duration backoff = kRetryPolicy.initial_backoff;
  for (int attempts = 1;; ++attempts) {
    grpc::Status status = attempt();
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE ||
        attempts == kRetryPolicy.max_attempts) {
      return status;
    }
    const absl::Duration wait = backoff * absl::Uniform(random, 0.0, 1.0);
    if (absl::Now() + wait >= deadline) return status;
    absl::SleepFor(wait);
    backoff = std::min(backoff * kRetryPolicy.backoff_multiplier, kRetryPolicy.max_backoff);
  }
}

}  // namespace kvcache::internal
