// The bookkeeping half of the page pool: page ids, where each one's bytes
// are, slabs, reference counts, free lists.
//
//   refcounts_  [0 .. max_ids)     atomics, allocated up front
//   where_      [0 .. max_ids)     the page's slot: a device page (a place in a
//                                  slab), a host slot or a disk slot, tagged in
//                                  the top two bits; kNowhere while free
//   free_ids_   ids not allocated (max_ids = device + host + disk slots, so
//               every allocated id has a slot somewhere and ids never run out)
//   free_       device slots not in use; host_free_, disk_free_ likewise
//   slabs_      [0 .. max_slabs)   filled lazily, never emptied
//
//   Allocate: pop an id and a device slot; when the device slots run dry,
//             back the next slab and push its slots (highest first, so they
//             pop in ascending order).
//   Release:  at count zero, push the id and its slot back (LIFO: warm slots
//             reused first).
//   Relocate: a page's bytes moved to another tier (PagePool::Evict, Promote):
//             its id stays, its slot changes.
//
// Accounts (PagePool::ForAccount): each allocated id records its account, and
// each account counts the slots it uses per tier. A slot is charged when it
// is taken (Allocate, TakeSlot, TakeDeviceSlots), so a batch of moves planned
// together cannot pass a limit, and uncharged when freed (ReturnSlot, the
// old slot in Relocate, the page's slot at count zero).
//
// Slab s holds device slots [s * pages_per_slab, min((s + 1) * pages_per_slab,
// max_pages)). With no lower tiers, ids and device slots coincide.
// Thread-safe; reference counting is lock-free except the push at zero.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "gpu/buffer.h"
#include "gpu/device.h"
#include "gpu/page_pool.h"

namespace kvcache::gpu {

// How a pool's pages are laid out: their size, how many the budget holds, and
// how many share one slab (one device buffer).
struct PagePlan {
  uint64_t page_bytes;
  uint32_t max_pages;  // device pages
  uint32_t pages_per_slab;
  uint32_t max_host_pages = 0;
  uint32_t max_disk_pages = 0;
};

// Validates `options` against `device`: INVALID_ARGUMENT for a zero page, a
// page larger than maxStorageBufferRange, a budget under one page, or more
// pages (over all tiers) than a PageId can count.
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
  PageAllocator(const Device& device, const PagePlan& plan, bool host_mapped,
                DiskBudget* disk_budget = nullptr);

  const PagePlan& plan() const { return plan_; }
  bool host_mapped() const { return host_mapped_; }
  uint32_t max_ids() const { return max_ids_; }
  PoolStats stats() const;
  uint32_t available_pages(AccountId account) const;

  void SetAccountLimits(AccountId account, const AccountLimits& limits);
  AccountUsage Usage(AccountId account) const;
  // Only for held pages.
  AccountId AccountOf(PageId page) const;
  // Whether `account` may take another slot of `tier`.
  bool HasRoom(Tier tier, AccountId account) const;

  absl::Status Allocate(uint32_t count, std::vector<PageId>& out, AccountId account);
  uint64_t refused_allocations() const { return refused_.load(std::memory_order_acquire); }
  uint32_t last_shortfall() const { return last_shortfall_.load(std::memory_order_acquire); }
  static PagePool::Refusals RefusalsOnThisThread();
  void Retain(PageId page);
  bool TryRetain(PageId page);
  void Release(PageId page);
  uint32_t RefCount(PageId page) const;

  // True for an allocated page whose bytes are in a backed device slot.
  bool IsBacked(PageId page) const;
  // Only for device pages.
  PageLocation Locate(PageId page) const;
  // Only for held pages.
  Tier Where(PageId page) const;
  uint32_t SlotOf(PageId page) const;

  // Tier moves (PagePool::Evict, Promote), serialised by their caller.
  // A free device slot for each of `pages` (in order), backing slabs as
  // needed, each charged to its page's account; all or none.
  absl::Status TakeDeviceSlots(absl::Span<const PageId> pages, std::vector<uint32_t>& out);
  PageLocation LocateSlot(uint32_t device_slot) const;
  // A free host or disk slot, if the tier has one and `account` room in it.
  std::optional<uint32_t> TakeSlot(Tier tier, AccountId account);
  void ReturnSlot(Tier tier, uint32_t slot, AccountId account);
  // The page's bytes now live in `slot` of `tier`; its old slot is freed.
  void Relocate(PageId page, Tier tier, uint32_t slot);
  // The host page that went there first and is still there (of `only`'s
  // pages, when given), retained (the caller releases it once moved), with its
  // host slot and a disk slot taken for it; none when no such page is left or
  // the disk tier is full. Pages whose account has no room left on disk keep
  // their place in line and are passed over. Only kept when there is a disk
  // tier to move it to.
  struct Demotion {
    PageId page;
    uint32_t host_slot;
    uint32_t disk_slot;
    uint64_t arrival;  // its place in line
  };
  std::optional<Demotion> TakeOldestHostPageToDemote(std::optional<AccountId> only = std::nullopt);
  // A demotion that could not be written: its disk slot is freed and the
  // page, still in host memory, goes back to the front of its account's
  // line, so that it stays the next to move down.
  void UndoDemotion(const Demotion& demotion);
  void CountMoves(Tier from, Tier to, uint32_t pages);
  // How a freed disk slot's space goes back to the file system (true: it
  // did); until it does, the slot stays charged to the disk budget.
  void SetDiskDiscard(std::function<bool(uint32_t)> discard);

 private:
  // A page's arrival in host memory; `order` counts arrivals pool-wide.
  struct HostArrival {
    uint64_t order;
    PageId page;
    uint32_t slot;
  };
  // What the account keeps per tier: its limits and the slots it holds, and
  // its host pages in the order they arrived (entries go stale when the page
  // leaves or is freed: checked against where_ when looked at). One queue per
  // account, so that its own oldest page is found as fast as the pool's.
  struct Account {
    AccountLimits limits;
    uint32_t used[3] = {};
    std::deque<HostArrival> host_arrivals;
  };

  uint32_t AvailableLocked() const ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  // How many more slots of `tier` the account may take (UINT32_MAX: no limit).
  uint32_t RoomLocked(Tier tier, AccountId account) const ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  Account& AccountLocked(AccountId account) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  std::optional<uint32_t> TakeSlotLocked(Tier tier, AccountId account)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Frees a page whose count reached zero: its id and its slot.
  void FreeLocked(PageId page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void FreeSlotLocked(Tier tier, uint32_t slot, AccountId account)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  std::vector<uint32_t>& FreeSlotsLocked(Tier tier) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  bool StaleLocked(const HostArrival& arrival) const ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  void DropStaleArrivalsLocked(Account& account) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The account's oldest host page still there (stale entries ahead of it
  // dropped), or null.
  const HostArrival* OldestArrivalLocked(Account& account) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Allocates the next slab and pushes its pages onto the free list.
  absl::Status AddSlabLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // A reference-count call on a page that is not allocated: a bug in the caller.
  // Asserts in debug builds; logs and ignores the call in release builds.
  static void ReportMisuse(std::string_view operation, PageId page);
  void CountRefusal(uint32_t shortfall);

  const Device& device_;
  const PagePlan plan_;
  const bool host_mapped_;
  const uint32_t max_slabs_;
  const uint32_t max_ids_;
  DiskBudget* const disk_budget_;  // charged a page per disk slot in use; may be null
  const std::unique_ptr<std::atomic<uint32_t>[]> refcounts_;
  // Written under mutex_ (Allocate, Relocate, the free at zero); read without
  // it by the holders of the page, which no one relocates while they read.
  const std::unique_ptr<std::atomic<uint32_t>[]> where_;
  // Slots are written once, under mutex_, before backed_pages_ is raised past
  // their pages; readers of a backed page's slot need no lock.
  const std::unique_ptr<std::unique_ptr<Buffer>[]> slabs_;
  std::atomic<uint32_t> backed_pages_{0};
  // The account of each allocated id; read and written under mutex_ only.
  const std::unique_ptr<AccountId[]> account_of_;
  // Each host page's last arrival (HostArrival::order), under mutex_; only
  // with a disk tier. An entry is the page's arrival only while they agree:
  // an id freed and reused by another account, or a page that left and came
  // back to the same slot, leaves an older entry that must not count.
  const std::unique_ptr<uint64_t[]> arrival_of_;

  mutable absl::Mutex mutex_;
  uint32_t slab_count_ ABSL_GUARDED_BY(mutex_) = 0;
  uint32_t peak_used_ ABSL_GUARDED_BY(mutex_) = 0;
  std::vector<PageId> free_ids_ ABSL_GUARDED_BY(mutex_);
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(mutex_);  // device slots
  std::vector<uint32_t> host_free_ ABSL_GUARDED_BY(mutex_);
  std::vector<uint32_t> disk_free_ ABSL_GUARDED_BY(mutex_);
  // Disk slots whose space is charged to disk_budget_ (written, not discarded).
  std::vector<bool> disk_charged_ ABSL_GUARDED_BY(mutex_);
  std::function<bool(uint32_t)> discard_disk_slot_ ABSL_GUARDED_BY(mutex_);
  uint64_t host_arrivals_ ABSL_GUARDED_BY(mutex_) = 0;
  uint64_t moves_[3][3] ABSL_GUARDED_BY(mutex_) = {};  // [from tier][to tier], pages
  std::vector<Account> accounts_ ABSL_GUARDED_BY(mutex_);  // by AccountId, grown on use
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint32_t> last_shortfall_{0};
};

}  // namespace kvcache::gpu
