#include "engine/files/atomic_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "engine/files/fresh_memory.h"

namespace kvcache::engine {
namespace {

// Owns a file descriptor; Close() reports the error a plain close would drop.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int Close() {
    int result = ::close(std::exchange(fd_, -1));
    return result == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

struct TempFile {
  std::string path;
  int fd = -1;
};

absl::StatusOr<TempFile> CreateTempFile(const std::string& dir, absl::string_view prefix) {
  absl::BitGen random;
  for (int attempt = 0;; ++attempt) {
    std::string path = absl::StrFormat("%s/%s%016x", dir, prefix, absl::Uniform<uint64_t>(random));
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) return TempFile{std::move(path), fd};
    if (errno != EEXIST || attempt == 8) return FileErrorStatus(errno, "open", path, dir);
  }
}

// writev until every byte is out: the kernel may write less than asked, and
// takes at most IOV_MAX pieces per call.
absl::Status WriteAll(int fd, absl::Span<const iovec> pieces, const std::string& path,
                      const std::string& dir) {
  std::vector<iovec> pending(pieces.begin(), pieces.end());
  size_t next = 0;
  while (next < pending.size()) {
    if (pending[next].iov_len == 0) {
      ++next;
      continue;
    }
    const int count = static_cast<int>(std::min<size_t>(pending.size() - next, IOV_MAX));
    ssize_t written = ::writev(fd, &pending[next], count);
    if (written < 0 && errno == EINTR) continue;
    if (written < 0) return FileErrorStatus(errno, "write", path, dir);
    for (size_t left = static_cast<size_t>(written); left > 0;) {
      size_t step = std::min(left, pending[next].iov_len);
      pending[next].iov_base = static_cast<char*>(pending[next].iov_base) + step;
      pending[next].iov_len -= step;
      left -= step;
      if (pending[next].iov_len == 0) ++next;
    }
  }
  return absl::OkStatus();
}

absl::Status WriteAndSync(TempFile& temp, absl::Span<const iovec> pieces, const std::string& dir) {
  ScopedFd fd(temp.fd);
  RETURN_IF_ERROR(WriteAll(fd.get(), pieces, temp.path, dir));
  if (::fsync(fd.get()) != 0) return FileErrorStatus(errno, "fsync", temp.path, dir);
  if (int error = fd.Close(); error != 0) return FileErrorStatus(error, "close", temp.path, dir);
  return absl::OkStatus();
}

}  // namespace

absl::Status FileErrorStatus(int error, absl::string_view call, absl::string_view path,
                             absl::string_view data_dir) {
  const std::string what = absl::StrCat(call, " ", path, ": ", std::strerror(error));
  switch (error) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
      return absl::ResourceExhaustedError(absl::StrCat("data dir ", data_dir, " is full: ", what));
    case ENOENT:
      return absl::NotFoundError(what);
    default:
      return absl::InternalError(what);
  }
}

absl::Status WriteFileAtomically(const std::string& dir, absl::string_view temp_prefix,
                                 const std::string& final_path, absl::Span<const iovec> pieces) {
  ASSIGN_OR_RETURN(TempFile temp, CreateTempFile(dir, temp_prefix));
  absl::Status written = WriteAndSync(temp, pieces, dir);
  if (written.ok() && ::rename(temp.path.c_str(), final_path.c_str()) != 0) {
    written = FileErrorStatus(errno, "rename", temp.path, dir);
  }
  if (!written.ok()) {
    ::unlink(temp.path.c_str());
    return written;
  }
  return SyncDirectory(dir);
}

absl::Status SyncDirectory(const std::string& dir) {
  ScopedFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return FileErrorStatus(errno, "open", dir, dir);
  if (::fsync(fd.get()) != 0) return FileErrorStatus(errno, "fsync", dir, dir);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, absl::string_view data_dir) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return FileErrorStatus(errno, "open", path, data_dir);
  struct stat info;
  if (::fstat(fd.get(), &info) != 0) return FileErrorStatus(errno, "fstat", path, data_dir);
  std::string bytes;
  bytes.reserve(static_cast<size_t>(info.st_size));
  PrepareFreshBuffer(bytes.data(), bytes.capacity());  // then the zero fill below is cheap
  bytes.resize(static_cast<size_t>(info.st_size));
  size_t filled = 0;
  while (filled < bytes.size()) {
    ssize_t got = ::read(fd.get(), bytes.data() + filled, bytes.size() - filled);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return FileErrorStatus(errno, "read", path, data_dir);
    if (got == 0) break;  // shrank under us: return what is there, decoding will judge it
    filled += static_cast<size_t>(got);
  }
  bytes.resize(filled);
  return bytes;
}

absl::StatusOr<std::shared_ptr<const MappedFile>> MappedFile::Open(const std::string& path,
                                                                   absl::string_view data_dir) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return FileErrorStatus(errno, "open", path, data_dir);
  struct stat info;
  if (::fstat(fd.get(), &info) != 0) return FileErrorStatus(errno, "fstat", path, data_dir);
  const size_t size = static_cast<size_t>(info.st_size);
  if (size == 0) return std::shared_ptr<const MappedFile>(new MappedFile(nullptr, 0));
  void* data = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (data == MAP_FAILED) return FileErrorStatus(errno, "mmap", path, data_dir);
  std::shared_ptr<const MappedFile> mapped(new MappedFile(data, size));
  ::madvise(data, size, MADV_SEQUENTIAL);  // only advice: read ahead
  // Populating in one call costs a fraction of a fault per page, and a read
  // error surfaces here as a status instead of a signal later.
  constexpr int kPopulateRead = 22;  // MADV_POPULATE_READ (Linux 5.14)
  if (::madvise(data, size, kPopulateRead) != 0 && errno != EINVAL) {
    return FileErrorStatus(errno, "madvise(MADV_POPULATE_READ)", path, data_dir);
  }
  return mapped;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

}  // namespace kvcache::engine
