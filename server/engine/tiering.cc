#include "engine/tiering.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "engine/layers/page_table.h"

namespace kvcache::engine {
namespace {

using gpu::PageId;

// One holder level of the count in tiering.h: how many references the object
// has, how many of them eligible holders account for, and how recently the
// latest of those was used.
struct Holders {
  long references = 0;
  long eligible = 0;
  uint64_t recency = 0;
  bool Eligible() const { return eligible == references; }
  void Add(long count, uint64_t use) {
    references = count;
    ++eligible;
    recency = std::max(recency, use);
  }
};

struct ChunkHolders : Holders {
  absl::Span<const PageId> pages;
};

// Each eviction looks at this share of the pool at least, so that a run of
// small allocations does not rescan every snapshot for a page each.
constexpr uint32_t kEvictionBatchDivisor = 32;

}  // namespace

Tiering::Tiering(gpu::PagePool& pool, const SnapshotRegistry& snapshots, DropCached drop_cached,
                 EvictElsewhere evict_elsewhere)
    : pool_(pool),
      snapshots_(snapshots),
      enabled_(pool.stats().max_host_pages + pool.stats().max_disk_pages > 0),
      drop_cached_(std::move(drop_cached)),
      evict_elsewhere_(std::move(evict_elsewhere)) {}

absl::StatusOr<CacheSnapshotPtr> Tiering::Acquire(const std::string& snapshot_id) const {
  CacheSnapshotPtr snapshot;
  {
    absl::ReaderMutexLock lock(&mutex_);
    ASSIGN_OR_RETURN(snapshot, snapshots_.Get(snapshot_id));
    if (Resident(*snapshot)) return snapshot;
  }
  // Held now: eviction passes over it while the lock is exchanged.
  for (int round = 0;; ++round) {
    absl::Status promoted;
    {
      absl::MutexLock lock(&mutex_);
      promoted = PromoteLocked(*snapshot);
    }
    if (promoted.ok()) return snapshot;
    if (promoted.code() != absl::StatusCode::kResourceExhausted ||
        round + 1 == kMaxEvictionRounds) {
      return promoted;
    }
    // Others' snapshots move and cached entries are dropped outside the
    // lock: both take other locks.
    const TierBytes below = snapshot->Tiers();  // one walk over its pages
    const uint64_t below_bytes = below.host + below.disk;
    const auto pages = static_cast<uint32_t>(
        std::max<uint64_t>(1, (below_bytes + pool_.page_bytes() - 1) / pool_.page_bytes()));
    const bool quota = absl::StrContains(promoted.message(), gpu::kAccountExhausted);
    if (!quota && evict_elsewhere_ && evict_elsewhere_(pages) > 0) continue;
    if (!drop_cached_ || drop_cached_(below_bytes) == 0) return promoted;
  }
}

bool Tiering::Relievable(const absl::Status& status, uint64_t refused) const {
  if (status.code() != absl::StatusCode::kResourceExhausted) return false;
  if (absl::StrContains(status.message(), gpu::kPoolExhausted) ||
      absl::StrContains(status.message(), gpu::kAccountExhausted)) {
    // This call's, not an old message.
    return gpu::PagePool::RefusalsOnThisThread().count != refused;
  }
  return absl::StartsWith(status.message(), kMetadataBudgetName);
}

bool Tiering::Resident(const CacheSnapshot& snapshot) const {
  if (!enabled()) return true;
  const uint64_t epoch = pool_.eviction_epoch();
  if (snapshot.resident_epoch.load() == epoch) return true;
  bool resident = true;
  snapshot.ForEachPage([&](PageId page) { resident &= pool_.Where(page) == gpu::Tier::kDevice; });
  if (resident) snapshot.resident_epoch.store(epoch);
  return resident;
}

absl::Status Tiering::PromoteLocked(const CacheSnapshot& snapshot) const {
  std::vector<PageId> lower;
  snapshot.ForEachPage([&](PageId page) {
    if (pool_.Where(page) != gpu::Tier::kDevice) lower.push_back(page);
  });
  absl::Status promoted = pool_.Promote(lower);
  if (promoted.code() == absl::StatusCode::kResourceExhausted) {
    const uint32_t available = pool_.available_pages();
    const uint32_t missing = lower.size() > available ? lower.size() - available : 0;
    ASSIGN_OR_RETURN(const uint32_t moved, EvictLocked(missing));
    (void)moved;
    promoted = pool_.Promote(lower);
  }
  if (promoted.code() == absl::StatusCode::kResourceExhausted) {
    const bool quota = absl::StrContains(promoted.message(), gpu::kAccountExhausted);
    return absl::ResourceExhaustedError(
        absl::StrCat(quota ? "max_device_bytes" : "pool_bytes",
                     ": no room on the device to bring back the snapshot's ", lower.size(),
                     " evicted pages (", promoted.message(), "), and no more can leave it"));
  }
  RETURN_IF_ERROR(promoted);
  snapshot.resident_epoch.store(pool_.eviction_epoch());
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> Tiering::Evict(uint32_t pages, uint32_t* candidates) const {
  absl::MutexLock lock(&mutex_);
  return EvictLocked(pages, /*batch=*/true, nullptr, candidates);
}

absl::StatusOr<uint32_t> Tiering::EvictIdle(uint32_t pages) const {
  absl::MutexLock lock(&mutex_);
  uint32_t chosen = 0;
  ASSIGN_OR_RETURN(const uint32_t moved, EvictLocked(pages, /*batch=*/false, &chosen));
  if (moved == 0 && chosen > 0) {
    return absl::ResourceExhaustedError(
        "host_bytes: idle snapshots' pages have nowhere to go: host_bytes and disk_bytes are "
        "full, or the tenant's max_host_bytes and max_disk_bytes");
  }
  return moved;
}

absl::StatusOr<uint32_t> Tiering::EvictLocked(uint32_t wanted, bool batch, uint32_t* chosen,
                                              uint32_t* found) const {
  if (!enabled()) return 0;
  if (batch) {
    wanted =
        std::max(wanted, std::max<uint32_t>(1, pool_.stats().max_pages / kEvictionBatchDivisor));
  }
  absl::flat_hash_map<const LayerSnapshot*, Holders> layers;
  absl::flat_hash_map<const void*, ChunkHolders> chunks;
  absl::flat_hash_map<PageId, Holders> pages;
  std::vector<PageId> victims;
  snapshots_.VisitForEviction(
      [&](const CacheSnapshotPtr& snapshot, bool pinned, uint64_t last_use) {
        if (pinned || snapshot.use_count() != 1) return;  // only the registry may hold it
        for (const LayerSnapshotPtr& layer : snapshot->layers) {
          if (layer != nullptr) layers[layer.get()].Add(layer.use_count(), last_use);
        }
      },
      [&] {
        for (const auto& [layer, holders] : layers) {
          if (!holders.Eligible()) continue;
          layer->held_pages().ForEachChunk(
              [&](const void* chunk, long tables, absl::Span<const PageId> held) {
                ChunkHolders& entry = chunks[chunk];
                entry.Add(tables, holders.recency);
                entry.pages = held;
              });
        }
        for (const auto& [chunk, holders] : chunks) {
          if (!holders.Eligible()) continue;
          for (const PageId page : holders.pages) {
            // Each eligible chunk holds one pool reference to each of its pages.
            if (page != gpu::kNoPage) pages[page].Add(pool_.RefCount(page), holders.recency);
          }
        }
        std::vector<std::pair<uint64_t, PageId>> candidates;
        for (const auto& [page, holders] : pages) {
          if (holders.Eligible() && pool_.Where(page) == gpu::Tier::kDevice) {
            candidates.emplace_back(holders.recency, page);
          }
        }
        const size_t take = std::min<size_t>(wanted, candidates.size());
        if (found != nullptr) *found = static_cast<uint32_t>(take);
        std::partial_sort(candidates.begin(), candidates.begin() + take, candidates.end());
        for (size_t i = 0; i < take; ++i) {
          // Held while they move; the registry's lock keeps them alive until then.
          if (pool_.TryRetain(candidates[i].second)) victims.push_back(candidates[i].second);
        }
      });
  if (chosen != nullptr) *chosen = static_cast<uint32_t>(victims.size());
  absl::StatusOr<uint32_t> moved = pool_.Evict(victims);
  for (const PageId page : victims) pool_.Release(page);
  return moved;
}

absl::Status Tiering::NothingToEvict(const absl::Status& refused) {
  // The tenant's quota names itself first already.
  const bool quota = absl::StrContains(refused.message(), gpu::kAccountExhausted);
  return absl::ResourceExhaustedError(absl::StrCat(
      quota ? "" : "pool_bytes: ", refused.message(),
      "; no more pages can leave the device (the rest are held by caches, pinned snapshots or "
      "calls in flight, or host_bytes and disk_bytes are full)"));
}

}  // namespace kvcache::engine
