// Where evicted pages' bytes wait: host memory, and a scratch file on disk.
// Each store is an array of page-sized slots; the allocator (page_allocator.h)
// decides which slot holds which page. Neither is thread-safe: PagePool's
// Evict and Promote, which its caller serialises, are their only users.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvcache::gpu {

// Host memory in blocks of pages, allocated on first use and kept: eviction
// under pressure reuses warm memory instead of faulting in fresh pages.
class HostPageStore {
 public:
  HostPageStore(uint64_t page_bytes, uint32_t slots);
  std::byte* Slot(uint32_t slot);

 private:
  static constexpr uint32_t kSlotsPerBlock = 64;
  const uint64_t page_bytes_;
  std::vector<std::unique_ptr<std::byte[]>> blocks_;
};

// A file of page-sized slots, created empty (truncating what a former run
// left: evicted pages do not outlive the process that held their tables),
// locked against a second process (FAILED_PRECONDITION), and removed when the
// store goes. Space is taken as slots are written.
class DiskPageStore {
 public:
  static absl::StatusOr<std::unique_ptr<DiskPageStore>> Create(std::string path,
                                                               uint64_t page_bytes);
  ~DiskPageStore();
  DiskPageStore(const DiskPageStore&) = delete;
  DiskPageStore& operator=(const DiskPageStore&) = delete;

  absl::Status Write(uint32_t slot, const std::byte* bytes);
  absl::Status Read(uint32_t slot, std::byte* bytes) const;
  // Gives a free slot's disk space back (a hole punched in the file); false
  // where the file system cannot, and the space stays taken.
  bool Discard(uint32_t slot);

 private:
  DiskPageStore(std::string path, uint64_t page_bytes, int fd)
      : path_(std::move(path)), page_bytes_(page_bytes), fd_(fd) {}
  const std::string path_;
  const uint64_t page_bytes_;
  const int fd_;
};

}  // namespace kvcache::gpu
