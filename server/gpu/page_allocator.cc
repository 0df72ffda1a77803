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

// Host-mapped slabs take only the memory types the device chose its transfer
// path by (a large heap; cached where pages are read through the mapping).
BufferSpec SlabSpec(const Device& device, uint64_t bytes, bool host_mapped) {
  using Flag = vk::MemoryPropertyFlagBits;
  if (host_mapped) {
    return {.bytes = bytes,
            .usage = kSlabUsage,
            .required_memory = Flag::eDeviceLocal | Flag::eHostVisible | Flag::eHostCoherent,
            .allowed_memory_types = device.host_mapped_page_types(),
            .host_mapped = true};
  }
  return {.bytes = bytes, .usage = kSlabUsage, .required_memory = Flag::eDeviceLocal};
}

// where_ words: the tier in the top two bits, the slot below; all ones: free.
constexpr uint32_t kNowhere = UINT32_MAX;
constexpr uint32_t kTierShift = 30;
constexpr uint32_t kSlotMask = (uint32_t{1} << kTierShift) - 1;
// Slots per tier stay below kSlotMask (tier 3 is the free tag).
constexpr uint64_t kMaxTierSlots = kSlotMask;

uint32_t Encode(Tier tier, uint32_t slot) {
  return (static_cast<uint32_t>(tier) << kTierShift) | slot;
}
Tier TierOf(uint32_t word) { return static_cast<Tier>(word >> kTierShift); }
uint32_t SlotOfWord(uint32_t word) { return word & kSlotMask; }

uint32_t TierPages(uint64_t bytes, uint64_t page_bytes) {
  return static_cast<uint32_t>(std::min<uint64_t>(bytes / page_bytes, kMaxTierSlots - 1));
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
  if (max_pages == 0 || max_pages >= kMaxTierSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget_bytes ", options.budget_bytes, " holds ", max_pages, " pages of ",
                     page_bytes, " bytes; a pool needs between 1 and ", kMaxTierSlots - 1));
  }
  const uint32_t host_pages = TierPages(options.host_bytes, page_bytes);
  const uint32_t disk_pages =
      options.disk_path.empty() ? 0 : TierPages(options.disk_bytes, page_bytes);
  if (max_pages + host_pages + disk_pages >= kNoPage) {
    return absl::InvalidArgumentError(
        absl::StrCat("the pool's tiers hold ", max_pages + host_pages + disk_pages,
                     " pages; page ids count at most ", kNoPage - 1,
                     " (lower host_bytes or disk_bytes, or raise page_bytes)"));
  }
  // A slab is bound whole as a storage buffer, so it may not outgrow the range.
  const uint64_t slab_bytes = std::min({options.slab_bytes, max_range, max_pages * page_bytes});
  const uint64_t pages_per_slab = std::max<uint64_t>(1, slab_bytes / page_bytes);
  return PagePlan{.page_bytes = page_bytes,
                  .max_pages = static_cast<uint32_t>(max_pages),
                  .pages_per_slab = static_cast<uint32_t>(pages_per_slab),
                  .max_host_pages = host_pages,
                  .max_disk_pages = disk_pages};
}

PageAllocator::PageAllocator(const Device& device, const PagePlan& plan, bool host_mapped,
                             DiskBudget* disk_budget)
    : device_(device),
      plan_(plan),
      host_mapped_(host_mapped),
      max_slabs_((plan.max_pages + plan.pages_per_slab - 1) / plan.pages_per_slab),
      max_ids_(plan.max_pages + plan.max_host_pages + plan.max_disk_pages),
      disk_budget_(disk_budget),
      refcounts_(new std::atomic<uint32_t>[max_ids_]),
      where_(new std::atomic<uint32_t>[max_ids_]),
      slabs_(new std::unique_ptr<Buffer>[max_slabs_]),
      account_of_(new AccountId[max_ids_]()),
      arrival_of_(plan.max_disk_pages > 0 ? new uint64_t[max_ids_]() : nullptr),
      accounts_(1) {
  free_ids_.reserve(max_ids_);
  for (uint32_t id = max_ids_; id > 0; --id) {
    refcounts_[id - 1].store(0, std::memory_order_relaxed);
    where_[id - 1].store(kNowhere, std::memory_order_relaxed);
    free_ids_.push_back(id - 1);
  }
  free_.reserve(plan.max_pages);
  host_free_.reserve(plan.max_host_pages);
  for (uint32_t slot = plan.max_host_pages; slot > 0; --slot) host_free_.push_back(slot - 1);
  disk_charged_.resize(plan.max_disk_pages);
  disk_free_.reserve(plan.max_disk_pages);
  for (uint32_t slot = plan.max_disk_pages; slot > 0; --slot) disk_free_.push_back(slot - 1);
}

PoolStats PageAllocator::stats() const {
  absl::MutexLock lock(&mutex_);
  const uint32_t backed = backed_pages_.load(std::memory_order_relaxed);
  constexpr int kDevice = static_cast<int>(Tier::kDevice);
  constexpr int kHost = static_cast<int>(Tier::kHost);
  constexpr int kDisk = static_cast<int>(Tier::kDisk);
  return PoolStats{.page_bytes = plan_.page_bytes,
                   .max_pages = plan_.max_pages,
                   .used_pages = backed - static_cast<uint32_t>(free_.size()),
                   .peak_used_pages = peak_used_,
                   .backed_pages = backed,
                   .slabs = slab_count_,
                   .host_pages = plan_.max_host_pages - static_cast<uint32_t>(host_free_.size()),
                   .max_host_pages = plan_.max_host_pages,
                   .disk_pages = plan_.max_disk_pages - static_cast<uint32_t>(disk_free_.size()),
                   .max_disk_pages = plan_.max_disk_pages,
                   .evictions = moves_[kDevice][kHost] + moves_[kDevice][kDisk],
                   .demotions = moves_[kHost][kDisk],
                   .promotions_from_host = moves_[kHost][kDevice],
                   .promotions_from_disk = moves_[kDisk][kDevice]};
}

uint32_t PageAllocator::available_pages(AccountId account) const {
  absl::MutexLock lock(&mutex_);
  return std::min(AvailableLocked(), RoomLocked(Tier::kDevice, account));
}

void PageAllocator::SetAccountLimits(AccountId account, const AccountLimits& limits) {
  absl::MutexLock lock(&mutex_);
  AccountLocked(account).limits = limits;
}

AccountUsage PageAllocator::Usage(AccountId account) const {
  absl::MutexLock lock(&mutex_);
  if (account >= accounts_.size()) return {};
  const Account& held = accounts_[account];
  return {.device_pages = held.used[static_cast<int>(Tier::kDevice)],
          .host_pages = held.used[static_cast<int>(Tier::kHost)],
          .disk_pages = held.used[static_cast<int>(Tier::kDisk)],
          .limits = held.limits};
}

AccountId PageAllocator::AccountOf(PageId page) const {
  absl::MutexLock lock(&mutex_);
  return account_of_[page];
}

bool PageAllocator::HasRoom(Tier tier, AccountId account) const {
  absl::MutexLock lock(&mutex_);
  return RoomLocked(tier, account) > 0;
}

PageAllocator::Account& PageAllocator::AccountLocked(AccountId account) {
  if (account >= accounts_.size()) accounts_.resize(uint32_t{account} + 1);
  return accounts_[account];
}

uint32_t PageAllocator::RoomLocked(Tier tier, AccountId account) const {
  if (account >= accounts_.size()) return UINT32_MAX;
  const Account& held = accounts_[account];
  const int t = static_cast<int>(tier);
  const uint32_t limit = tier == Tier::kDevice ? held.limits.device_pages
                         : tier == Tier::kHost ? held.limits.host_pages
                                               : held.limits.disk_pages;
  if (limit == 0) return UINT32_MAX;
  return limit > held.used[t] ? limit - held.used[t] : 0;
}

uint32_t PageAllocator::AvailableLocked() const {
  const uint32_t unbacked = plan_.max_pages - backed_pages_.load(std::memory_order_relaxed);
  return static_cast<uint32_t>(free_.size()) + unbacked;
}

namespace {
thread_local PagePool::Refusals refusals_on_this_thread;

// A full pool's refusal. Its free pages are told only where nobody else
// holds any (no tenants): to a tenant they would show how much the others use.
absl::Status PoolExhausted(uint32_t count, absl::string_view what, bool only_the_pools,
                           uint32_t available, uint32_t max_pages) {
  if (!only_the_pools) {
    return absl::ResourceExhaustedError(absl::StrCat(kPoolExhausted, ": ", count, " ", what));
  }
  return absl::ResourceExhaustedError(absl::StrCat(kPoolExhausted, ": ", count, " ", what, ", ",
                                                   available, " of ", max_pages, " available"));
}
}  // namespace

PagePool::Refusals PageAllocator::RefusalsOnThisThread() { return refusals_on_this_thread; }

void PageAllocator::CountRefusal(uint32_t shortfall) {
  last_shortfall_.store(shortfall, std::memory_order_relaxed);
  refused_.fetch_add(1, std::memory_order_release);
  ++refusals_on_this_thread.count;
  refusals_on_this_thread.last_shortfall = shortfall;
}

absl::Status PageAllocator::Allocate(uint32_t count, std::vector<PageId>& out, AccountId account) {
  absl::MutexLock lock(&mutex_);
  const uint32_t room = RoomLocked(Tier::kDevice, account);
  if (count > room) {
    CountRefusal(count - room);
    const uint32_t limit = accounts_[account].limits.device_pages;
    return absl::ResourceExhaustedError(absl::StrCat(
        "max_device_bytes: ", kAccountExhausted, ": ", count, " pages requested, ", room, " of ",
        limit, " (", uint64_t{limit} * plan_.page_bytes, " bytes) left"));
  }
  const uint32_t available = AvailableLocked();
  if (count > available) {
    CountRefusal(count - available);
    return PoolExhausted(count, "pages requested", account == kPoolAccount, available,
                         plan_.max_pages);
  }
  // New slabs stay even if a later one fails: their slots wait in free_.
  while (free_.size() < count) RETURN_IF_ERROR(AddSlabLocked());
  assert(free_ids_.size() >= count);  // every allocated id holds a slot
  out.reserve(out.size() + count);
  for (uint32_t i = 0; i < count; ++i) {
    const PageId page = free_ids_.back();
    free_ids_.pop_back();
    where_[page].store(Encode(Tier::kDevice, free_.back()), std::memory_order_relaxed);
    free_.pop_back();
    account_of_[page] = account;
    refcounts_[page].store(1, std::memory_order_relaxed);
    out.push_back(page);
  }
  AccountLocked(account).used[static_cast<int>(Tier::kDevice)] += count;
  peak_used_ = std::max(peak_used_, backed_pages_.load(std::memory_order_relaxed) -
                                        static_cast<uint32_t>(free_.size()));
  return absl::OkStatus();
}

absl::Status PageAllocator::TakeDeviceSlots(absl::Span<const PageId> pages,
                                            std::vector<uint32_t>& out) {
  absl::MutexLock lock(&mutex_);
  const auto count = static_cast<uint32_t>(pages.size());
  std::vector<std::pair<AccountId, uint32_t>> needs;  // few accounts: a short list
  for (const PageId page : pages) {
    const AccountId account = account_of_[page];
    auto need = std::find_if(needs.begin(), needs.end(),
                             [&](const auto& entry) { return entry.first == account; });
    if (need == needs.end()) {
      needs.emplace_back(account, 1);
    } else {
      ++need->second;
    }
  }
  for (const auto& [account, need] : needs) {
    const uint32_t room = RoomLocked(Tier::kDevice, account);
    if (need > room) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "max_device_bytes: ", kAccountExhausted, ": ", need, " pages to bring back, ", room,
          " of ", accounts_[account].limits.device_pages, " left"));
    }
  }
  if (count > AvailableLocked()) {
    const bool only_the_pools = std::all_of(needs.begin(), needs.end(), [](const auto& need) {
      return need.first == kPoolAccount;
    });
    return PoolExhausted(count, "pages to bring back", only_the_pools, AvailableLocked(),
                         plan_.max_pages);
  }
  while (free_.size() < count) RETURN_IF_ERROR(AddSlabLocked());
  out.insert(out.end(), free_.end() - count, free_.end());
  free_.resize(free_.size() - count);
  for (const auto& [account, need] : needs) {
    AccountLocked(account).used[static_cast<int>(Tier::kDevice)] += need;
  }
  peak_used_ = std::max(peak_used_, backed_pages_.load(std::memory_order_relaxed) -
                                        static_cast<uint32_t>(free_.size()));
  return absl::OkStatus();
}

std::vector<uint32_t>& PageAllocator::FreeSlotsLocked(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return free_;
    case Tier::kHost:
      return host_free_;
    case Tier::kDisk:
      break;
  }
  return disk_free_;
}

std::optional<uint32_t> PageAllocator::TakeSlot(Tier tier, AccountId account) {
  absl::MutexLock lock(&mutex_);
  return TakeSlotLocked(tier, account);
}

std::optional<uint32_t> PageAllocator::TakeSlotLocked(Tier tier, AccountId account) {
  std::vector<uint32_t>& free = FreeSlotsLocked(tier);
  if (free.empty() || RoomLocked(tier, account) == 0) return std::nullopt;
  if (tier == Tier::kDisk && disk_budget_ != nullptr && !disk_charged_[free.back()]) {
    // Saved files may hold the rest of disk_bytes.
    if (!disk_budget_->TryCharge(plan_.page_bytes)) return std::nullopt;
    disk_charged_[free.back()] = true;
  }
  const uint32_t slot = free.back();
  free.pop_back();
  ++AccountLocked(account).used[static_cast<int>(tier)];
  return slot;
}

void PageAllocator::ReturnSlot(Tier tier, uint32_t slot, AccountId account) {
  absl::MutexLock lock(&mutex_);
  FreeSlotLocked(tier, slot, account);
}

void PageAllocator::FreeSlotLocked(Tier tier, uint32_t slot, AccountId account) {
  --AccountLocked(account).used[static_cast<int>(tier)];
  if (tier == Tier::kDisk && disk_budget_ != nullptr && discard_disk_slot_ != nullptr &&
      discard_disk_slot_(slot)) {
    disk_budget_->Credit(plan_.page_bytes);
    disk_charged_[slot] = false;
  }
  FreeSlotsLocked(tier).push_back(slot);
}

void PageAllocator::SetDiskDiscard(std::function<bool(uint32_t)> discard) {
  absl::MutexLock lock(&mutex_);
  discard_disk_slot_ = std::move(discard);
}

void PageAllocator::Relocate(PageId page, Tier tier, uint32_t slot) {
  absl::MutexLock lock(&mutex_);
  const uint32_t old = where_[page].load(std::memory_order_relaxed);
  FreeSlotLocked(TierOf(old), SlotOfWord(old), account_of_[page]);
  where_[page].store(Encode(tier, slot), std::memory_order_release);
  // Only a disk tier ever asks which host page came first.
  if (tier == Tier::kHost && plan_.max_disk_pages > 0) {
    Account& account = AccountLocked(account_of_[page]);
    arrival_of_[page] = host_arrivals_;
    account.host_arrivals.push_back({.order = host_arrivals_++, .page = page, .slot = slot});
    // Entries of pages that left or were freed stay until looked at; keep
    // them from outgrowing the pages the account holds there.
    if (account.host_arrivals.size() >
        2 * uint64_t{account.used[static_cast<int>(Tier::kHost)]} + 64) {
      DropStaleArrivalsLocked(account);
    }
  }
}

// Checked under the lock that frees ids: a page freed (its count at zero, its
// id perhaps reused, by any account) or moved since it arrived is no longer
// that arrival, even where it is back in host memory.
bool PageAllocator::StaleLocked(const HostArrival& arrival) const {
  return where_[arrival.page].load(std::memory_order_relaxed) !=
             Encode(Tier::kHost, arrival.slot) ||
         arrival_of_[arrival.page] != arrival.order;
}

void PageAllocator::DropStaleArrivalsLocked(Account& account) {
  std::deque<HostArrival> live;
  for (const HostArrival& arrival : account.host_arrivals) {
    if (!StaleLocked(arrival)) live.push_back(arrival);
  }
  account.host_arrivals.swap(live);
}

const PageAllocator::HostArrival* PageAllocator::OldestArrivalLocked(Account& account) {
  while (!account.host_arrivals.empty() && StaleLocked(account.host_arrivals.front())) {
    account.host_arrivals.pop_front();
  }
  return account.host_arrivals.empty() ? nullptr : &account.host_arrivals.front();
}

std::optional<PageAllocator::Demotion> PageAllocator::TakeOldestHostPageToDemote(
    std::optional<AccountId> only) {
  absl::MutexLock lock(&mutex_);
  for (;;) {
    // The oldest arrival among the accounts with room left on disk: a page
    // whose account has none stays, and is passed over, so that one tenant's
    // full disk share does not keep the others' pages from moving down.
    AccountId oldest_account = 0;
    const HostArrival* oldest = nullptr;
    for (size_t index = 0; index < accounts_.size(); ++index) {
      const auto id = static_cast<AccountId>(index);
      if (only.has_value() && id != *only) continue;
      if (RoomLocked(Tier::kDisk, id) == 0) continue;
      const HostArrival* arrival = OldestArrivalLocked(accounts_[id]);
      if (arrival != nullptr && (oldest == nullptr || arrival->order < oldest->order)) {
        oldest = arrival;
        oldest_account = id;
      }
    }
    if (oldest == nullptr) return std::nullopt;
    const PageId page = oldest->page;
    const uint32_t host_slot = oldest->slot;
    const uint64_t oldest_order = oldest->order;
    // None when the disk tier itself is full: no other page could go either.
    const std::optional<uint32_t> disk_slot = TakeSlotLocked(Tier::kDisk, oldest_account);
    if (!disk_slot.has_value()) return std::nullopt;
    accounts_[oldest_account].host_arrivals.pop_front();
    if (!TryRetain(page)) {
      // Back on the free list as it was taken: still charged to the disk
      // budget, so the next demotion need not win that room again.
      disk_free_.push_back(*disk_slot);
      --accounts_[oldest_account].used[static_cast<int>(Tier::kDisk)];
      continue;
    }
    return Demotion{
        .page = page, .host_slot = host_slot, .disk_slot = *disk_slot, .arrival = oldest_order};
  }
}

void PageAllocator::UndoDemotion(const Demotion& demotion) {
  absl::MutexLock lock(&mutex_);
  const AccountId account = account_of_[demotion.page];
  FreeSlotLocked(Tier::kDisk, demotion.disk_slot, account);
  // Every arrival still in line came later than this one, the oldest, so
  // the front keeps the line in order.
  accounts_[account].host_arrivals.push_front(
      {.order = demotion.arrival, .page = demotion.page, .slot = demotion.host_slot});
}

void PageAllocator::CountMoves(Tier from, Tier to, uint32_t pages) {
  absl::MutexLock lock(&mutex_);
  moves_[static_cast<int>(from)][static_cast<int>(to)] += pages;
}

void PageAllocator::FreeLocked(PageId page) {
  const uint32_t word = where_[page].load(std::memory_order_relaxed);
  FreeSlotLocked(TierOf(word), SlotOfWord(word), account_of_[page]);
  where_[page].store(kNowhere, std::memory_order_relaxed);
  free_ids_.push_back(page);
}

absl::Status PageAllocator::AddSlabLocked() {
  const uint32_t first_page = slab_count_ * plan_.pages_per_slab;
  const uint32_t pages = std::min(plan_.pages_per_slab, plan_.max_pages - first_page);
  absl::StatusOr<std::unique_ptr<Buffer>> slab =
      CreateBuffer(device_, SlabSpec(device_, uint64_t{pages} * plan_.page_bytes, host_mapped_));
  if (!slab.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot back page-pool slab ", slab_count_, ": ", slab.status().message()));
  }
  slabs_[slab_count_++] = *std::move(slab);
  for (uint32_t i = pages; i > 0; --i) free_.push_back(first_page + i - 1);  // device slots
  backed_pages_.store(first_page + pages, std::memory_order_release);
  return absl::OkStatus();
}

void PageAllocator::Retain(PageId page) {
  if (page >= max_ids_) return ReportMisuse("Retain", page);
  std::atomic<uint32_t>& count = refcounts_[page];
  uint32_t seen = count.load(std::memory_order_relaxed);
  do {
    if (seen == 0) return ReportMisuse("Retain", page);
  } while (!count.compare_exchange_weak(seen, seen + 1, std::memory_order_relaxed));
}

bool PageAllocator::TryRetain(PageId page) {
  if (page >= max_ids_) return false;
  std::atomic<uint32_t>& count = refcounts_[page];
  uint32_t seen = count.load(std::memory_order_relaxed);
  do {
    if (seen == 0) return false;
  } while (!count.compare_exchange_weak(seen, seen + 1, std::memory_order_acquire));
  return true;
}

void PageAllocator::Release(PageId page) {
  if (page >= max_ids_) return ReportMisuse("Release", page);
  std::atomic<uint32_t>& count = refcounts_[page];
  uint32_t seen = count.load(std::memory_order_relaxed);
  do {
    if (seen == 0) return ReportMisuse("Release", page);
  } while (!count.compare_exchange_weak(seen, seen - 1, std::memory_order_acq_rel));
  if (seen == 1) {
    absl::MutexLock lock(&mutex_);
    FreeLocked(page);
  }
}

uint32_t PageAllocator::RefCount(PageId page) const {
  if (page >= max_ids_) {
    ReportMisuse("RefCount", page);
    return 0;
  }
  return refcounts_[page].load(std::memory_order_relaxed);
}

bool PageAllocator::IsBacked(PageId page) const {
  if (page >= max_ids_) return false;
  const uint32_t word = where_[page].load(std::memory_order_acquire);
  return word != kNowhere && TierOf(word) == Tier::kDevice &&
         SlotOfWord(word) < backed_pages_.load(std::memory_order_acquire);
}

Tier PageAllocator::Where(PageId page) const {
  return TierOf(where_[page].load(std::memory_order_acquire));
}

uint32_t PageAllocator::SlotOf(PageId page) const {
  return SlotOfWord(where_[page].load(std::memory_order_acquire));
}

PageLocation PageAllocator::Locate(PageId page) const { return LocateSlot(SlotOf(page)); }

PageLocation PageAllocator::LocateSlot(uint32_t device_slot) const {
  const uint32_t slab = device_slot / plan_.pages_per_slab;
  const uint64_t offset = uint64_t{device_slot % plan_.pages_per_slab} * plan_.page_bytes;
  const Buffer& buffer = *slabs_[slab];
  return {*buffer.buffer, offset, buffer.mapped == nullptr ? nullptr : buffer.mapped + offset};
}

void PageAllocator::ReportMisuse(std::string_view operation, PageId page) {
  LogError("PagePool::%s(%u): the page is not allocated (a reference-counting bug)", operation,
           page);
  assert(false && "PagePool reference-count call on a page that is not allocated");
}

}  // namespace kvcache::gpu
