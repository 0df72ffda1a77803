// Tiers, the engine's half: which pages leave the device when it is full, and
// bringing them back before anyone reads them. The pool (gpu/page_pool.h)
// moves the bytes; a page keeps its id wherever it is, so every table holding
// it, snapshot or cache, sees it move once and copy-on-write sharing survives.
//
// Which pages may leave: those whose every reference comes from registered,
// unpinned snapshots that no call is using. Counted, not assumed, level by
// level: a snapshot whose only holder is the registry; a layer snapshot held
// only by such snapshots; a page-table chunk held only by such layers; a page
// whose pool count equals the number of such chunks holding it. A live cache,
// a running speculation, a Fetch in flight, a pinned snapshot or anything else
// that holds the page, a chunk of it or a snapshot of it adds a reference that
// no eligible holder accounts for, and keeps the page on the device. Of the
// eligible pages the least recently used go first (a page is as recent as the
// latest snapshot holding it).
//
// Locking: a call that reads a registered snapshot's pages takes it with
// Acquire, which finds it by id and checks its pages under mutex_ shared, and
// promotes under mutex_ exclusive; once it holds the snapshot, its reference
// keeps the pages from being chosen, so it reads them without the lock.
// Eviction and promotion hold mutex_ exclusive, then the registry's lock
// while choosing. Caches' own Update and Fetch never take mutex_.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "engine/layers/cache.h"
#include "engine/snapshot_registry.h"
#include "gpu/page_pool.h"

namespace kvcache::engine {

// What the engine keeps only as a cache of its own (published prefixes):
// dropped, least recently used first, when nothing more can leave the device
// or the metadata budget is full. Drops entries worth about `bytes` (at least
// one) and returns how many went; 0 when none can.
using DropCached = std::function<uint64_t(uint64_t bytes)>;

// Where several engines share one pool (one per tenant): evicts about
// `pages` pages of the others' idle snapshots once this engine has none left
// to move, and returns how many moved. Called without any lock of the
// caller's held, so two engines that ask each other at once cannot deadlock.
using EvictElsewhere = std::function<uint32_t(uint32_t pages)>;

class Tiering {
 public:
  Tiering(gpu::PagePool& pool, const SnapshotRegistry& snapshots, DropCached drop_cached,
          EvictElsewhere evict_elsewhere = nullptr);

  // Whether the pool has a lower tier; without one nothing ever moves.
  bool enabled() const { return enabled_; }
  // SnapshotRegistry::Get, with the snapshot's pages on the device:
  // promoted, evicting others to make room, if some were not.
  // RESOURCE_EXHAUSTED naming pool_bytes when no room can be made.
  absl::StatusOr<CacheSnapshotPtr> Acquire(const std::string& snapshot_id) const;
  // Runs `op`; when it fails because the pool had too few pages, evicts and
  // runs it again (a failed call changes nothing), until it succeeds, fails
  // otherwise, or nothing more can leave the device. Then, and when the
  // metadata budget refused it, drops cached entries (DropCached) and tries
  // again while any go.
  template <typename Op>
  auto RetryAfterEviction(Op op) const -> decltype(op());
  // Evicts up to `pages` pages (at least a batch, to spread the cost of
  // choosing); returns how many moved. `candidates`, when given, gets how
  // many were found to move (0: no device page is held by idle snapshots only).
  absl::StatusOr<uint32_t> Evict(uint32_t pages, uint32_t* candidates = nullptr) const;
  // What an operator asks for: moves up to `pages` pages of idle, unpinned
  // snapshots down a tier, least recently used first, and no more (no batch);
  // returns how many moved. RESOURCE_EXHAUSTED naming host_bytes when some
  // could move but no tier below (or the account's share of it) had room.
  absl::StatusOr<uint32_t> EvictIdle(uint32_t pages) const;

 private:
  // A call that allocates page by page may need a round per page it lacks;
  // each round moves at least a batch, so this bounds the retries, not the room.
  static constexpr int kMaxEvictionRounds = 64;

  // Moves up to `wanted` pages; a batch at least when `batch`. `chosen`, when
  // given, is how many were held to move; `found`, how many were eligible
  // (more than chosen when some were being freed meanwhile).
  absl::StatusOr<uint32_t> EvictLocked(uint32_t wanted, bool batch = true,
                                       uint32_t* chosen = nullptr,
                                       uint32_t* found = nullptr) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  absl::Status PromoteLocked(const CacheSnapshot& snapshot) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // All its pages on the device (remembered per eviction epoch).
  bool Resident(const CacheSnapshot& snapshot) const ABSL_SHARED_LOCKS_REQUIRED(mutex_);
  // Whether `status` is the refusal of a budget that dropping cached entries
  // can relieve: the pool's (since `refused`, its count before the call) or
  // the metadata budget's. Counted per thread: another thread's refusal meanwhile
  // says nothing of this call's.
  bool Relievable(const absl::Status& status, uint64_t refused) const;
  // The pool's refusal, as the caller sees it once eviction cannot help.
  static absl::Status NothingToEvict(const absl::Status& refused);
  static const absl::Status& StatusOf(const absl::Status& status) { return status; }
  template <typename T>
  static absl::Status StatusOf(const absl::StatusOr<T>& result) {
    return result.status();
  }

  gpu::PagePool& pool_;
  const SnapshotRegistry& snapshots_;
  const bool enabled_;
  const DropCached drop_cached_;
  const EvictElsewhere evict_elsewhere_;
  mutable absl::Mutex mutex_;
};

template <typename Op>
auto Tiering::RetryAfterEviction(Op op) const -> decltype(op()) {
  for (int round = 0;; ++round) {
    const uint64_t refused = gpu::PagePool::RefusalsOnThisThread().count;
    auto result = op();
    if (result.ok()) return result;
    const absl::Status status = StatusOf(result);
    if (!Relievable(status, refused)) return result;
    // The shared pool's budget, or this engine's own share of it (its
    // tenant's device quota, which only its own pages leaving relieves).
    const bool quota_refused = absl::StrContains(status.message(), gpu::kAccountExhausted);
    const bool pool_refused =
        quota_refused || absl::StrContains(status.message(), gpu::kPoolExhausted);
    const uint32_t shortfall =
        pool_refused ? gpu::PagePool::RefusalsOnThisThread().last_shortfall : 0;
    if (round + 1 == kMaxEvictionRounds) return pool_refused ? NothingToEvict(status) : result;
    if (pool_refused && enabled()) {
      uint32_t could_move = 0;  // eligible pages, whether or not they moved
      absl::StatusOr<uint32_t> moved = Evict(shortfall, &could_move);
      if (!moved.ok()) return moved.status();
      if (*moved > 0) continue;
      // Other tenants' idle snapshots move to a lower tier before anything
      // of this engine's is dropped: nothing is lost by that.
      if (!quota_refused && evict_elsewhere_ && evict_elsewhere_(std::max(shortfall, 1u)) > 0) {
        continue;
      }
      // Every page on the device is held by something other than idle
      // snapshots, so dropping cached entries would free pages below it
      // (or none) and lose them for nothing.
      if (could_move == 0) return NothingToEvict(status);
    }
    // Nothing more can leave the device (or the budget is not the pool's):
    // what the engine keeps only as a cache goes before a caller is refused.
    if (drop_cached_ && drop_cached_(uint64_t{shortfall} * pool_.page_bytes()) > 0) continue;
    return pool_refused && enabled() ? NothingToEvict(status) : result;
  }
}

}  // namespace kvcache::engine
