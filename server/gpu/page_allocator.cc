#include "gpu/page_allocator.h"

#include <algorithm>
#include <cassert>
#include <limits>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/status_macros.h"

namespace kvcache::gpu {
namespace {

constexpr vk::BufferUsageFlags kSlabUsage = vk::BufferUsageFlagBits::eStorageBuffer |
                                            vk::BufferUsageFlagBits::eTransferSrc |
                                            vk::BufferUsageFlagBits::eTransferDst;

BufferSpec SlabSpec(uint64_t bytes, bool host_mapped) {
  using Flag = vk::MemoryPropertyFlagBits;
  if (host_mapped) {
    return {.bytes = bytes,
            .usage = kSlabUsage,
            .required_memory = Flag::eDeviceLocal | Flag::eHostVisible | Flag::eHostCoherent,
            .preferred_memory = Flag::eHostCached,
            .host_mapped = true};
  }
  return {.bytes = bytes, .usage = kSlabUsage, .required_memory = Flag::eDeviceLocal};
}

}  // namespace

absl::StatusOr<PagePlan> PlanPages(const Device& device, const PoolOptions& options) {
  const uint64_t page_bytes = options.page_bytes;
  const uint64_t max_range = device.max_storage_buffer_range();
  if (page_bytes == 0 || page_bytes > max_range) {
    return absl::InvalidArgumentError(absl::StrCat("page_bytes is ", page_bytes,
                                                   "; it must be between 1 and the device's ",
                                                   "maxStorageBufferRange (", max_range, ")"));
  }
  const uint64_t max_pages = options.budget_bytes / page_bytes;
  if (max_pages == 0 || max_pages >= kNoPage) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget_bytes ", options.budget_bytes, " holds ", max_pages, " pages of ",
                     page_bytes, " bytes; a pool needs between 1 and ", kNoPage - 1));
  }
  // A slab is bound whole as a storage buffer, so it may not outgrow the range.
  const uint64_t slab_bytes = std::min({options.slab_bytes, max_range, max_pages * page_bytes});
  const uint64_t pages_per_slab = std::max<uint64_t>(1, slab_bytes / page_bytes);
  return PagePlan{page_bytes, static_cast<uint32_t>(max_pages),
                  static_cast<uint32_t>(pages_per_slab)};
}

PageAllocator::PageAllocator(const Device& device, const PagePlan& plan, bool host_mapped)
    : device_(device),
      plan_(plan),
      host_mapped_(host_mapped),
      max_slabs_((plan.max_pages + plan.pages_per_slab - 1) / plan.pages_per_slab),
      refcounts_(new std::atomic<uint32_t>[plan.max_pages]),
      slabs_(new std::unique_ptr<Buffer>[max_slabs_]) {
  for (uint32_t page = 0; page < plan.max_pages; ++page) {
    refcounts_[page].store(0, std::memory_order_relaxed);
  }
  free_.reserve(plan.max_pages);
}

PoolStats PageAllocator::stats() const {
  absl::MutexLock lock(&mutex_);
  const uint32_t backed = backed_pages_.load(std::memory_order_relaxed);
  return PoolStats{.page_bytes = plan_.page_bytes,
                   .max_pages = plan_.max_pages,
                   .used_pages = backed - static_cast<uint32_t>(free_.size()),
                   .backed_pages = backed,
                   .slabs = slab_count_};
}

uint32_t PageAllocator::available_pages() const {
  absl::MutexLock lock(&mutex_);
  return AvailableLocked();
}

uint32_t PageAllocator::AvailableLocked() const {
  const uint32_t unbacked = plan_.max_pages - backed_pages_.load(std::memory_order_relaxed);
  return static_cast<uint32_t>(free_.size()) + unbacked;
}

absl::Status PageAllocator::Allocate(uint32_t count, std::vector<PageId>& out) {
  absl::MutexLock lock(&mutex_);
  if (count > AvailableLocked()) {
    return absl::ResourceExhaustedError(absl::StrCat("page pool budget exhausted: ", count,
                                                     " pages requested, ", AvailableLocked(),
                                                     " of ", plan_.max_pages, " available"));
  }
  // New slabs stay even if a later one fails: their pages wait in free_.
  while (free_.size() < count) RETURN_IF_ERROR(AddSlabLocked());
  out.reserve(out.size() + count);
  for (uint32_t i = 0; i < count; ++i) {
    const PageId page = free_.back();
    free_.pop_back();
    refcounts_[page].store(1, std::memory_order_relaxed);
    out.push_back(page);
  }
  return absl::OkStatus();
}

absl::Status PageAllocator::AddSlabLocked() {
  const uint32_t first_page = slab_count_ * plan_.pages_per_slab;
  const uint32_t pages = std::min(plan_.pages_per_slab, plan_.max_pages - first_page);
  absl::StatusOr<std::unique_ptr<Buffer>> slab =
      CreateBuffer(device_, SlabSpec(uint64_t{pages} * plan_.page_bytes, host_mapped_));
  if (!slab.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot back page-pool slab ", slab_count_, ": ", slab.status().message()));
  }
  slabs_[slab_count_++] = *std::move(slab);
  for (uint32_t i = pages; i > 0; --i) free_.push_back(first_page + i - 1);
  backed_pages_.store(first_page + pages, std::memory_order_release);
  return absl::OkStatus();
}

void PageAllocator::Retain(PageId page) {
  if (page >= plan_.max_pages) return ReportMisuse("Retain", page);
  std::atomic<uint32_t>& count = refcounts_[page];
  uint32_t seen = count.load(std::memory_order_relaxed);
  do {
    if (seen == 0) return ReportMisuse("Retain", page);
  } while (!count.compare_exchange_weak(seen, seen + 1, std::memory_order_relaxed));
}

void PageAllocator::Release(PageId page) {
  if (page >= plan_.max_pages) return ReportMisuse("Release", page);
  std::atomic<uint32_t>& count = refcounts_[page];
  uint32_t seen = count.load(std::memory_order_relaxed);
  do {
    if (seen == 0) return ReportMisuse("Release", page);
  } while (!count.compare_exchange_weak(seen, seen - 1, std::memory_order_acq_rel));
  if (seen == 1) {
    absl::MutexLock lock(&mutex_);
    free_.push_back(page);
  }
}

uint32_t PageAllocator::RefCount(PageId page) const {
  if (page >= plan_.max_pages) {
    ReportMisuse("RefCount", page);
    return 0;
  }
  return refcounts_[page].load(std::memory_order_relaxed);
}

PageLocation PageAllocator::Locate(PageId page) const {
  const uint32_t slab = page / plan_.pages_per_slab;
  const uint64_t offset = uint64_t{page % plan_.pages_per_slab} * plan_.page_bytes;
  const Buffer& buffer = *slabs_[slab];
  return {*buffer.buffer, offset, buffer.mapped == nullptr ? nullptr : buffer.mapped + offset};
}

void PageAllocator::ReportMisuse(std::string_view operation, PageId page) {
  LogError("PagePool::%s(%u): the page is not allocated (a reference-counting bug)", operation,
           page);
  assert(false && "PagePool reference-count call on a page that is not allocated");
}

}  // namespace kvcache::gpu
