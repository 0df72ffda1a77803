// PagePool's inside, shared by its two source files: page_pool.cc (the
// transfer paths) and page_pool_tiers.cc (moving pages between tiers).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "gpu/page_allocator.h"
#include "gpu/page_pool.h"
#include "gpu/quantizer.h"
#include "gpu/staged_transfer.h"
#include "gpu/tier_store.h"

namespace kvcache::gpu {

class PagePool::Impl {
 public:
  Impl(const Device& device, const PagePlan& plan, QuantKernel quantize_kernel,
       std::unique_ptr<StagedTransfer> staged, std::unique_ptr<DiskPageStore> disk,
       DiskBudget* disk_budget)
      : pages(device, plan, /*host_mapped=*/staged == nullptr || device.mapped_writes(),
              disk_budget),
        quantizer(device, pages, {.kernel = quantize_kernel}),
        staged_(std::move(staged)),
        host_(plan.page_bytes, plan.max_host_pages),
        disk_(std::move(disk)) {
    if (disk_ != nullptr) pages.SetDiskDiscard([this](uint32_t slot) { return disk_->Discard(slot); });
  }

  absl::Status Write(absl::Span<const WriteRun> runs);
  absl::Status Read(absl::Span<const ReadRun> runs);
  absl::Status Mapped(absl::Span<const ReadRun> runs,
                      std::vector<absl::Span<const std::byte>>& pieces);
  absl::Status Copy(absl::Span<const PageCopy> copies);
  absl::Status Move(absl::Span<const PageMove> moves);
  // Tiers (page_pool_tiers.cc).
  absl::StatusOr<uint32_t> Evict(absl::Span<const PageId> pages);
  absl::Status Promote(absl::Span<const PageId> pages);
  uint64_t eviction_epoch() const { return eviction_epoch_.load(std::memory_order_acquire); }

  PageAllocator pages;
  // Quantized pages; builds its pipelines and buffers on first use.
  Quantizer quantizer;

 private:
  // INVALID_ARGUMENT unless bytes [offset, offset + bytes) lie in a backed page.
  absl::Status CheckRange(absl::string_view call, size_t index, PageId page, uint64_t offset,
                          uint64_t bytes) const;
  BufferSlice SliceOf(PageId page, uint64_t offset, uint64_t bytes) const {
    const PageLocation location = pages.Locate(page);
    return {location.slab, location.offset + offset, bytes};
  }
  absl::Status CopyStaged(absl::Span<const PageCopy> copies);

  // Whole device slots to and from host memory, by either path.
  absl::Status ReadSlots(absl::Span<const std::pair<uint32_t, std::byte*>> reads);
  absl::Status WriteSlots(absl::Span<const std::pair<uint32_t, const std::byte*>> writes);
  // Where the next evicted page of `account` goes: a free host slot, one made
  // free by moving the oldest host page to disk, or a disk slot, within the
  // account's limits; none when full.
  absl::StatusOr<std::optional<std::pair<Tier, uint32_t>>> EvictionSlot(AccountId account);
  // Moves the oldest host page (of `only`'s pages, when given) to disk; false
  // when none can go.
  absl::StatusOr<bool> DemoteOldestHostPage(std::optional<AccountId> only = std::nullopt);
  // Which of `victims` (least recently used first) Evict sends straight to
  // disk: those that a full host tier, or a full host share of their account,
  // would move down again before the call ends.
  std::vector<bool> StraightToDisk(absl::Span<const PageId> victims) const;

  // Null on the direct path. With mapped writes, pages are mapped (Write
  // copies into them) and this ring does everything else.
  const std::unique_ptr<StagedTransfer> staged_;
  HostPageStore host_;
  const std::unique_ptr<DiskPageStore> disk_;  // null: no disk tier
  std::atomic<uint64_t> eviction_epoch_{0};
  // Evict and Promote one at a time across the whole pool. Each engine (one
  // per tenant) serialises its own, but an eviction may demote any account's
  // oldest host page, which another engine's Promote may be reading.
  absl::Mutex tier_mutex_;
};

}  // namespace kvcache::gpu
