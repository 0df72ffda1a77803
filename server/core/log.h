// Leveled logging to stderr, one line per event (abseil 20220623 ships no
// absl/log). Two formats, chosen once at start (kvcached --log_format):
//   text: "I 2026-11-28 02:43:05.147 kvcached] rpc method=GetStats code=OK"
//         (a message, or an event's name and its fields as key=value, values
//         quoted where they hold spaces, quotes or '=')
//   json: {"time":"2026-11-28T02:43:05.147Z","level":"info","event":"rpc",
//          "method":"GetStats","code":"OK"}  (a message is event "message"
//          with its text in "msg")
#pragma once

#include <initializer_list>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvcache {

enum class LogLevel { kInfo, kWarning, kError };
enum class LogFormat { kText, kJson };

// Set before any thread logs (main does, from its flag).
void SetLogFormat(LogFormat format);
LogFormat GetLogFormat();

struct LogField {
  absl::string_view key;
  std::string value;
};

void WriteLogLine(LogLevel level, absl::string_view message);
// An event with fields, for lines that tools read (access logs, failures).
void LogEvent(LogLevel level, absl::string_view event, std::initializer_list<LogField> fields);

template <typename... Args>
void LogInfo(const absl::FormatSpec<Args...>& format, const Args&... args) {
  WriteLogLine(LogLevel::kInfo, absl::StrFormat(format, args...));
}
template <typename... Args>
void LogWarning(const absl::FormatSpec<Args...>& format, const Args&... args) {
  WriteLogLine(LogLevel::kWarning, absl::StrFormat(format, args...));
}
template <typename... Args>
void LogError(const absl::FormatSpec<Args...>& format, const Args&... args) {
  WriteLogLine(LogLevel::kError, absl::StrFormat(format, args...));
}

// At most `lines` lines per `period` of one kind, so a peer that fails on
// purpose (a handshake, a protocol) cannot fill the log; the first line let
// through after some were held back says how many.
class LogLimiter {
 public:
  LogLimiter(int lines, absl::Duration period) : lines_(lines), period_(period) {}
  // Whether a line may go out at `now`; then `held_back` is how many did not
  // since the last one that did.
  bool Allow(absl::Time now, uint64_t& held_back);

 private:
  const int lines_;
  const absl::Duration period_;
  absl::Mutex mutex_;
  absl::Time window_start_ ABSL_GUARDED_BY(mutex_) = absl::InfinitePast();
  int written_ ABSL_GUARDED_BY(mutex_) = 0;  // in the window
  uint64_t held_back_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace kvcache
