#include "service/request_log.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcache::service {

absl::Status RequestLogLimits::Validate() const {
  if (window <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("request_log_window: must be positive");
  }
  if (max_bytes == 0) {
    return absl::InvalidArgumentError(
        "request_log_bytes: must be positive (a log that keeps nothing replays nothing)");
  }
  return absl::OkStatus();
}

uint64_t RequestLog::CostOf(absl::string_view request_id, const Entry& entry) {
  constexpr uint64_t kSlotBytes = 128;
  return kSlotBytes + 2 * request_id.size() + entry.method.size() + entry.response.size();
}

absl::StatusOr<std::optional<std::string>> RequestLog::Begin(absl::string_view request_id,
                                                             absl::string_view method,
                                                             uint64_t fingerprint,
                                                             absl::Time now) {
  absl::MutexLock lock(&mu_);
  Prune(now);
  const auto [it, inserted] = entries_.try_emplace(request_id);
  Entry& entry = it->second;
  if (inserted) {
    entry.method = std::string(method);
    entry.fingerprint = fingerprint;
    return std::nullopt;
  }
  if (entry.method != method || entry.fingerprint != fingerprint) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id: already used by a different ", entry.method,
                     " request; each request needs an id of its own"));
  }
  if (entry.running) {
    return absl::UnavailableError(
        "request_id: the first request with this id is still running; retry");
  }
  ++replayed_;
  return entry.response;
}

void RequestLog::Finish(absl::string_view request_id, bool succeeded, std::string response,
                        absl::Time now) {
  absl::MutexLock lock(&mu_);
  const auto it = entries_.find(request_id);
  if (it == entries_.end()) return;
  Entry& entry = it->second;
  entry.response = std::move(response);
  const uint64_t cost = CostOf(request_id, entry);
  if (!succeeded || cost > limits_.max_bytes) {
    entries_.erase(it);
    return;
  }
  entry.running = false;
  bytes_ += cost;
  answered_.push_back({std::string(request_id), now});
  Prune(now);
}

RequestLogCounts RequestLog::Counts(absl::Time now) {
  absl::MutexLock lock(&mu_);
  Prune(now);
  return {.entries = answered_.size(), .bytes = bytes_, .replayed = replayed_};
}

void RequestLog::Prune(absl::Time now) {
  while (!answered_.empty() && now - answered_.front().at >= limits_.window) DropOldest();
  while (bytes_ > limits_.max_bytes && !answered_.empty()) DropOldest();
}

void RequestLog::DropOldest() {
  // Every answered id is in entries_ until this drops it (running ids are
  // never in answered_).
  const auto it = entries_.find(answered_.front().request_id);
  if (it != entries_.end()) {
    bytes_ -= CostOf(it->first, it->second);
    entries_.erase(it);
  }
  answered_.pop_front();
}

}  // namespace kvcache::service
