#include "core/log.h"

#include <cstdio>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvcache {

void WriteLogLine(LogLevel level, std::string_view message) {
  static absl::Mutex mutex(absl::kConstInit);
  const char tag = level == LogLevel::kInfo ? 'I' : level == LogLevel::kWarning ? 'W' : 'E';
  const std::string stamp =
      absl::FormatTime("%Y-%m-%d %H:%M:%E3S", absl::Now(), absl::UTCTimeZone());
  absl::MutexLock lock(&mutex);
  std::fprintf(stderr, "%c %s kvcached] %.*s\n", tag, stamp.c_str(),
               static_cast<int>(message.size()), message.data());
}

}  // namespace kvcache
