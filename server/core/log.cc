#include "core/log.h"

#include <atomic>
#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace kvcache {
namespace {

std::atomic<LogFormat> log_format{LogFormat::kText};

const char* LevelName(LogLevel level) {
  return level == LogLevel::kInfo ? "info" : level == LogLevel::kWarning ? "warning" : "error";
}

void Emit(const std::string& line) {
  static absl::Mutex mutex(absl::kConstInit);
  absl::MutexLock lock(&mutex);  // whole lines, never interleaved
  std::fprintf(stderr, "%s\n", line.c_str());
}

std::string TextPrefix(LogLevel level) {
  const char tag = level == LogLevel::kInfo ? 'I' : level == LogLevel::kWarning ? 'W' : 'E';
  return absl::StrCat(std::string(1, tag), " ",
                      absl::FormatTime("%Y-%m-%d %H:%M:%E3S", absl::Now(), absl::UTCTimeZone()),
                      " kvcached] ");
}

// logfmt's quoting: bare where nothing could split the value.
std::string TextValue(const std::string& value) {
  const bool bare = !value.empty() && value.find_first_of(" \"=\\\t\n") == std::string::npos;
  if (bare) return value;
  return absl::StrCat(
      "\"", absl::StrReplaceAll(value, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}}), "\"");
}

nlohmann::ordered_json JsonPrefix(LogLevel level) {
  nlohmann::ordered_json line;
  line["time"] = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  line["level"] = LevelName(level);
  return line;
}

// Invalid UTF-8 (from a client's bytes) becomes U+FFFD instead of throwing.
std::string Dump(const nlohmann::ordered_json& line) {
  return line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

void SetLogFormat(LogFormat format) { log_format.store(format, std::memory_order_relaxed); }
LogFormat GetLogFormat() { return log_format.load(std::memory_order_relaxed); }

void WriteLogLine(LogLevel level, absl::string_view message) {
  if (GetLogFormat() == LogFormat::kText) {
    Emit(absl::StrCat(TextPrefix(level), message));
    return;
  }
  nlohmann::ordered_json line = JsonPrefix(level);
  line["event"] = "message";
  line["msg"] = std::string(message);
  Emit(Dump(line));
}

void LogEvent(LogLevel level, absl::string_view event, std::initializer_list<LogField> fields) {
  if (GetLogFormat() == LogFormat::kText) {
    std::string line = absl::StrCat(TextPrefix(level), event);
    for (const LogField& field : fields) {
      absl::StrAppend(&line, " ", field.key, "=", TextValue(field.value));
    }
    Emit(line);
    return;
  }
  nlohmann::ordered_json line = JsonPrefix(level);
  line["event"] = std::string(event);
  for (const LogField& field : fields) line[std::string(field.key)] = field.value;
  Emit(Dump(line));
}

bool LogLimiter::Allow(absl::Time now, uint64_t& held_back) {
  absl::MutexLock lock(&mutex_);
  if (now - window_start_ >= period_) {
    window_start_ = now;
    written_ = 0;
  }
  if (written_ >= lines_) {
    ++held_back_;
    return false;
  }
  ++written_;
  held_back = held_back_;
  held_back_ = 0;
  return true;
}

}  // namespace kvcache
