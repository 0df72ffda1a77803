// Moving pages between tiers. A page keeps its id and count; only its slot
// changes (PageAllocator::Relocate), so every table that holds it, shared or
// not, sees it move once. Evict and Promote run one at a time (tier_mutex_);
// the caller serialises them against every access to the pages they move.
#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "gpu/page_pool_impl.h"
#include "gpu/shared_copies.h"

namespace kvcache::gpu {
namespace {

// Disk reads and writes go through a bounce buffer of this many pages.
constexpr uint32_t kDiskBatchPages = 64;

}  // namespace

absl::Status PagePool::Impl::ReadSlots(absl::Span<const std::pair<uint32_t, std::byte*>> reads) {
  const uint64_t page_bytes = pages.plan().page_bytes;
  if (staged_ == nullptr) {
    CopyRunsInBatches(
        reads.size(), [&](size_t) { return page_bytes; },
        [&](size_t begin, size_t end) {
          for (const auto& [slot, dst] : reads.subspan(begin, end - begin)) {
            std::memcpy(dst, pages.LocateSlot(slot).host, page_bytes);
          }
        });
    return absl::OkStatus();
  }
  std::vector<DeviceToHost> copies;
  copies.reserve(reads.size());
  for (const auto& [slot, dst] : reads) {
    const PageLocation location = pages.LocateSlot(slot);
    copies.push_back({{location.slab, location.offset, page_bytes}, dst});
  }
  return staged_->Read(copies);
}

absl::Status PagePool::Impl::WriteSlots(
    absl::Span<const std::pair<uint32_t, const std::byte*>> writes) {
  const uint64_t page_bytes = pages.plan().page_bytes;
  if (staged_ == nullptr) {
    CopyRunsInBatches(
        writes.size(), [&](size_t) { return page_bytes; },
        [&](size_t begin, size_t end) {
          for (const auto& [slot, src] : writes.subspan(begin, end - begin)) {
            std::memcpy(pages.LocateSlot(slot).host, src, page_bytes);
          }
        });
    return absl::OkStatus();
  }
  std::vector<HostToDevice> copies;
  copies.reserve(writes.size());
  for (const auto& [slot, src] : writes) {
    const PageLocation location = pages.LocateSlot(slot);
    copies.push_back({src, {location.slab, location.offset, page_bytes}});
  }
  return staged_->Write(copies);
}

absl::StatusOr<bool> PagePool::Impl::DemoteOldestHostPage(std::optional<AccountId> only) {
  // Held for the move, so it cannot be freed (and its id reused) meanwhile.
  const std::optional<PageAllocator::Demotion> oldest = pages.TakeOldestHostPageToDemote(only);
  if (!oldest.has_value()) return false;
  absl::Status written = disk_->Write(oldest->disk_slot, host_.Slot(oldest->host_slot));
  if (written.ok()) {
    pages.Relocate(oldest->page, Tier::kDisk, oldest->disk_slot);
    pages.CountMoves(Tier::kHost, Tier::kDisk, 1);
  } else {
    pages.UndoDemotion(*oldest);
  }
  pages.Release(oldest->page);
  if (!written.ok()) return written;
  return true;
}

absl::StatusOr<std::optional<std::pair<Tier, uint32_t>>> PagePool::Impl::EvictionSlot(
    AccountId account) {
  if (std::optional<uint32_t> slot = pages.TakeSlot(Tier::kHost, account)) {
    return std::make_pair(Tier::kHost, *slot);
  }
  if (disk_ == nullptr) return std::nullopt;
  // No host slot for it. The page being evicted was used more recently than
  // any page already in host memory, so an older one moves down to make room
  // (when that page's account has room on disk): the oldest in host memory
  // when the tier is full, the account's own oldest when its host share is.
  const bool share_full = !pages.HasRoom(Tier::kHost, account);
  ASSIGN_OR_RETURN(const bool demoted,
                   DemoteOldestHostPage(share_full ? std::optional(account) : std::nullopt));
  if (demoted) {
    if (std::optional<uint32_t> slot = pages.TakeSlot(Tier::kHost, account)) {
      return std::make_pair(Tier::kHost, *slot);
    }
  }
  // No host room for it (no host tier, or nothing could move down): the
  // evicted page goes straight to disk.
  if (std::optional<uint32_t> slot = pages.TakeSlot(Tier::kDisk, account)) {
    return std::make_pair(Tier::kDisk, *slot);
  }
  return std::nullopt;
}

std::vector<bool> PagePool::Impl::StraightToDisk(absl::Span<const PageId> victims) const {
  std::vector<bool> straight(victims.size(), false);
  if (disk_ == nullptr) return straight;
  const uint32_t max_host = pages.plan().max_host_pages;
  // How many of each account's victims its host share could hold.
  absl::flat_hash_map<AccountId, std::pair<uint32_t, uint32_t>> victims_and_room;
  std::vector<AccountId> accounts(victims.size());
  for (size_t i = 0; i < victims.size(); ++i) {
    accounts[i] = pages.AccountOf(victims[i]);
    ++victims_and_room[accounts[i]].first;
  }
  for (auto& [account, counts] : victims_and_room) {
    const uint32_t share = pages.Usage(account).limits.host_pages;
    counts.second = share == 0 ? max_host : std::min(share, max_host);
  }
  const size_t pool_wide = victims.size() > max_host ? victims.size() - max_host : 0;
  for (size_t i = 0; i < victims.size(); ++i) {
    auto& [left, room] = victims_and_room[accounts[i]];
    straight[i] = i < pool_wide || left > room;  // `left`: this one and its account's after it
    --left;
  }
  return straight;
}

absl::StatusOr<uint32_t> PagePool::Impl::Evict(absl::Span<const PageId> victims) {
  absl::MutexLock lock(&tier_mutex_);
  const uint64_t page_bytes = pages.plan().page_bytes;
  eviction_epoch_.fetch_add(1, std::memory_order_acq_rel);
  // Plan every destination first, so the device reads go out in one batch.
  std::vector<std::pair<PageId, std::pair<Tier, uint32_t>>> planned;
  planned.reserve(victims.size());
  absl::Status status;
  // The least recently used come first. Those host memory could not hold even
  // if it held nothing else, or their account's share of it nothing else of
  // theirs, go straight to disk; the rest go to host memory, moving older host
  // pages down to make room. Each page moves once.
  const std::vector<bool> straight_to_disk = StraightToDisk(victims);
  for (size_t i = 0; i < victims.size(); ++i) {
    const PageId page = victims[i];
    if (pages.Where(page) != Tier::kDevice) continue;
    const AccountId account = pages.AccountOf(page);
    if (straight_to_disk[i]) {
      if (std::optional<uint32_t> disk_slot = pages.TakeSlot(Tier::kDisk, account)) {
        planned.emplace_back(page, std::make_pair(Tier::kDisk, *disk_slot));
        continue;
      }
    }
    absl::StatusOr<std::optional<std::pair<Tier, uint32_t>>> slot = EvictionSlot(account);
    if (!slot.ok()) {
      status = slot.status();
      break;
    }
    // Neither tier has room for this page (or its account's share of them):
    // the pages after it are as old or newer, and move no more easily.
    if (!slot->has_value()) break;
    planned.emplace_back(page, **slot);
  }
  std::vector<std::pair<uint32_t, std::byte*>> host_reads;
  std::vector<PageId> to_disk;
  std::vector<uint32_t> disk_slots;
  for (const auto& [page, slot] : planned) {
    if (slot.first == Tier::kHost) {
      host_reads.emplace_back(pages.SlotOf(page), host_.Slot(slot.second));
    } else {
      to_disk.push_back(page);
      disk_slots.push_back(slot.second);
    }
  }
  absl::Status read = ReadSlots(host_reads);
  uint32_t moved = 0;
  for (const auto& [page, slot] : planned) {
    if (slot.first != Tier::kHost) continue;
    if (read.ok()) {
      pages.Relocate(page, Tier::kHost, slot.second);
      ++moved;
    } else {
      pages.ReturnSlot(Tier::kHost, slot.second, pages.AccountOf(page));
    }
  }
  pages.CountMoves(Tier::kDevice, Tier::kHost, moved);
  status.Update(read);
  // Straight to disk (no host tier, or it was all demoted): through a bounce
  // buffer. After a failure the rest only give their slots back.
  std::vector<std::byte> bounce(page_bytes);
  for (size_t i = 0; i < to_disk.size(); ++i) {
    absl::Status wrote =
        status.ok() ? ReadSlots({{pages.SlotOf(to_disk[i]), bounce.data()}}) : status;
    if (wrote.ok()) wrote = disk_->Write(disk_slots[i], bounce.data());
    if (!wrote.ok()) {
      status.Update(wrote);
      pages.ReturnSlot(Tier::kDisk, disk_slots[i], pages.AccountOf(to_disk[i]));
      continue;
    }
    pages.Relocate(to_disk[i], Tier::kDisk, disk_slots[i]);
    pages.CountMoves(Tier::kDevice, Tier::kDisk, 1);
    ++moved;
  }
  // Pages that did move stay moved: their room is the caller's either way.
  if (!status.ok() && moved > 0) {
    LogError("evicting %d pages: %d moved, then: %s", victims.size(), moved, status.ToString());
    return moved;
  }
  RETURN_IF_ERROR(status);
  return moved;
}

absl::Status PagePool::Impl::Promote(absl::Span<const PageId> promoted) {
  absl::MutexLock lock(&tier_mutex_);
  const uint64_t page_bytes = pages.plan().page_bytes;
  std::vector<PageId> lower;
  for (const PageId page : promoted) {
    if (pages.Where(page) != Tier::kDevice) lower.push_back(page);
  }
  // A page listed twice moves once.
  std::sort(lower.begin(), lower.end());
  lower.erase(std::unique(lower.begin(), lower.end()), lower.end());
  if (lower.empty()) return absl::OkStatus();
  std::vector<uint32_t> device_slots;
  RETURN_IF_ERROR(pages.TakeDeviceSlots(lower, device_slots));
  // From host memory: straight into the device slots, in one batch.
  std::vector<std::pair<uint32_t, const std::byte*>> host_writes;
  std::vector<size_t> from_disk;
  for (size_t i = 0; i < lower.size(); ++i) {
    if (pages.Where(lower[i]) == Tier::kHost) {
      host_writes.emplace_back(device_slots[i], host_.Slot(pages.SlotOf(lower[i])));
    } else {
      from_disk.push_back(i);
    }
  }
  absl::Status status = WriteSlots(host_writes);
  // From disk: through a bounce buffer, a batch at a time.
  std::vector<std::byte> bounce(uint64_t{kDiskBatchPages} * page_bytes);
  for (size_t first = 0; status.ok() && first < from_disk.size(); first += kDiskBatchPages) {
    const size_t count = std::min<size_t>(kDiskBatchPages, from_disk.size() - first);
    std::vector<std::pair<uint32_t, const std::byte*>> writes;
    for (size_t j = 0; j < count && status.ok(); ++j) {
      const size_t i = from_disk[first + j];
      std::byte* at = bounce.data() + j * page_bytes;
      status = disk_->Read(pages.SlotOf(lower[i]), at);
      writes.emplace_back(device_slots[i], at);
    }
    if (status.ok()) status = WriteSlots(writes);
  }
  if (!status.ok()) {
    for (size_t i = 0; i < lower.size(); ++i) {
      pages.ReturnSlot(Tier::kDevice, device_slots[i], pages.AccountOf(lower[i]));
    }
    return status;
  }
  uint32_t from_host = 0;
  for (size_t i = 0; i < lower.size(); ++i) {
    if (pages.Where(lower[i]) == Tier::kHost) ++from_host;
    pages.Relocate(lower[i], Tier::kDevice, device_slots[i]);
  }
  pages.CountMoves(Tier::kHost, Tier::kDevice, from_host);
  pages.CountMoves(Tier::kDisk, Tier::kDevice, lower.size() - from_host);
  return absl::OkStatus();
}

}  // namespace kvcache::gpu
