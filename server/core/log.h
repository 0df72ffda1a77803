// Minimal leveled logging to stderr (abseil 20220623 ships no absl/log).
#pragma once

#include <string_view>

#include "absl/strings/str_format.h"

namespace kvcache {

enum class LogLevel { kInfo, kWarning, kError };

void WriteLogLine(LogLevel level, std::string_view message);

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

}  // namespace kvcache
