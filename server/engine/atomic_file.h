// Crash-safe whole-file writes and plain whole-file reads (POSIX), for the
// saved-file store. Errors name the call, the path and the errno text.
#pragma once

#include <sys/uio.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvcache::engine {

// errno → status: ENOSPC, EDQUOT, EFBIG → RESOURCE_EXHAUSTED naming `data_dir`;
// ENOENT → NOT_FOUND; anything else → INTERNAL.
absl::Status FileErrorStatus(int error, absl::string_view call, absl::string_view path,
                             absl::string_view data_dir);

// Writes `pieces` to `<dir>/<temp_prefix><random>`, fsyncs it, renames it over
// `final_path` (in `dir`) and fsyncs `dir`. On failure before the rename the
// temporary is removed and `final_path` is untouched.
absl::Status WriteFileAtomically(const std::string& dir, absl::string_view temp_prefix,
                                 const std::string& final_path, absl::Span<const iovec> pieces);

absl::Status SyncDirectory(const std::string& dir);

// The whole file at `path`; `data_dir` only names the directory in errors.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path, absl::string_view data_dir);

}  // namespace kvcache::engine
