#include "gpu/tier_store.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvcache::gpu {
namespace {

absl::Status ErrnoStatus(int error, const char* call, const std::string& path) {
  const std::string message = absl::StrCat("disk tier ", path, ": ", call, ": ", strerror(error));
  if (error == ENOSPC || error == EDQUOT || error == EFBIG) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::InternalError(message);
}

}  // namespace

HostPageStore::HostPageStore(uint64_t page_bytes, uint32_t slots)
    : page_bytes_(page_bytes), blocks_((slots + kSlotsPerBlock - 1) / kSlotsPerBlock) {}

std::byte* HostPageStore::Slot(uint32_t slot) {
  std::unique_ptr<std::byte[]>& block = blocks_[slot / kSlotsPerBlock];
  if (block == nullptr) {
    block = std::make_unique_for_overwrite<std::byte[]>(kSlotsPerBlock * page_bytes_);
  }
  return block.get() + uint64_t{slot % kSlotsPerBlock} * page_bytes_;
}

absl::StatusOr<std::unique_ptr<DiskPageStore>> DiskPageStore::Create(std::string path,
                                                                     uint64_t page_bytes) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, "open", path);
  // Held for the process's life: a second kvcached on the same data dir would
  // overwrite this one's evicted pages.
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    ::close(fd);
    if (error == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "disk tier ", path, ": another kvcached uses this data_dir (its tier file is locked)"));
    }
    return ErrnoStatus(error, "flock", path);
  }
  if (::ftruncate(fd, 0) != 0) {
    const int error = errno;
    ::close(fd);
    return ErrnoStatus(error, "ftruncate", path);
  }
  return std::unique_ptr<DiskPageStore>(new DiskPageStore(std::move(path), page_bytes, fd));
}

DiskPageStore::~DiskPageStore() {
  ::close(fd_);
  ::unlink(path_.c_str());
}

absl::Status DiskPageStore::Write(uint32_t slot, const std::byte* bytes) {
  const off_t at = static_cast<off_t>(uint64_t{slot} * page_bytes_);
  for (uint64_t done = 0; done < page_bytes_;) {
    const ssize_t wrote = ::pwrite(fd_, bytes + done, page_bytes_ - done, at + done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) return ErrnoStatus(wrote < 0 ? errno : ENOSPC, "pwrite", path_);
    done += wrote;
  }
  return absl::OkStatus();
}

bool DiskPageStore::Discard(uint32_t slot) {
  const off_t at = static_cast<off_t>(uint64_t{slot} * page_bytes_);
  return ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, at,
                     static_cast<off_t>(page_bytes_)) == 0;
}

absl::Status DiskPageStore::Read(uint32_t slot, std::byte* bytes) const {
  const off_t at = static_cast<off_t>(uint64_t{slot} * page_bytes_);
  for (uint64_t done = 0; done < page_bytes_;) {
    const ssize_t got = ::pread(fd_, bytes + done, page_bytes_ - done, at + done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return ErrnoStatus(errno, "pread", path_);
    if (got == 0) return absl::DataLossError(absl::StrCat("disk tier ", path_, ": short read"));
    done += got;
  }
  return absl::OkStatus();
}

}  // namespace kvcache::gpu
