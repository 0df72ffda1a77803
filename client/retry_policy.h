// Which calls the client sends again, and how: gRPC's retry policy for the
// unary calls and streams it may retry by itself, and the same attempts and
// backoff for the streams the client retries by hand (ImportSnapshot
// and CopySnapshot's import, whose bytes gRPC does not keep).
#pragma once

#include <string>

#include "absl/functional/function_ref.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include <grpcpp/support/status.h>

namespace kvcache::internal {

struct RetryPolicy {
  int max_attempts = 4;
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(1);
  int backoff_multiplier = 2;
};
inline constexpr RetryPolicy kRetryPolicy;

// The methods of kvcache.v1.KvCacheService that gRPC retries on UNAVAILABLE:
// reads; every call that carries a request_id, which the server answers
// once (kvcache.proto, "Retries"); and calls whose repeat does nothing more.
absl::Span<const char* const> RetriedMethods();

// The channel's service config: RetriedMethods under kRetryPolicy.
std::string RetryServiceConfig();

// Runs `attempt` until it is not UNAVAILABLE, at most kRetryPolicy's
// attempts, waiting a random part of each backoff between them (as gRPC
// does) and never past `deadline`. For a call gRPC cannot retry itself.
grpc::Status RetryUnavailable(absl::Time deadline, absl::FunctionRef<grpc::Status()> attempt);

}  // namespace kvcache::internal
