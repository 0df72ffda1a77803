// A plain HTTP/1.0 GET, for kvcachectl metrics and the tests that read
// kvcached's Prometheus endpoint; not a general HTTP client (no TLS, no
// redirects, no chunked bodies: HTTP/1.0 answers end at the close).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvcache {

// The body of GET http://`address``path`; UNAVAILABLE when nothing answers
// or the answer is not 200.
absl::StatusOr<std::string> HttpGet(const std::string& address, const std::string& path,
                                    absl::Duration timeout = absl::Seconds(10));

}  // namespace kvcache
