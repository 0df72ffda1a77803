// Crash-safe whole-file writes, and whole-file reads by copy or by mapping
// (POSIX), for the saved-file store. Errors name the call, the path and the errno text.
#pragma once

#include <sys/uio.h>

#include <memory>
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

// A whole file mapped read-only and populated, so that a load reads the page
// cache in place instead of copying it into fresh memory (which costs a page
// fault per 4 KiB in a VM). The mapping outlives a rename over the file or its
// unlink, the only ways kvcached replaces or removes a saved file; truncating
// it in place while mapped would fault the reader, so nothing does.
class MappedFile {
 public:
  static absl::StatusOr<std::shared_ptr<const MappedFile>> Open(const std::string& path,
                                                                absl::string_view data_dir);
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  absl::string_view bytes() const { return {static_cast<const char*>(data_), size_}; }

 private:
  MappedFile(void* data, size_t size) : data_(data), size_(size) {}
  void* data_;  // null for an empty file
  size_t size_;
};

}  // namespace kvcache::engine
