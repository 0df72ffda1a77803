// The bookkeeping half of the page pool: slabs, reference counts, free list.
//
//   refcounts_  [0 .. max_pages)        atomics, allocated up front
//   free_       stack of PageId         capacity max_pages, allocated up front
//   slabs_      [0 .. max_slabs)        slots filled lazily, never emptied
//
//   Allocate: pop from free_; when it runs dry, back the next slab and push its
//             pages (highest first, so pages pop in ascending order).
//   Release:  at count zero, push back onto free_ (LIFO: warm pages reused first).
//
// Slab s holds pages [s * pages_per_slab, min((s + 1) * pages_per_slab, max_pages)).
// Thread-safe; reference counting is lock-free except the push at zero.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "gpu/buffer.h"
#include "gpu/device.h"
#include "gpu/page_pool.h"

namespace kvcache::gpu {

// How a pool's pages are laid out: their size, how many the budget holds, and
// how many share one slab (one device buffer).
struct PagePlan {
  uint64_t page_bytes;
  uint32_t max_pages;
  uint32_t pages_per_slab;
};

// Validates `options` against `device`: INVALID_ARGUMENT for a zero page, a
// page larger than maxStorageBufferRange, a budget under one page, or more
// pages than a PageId can count.
absl::StatusOr<PagePlan> PlanPages(const Device& device, const PoolOptions& options);

// Where a page's bytes are: `offset` into `slab`, and at `host` in the slab's
// mapping (null for slabs that are not host-mapped).
struct PageLocation {
  vk::Buffer slab;
  uint64_t offset;
  std::byte* host;
};

class PageAllocator {
 public:
  // `host_mapped` slabs live in host-visible memory mapped for their lifetime;
  // otherwise in device-local memory that only transfer commands reach.
  PageAllocator(const Device& device, const PagePlan& plan, bool host_mapped);

  const PagePlan& plan() const { return plan_; }
  bool host_mapped() const { return host_mapped_; }
  PoolStats stats() const;
  uint32_t available_pages() const;

  absl::Status Allocate(uint32_t count, std::vector<PageId>& out);
  void Retain(PageId page);
  void Release(PageId page);
  uint32_t RefCount(PageId page) const;

  // True for a page whose slab exists (whether or not it is allocated).
  bool IsBacked(PageId page) const { return page < backed_pages_.load(std::memory_order_acquire); }
  // Only for backed pages.
  PageLocation Locate(PageId page) const;

 private:
  uint32_t AvailableLocked() const ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  // Allocates the next slab and pushes its pages onto the free list.
  absl::Status AddSlabLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // A reference-count call on a page that is not allocated: a bug in the caller.
  // Asserts in debug builds; logs and ignores the call in release builds.
  static void ReportMisuse(std::string_view operation, PageId page);

  const Device& device_;
  const PagePlan plan_;
  const bool host_mapped_;
  const uint32_t max_slabs_;
  const std::unique_ptr<std::atomic<uint32_t>[]> refcounts_;
  // Slots are written once, under mutex_, before backed_pages_ is raised past
  // their pages; readers of a backed page's slot need no lock.
  const std::unique_ptr<std::unique_ptr<Buffer>[]> slabs_;
  std::atomic<uint32_t> backed_pages_{0};

  mutable absl::Mutex mutex_;
  uint32_t slab_count_ ABSL_GUARDED_BY(mutex_) = 0;
  std::vector<PageId> free_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace kvcache::gpu
