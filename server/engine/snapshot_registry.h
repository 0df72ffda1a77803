// Snapshot ids: unguessable 128-bit random names for immutable CacheSnapshots.
// Holding a snapshot holds its pages; releasing the last holder frees them.
// The registry also keeps each snapshot's lease (lease.h) and pin, and the
// budget for pinned bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "engine/layers/cache.h"
#include "engine/lease.h"
#include "engine/metadata_budget.h"

namespace kvcache::engine {

struct SnapshotInfo {
  std::string snapshot_id;
  std::string cache_id;
  uint64_t from_offset = 0;
  uint64_t to_offset = 0;
  uint64_t size_bytes = 0;
  // Where its pages are now (CacheSnapshot::TierBytes).
  TierBytes tiers;
  bool pinned = false;
  absl::Duration ttl;                              // zero: no lease
  absl::Time expires_at = absl::InfiniteFuture();  // never while pinned or without a lease
  uint64_t last_use = 0;  // when a call last named it: a counter, higher is later
};

// A handle's lease as a renewal left it.
struct LeaseInfo {
  std::string id;
  absl::Duration ttl;
  absl::Time expires_at = absl::InfiniteFuture();
};

// `prefix` and then 32 lowercase hex digits from the OS's random source.
// The prefix names the replica that made the id ("kvcached-0:"), so that a
// client of many replicas sends every call about it to its owner.
std::string NewRandomId(absl::string_view prefix = "");

struct SnapshotRegistryOptions {
  // The lease of a snapshot added with no ttl of its own; zero: none.
  absl::Duration default_ttl;
  // Most bytes pinned snapshots may hold (size_bytes each); 0: no limit.
  uint64_t max_pinned_bytes = 0;
  // Most snapshots held at once (prefix entries and their handles count);
  // 0: no limit.
  uint64_t max_snapshots = 0;
  // What every id it makes begins with (NewRandomId).
  std::string id_prefix;
  // Told the ids of entries that went (released, expired, consumed by a
  // merge or split), after the registry's lock is released; may be empty.
  std::function<void(absl::Span<const std::string> ids)> on_drop;
};

class SnapshotRegistry {
 public:
  SnapshotRegistry(const LeaseClock& clock, SnapshotRegistryOptions options)
      : clock_(clock), options_(options) {}

  // `ttl` zero takes the default. RESOURCE_EXHAUSTED (naming max_pinned_bytes)
  // when pinning it would pass the budget, or naming max_snapshots when the
  // registry holds that many. The entry keeps `metadata`, the
  // snapshot's charge, until it goes.
  absl::StatusOr<SnapshotInfo> Add(CacheSnapshotPtr snapshot, MetadataCharge metadata, bool pinned,
                                   absl::Duration ttl);
  // The snapshot, its lease renewed.
  absl::StatusOr<CacheSnapshotPtr> Get(const std::string& snapshot_id) const;
  absl::Status Release(const std::string& snapshot_id);
  // Release, unless it is pinned (checked under the same lock); whether it went.
  bool ReleaseUnpinned(const std::string& snapshot_id);
  // The live entry's info, its lease left as it is (listing is not use).
  std::optional<SnapshotInfo> Peek(const std::string& snapshot_id) const;
  // Replaces `consumed` ids by `added` snapshots atomically: NOT_FOUND (and no
  // change) if any consumed id is gone by now. The added ones are pinned if
  // any consumed one was, and take the longest of their leases (none, if a
  // consumed one has none: it would never have expired); each keeps
  // its charge of `metadata` (one per added snapshot).
  absl::StatusOr<std::vector<SnapshotInfo>> Replace(const std::vector<std::string>& consumed,
                                                    std::vector<CacheSnapshotPtr> added,
                                                    std::vector<MetadataCharge> metadata);
  std::vector<SnapshotInfo> List(const std::string& cache_id) const;
  absl::StatusOr<SnapshotInfo> SetPinned(const std::string& snapshot_id, bool pinned);
  // What SetPinned(snapshot_id, true) would refuse now: NOT_FOUND, or
  // RESOURCE_EXHAUSTED naming max_pinned_bytes. Changes nothing.
  absl::Status CheckPinnable(const std::string& snapshot_id) const;
  // Renews every one of `ids`, or none when one is unknown (NOT_FOUND naming
  // `field`[i]).
  absl::StatusOr<std::vector<LeaseInfo>> Renew(absl::Span<const std::string> ids,
                                               const std::string& field);
  // Releases every snapshot whose lease ran out by now; returns how many.
  uint64_t Expire();

  // For the eviction policy, under the registry's lock: each entry's
  // snapshot, whether it is pinned, and when a call last named it (a
  // counter, higher is later); then `then`, the lock still held, so that
  // nothing it takes a reference to is freed before it has.
  void VisitForEviction(
      absl::FunctionRef<void(const CacheSnapshotPtr&, bool pinned, uint64_t last_use)> visit,
      absl::FunctionRef<void()> then) const;

  size_t size() const;
  // Deadlines waiting for the reaper: at most one per snapshot with a lease.
  size_t queued_deadlines() const;
  uint64_t pinned_bytes() const;
  uint64_t expired() const;
  void Clear();

 private:
  struct Entry {
    CacheSnapshotPtr snapshot;
    MetadataCharge metadata;
    bool pinned = false;
    Lease lease;
    uint64_t last_use = 0;  // use_clock_ when a call last named it
    // A deadline of it waits in deadlines_. One per handle is enough (the
    // reaper pushes it again when it finds the lease renewed), and more
    // would let a caller grow the queue by naming the handle.
    bool queued = false;
  };
  // What erasing leaves to do once the lock is released (declare it before
  // the lock): free the snapshots, then tell on_drop which ids went.
  class Dropped {
   public:
    explicit Dropped(const SnapshotRegistryOptions& options) : options_(options) {}
    Dropped(const Dropped&) = delete;
    Dropped& operator=(const Dropped&) = delete;
    ~Dropped();
    void Add(std::string id, CacheSnapshotPtr snapshot);
    size_t size() const { return ids_.size(); }

   private:
    const SnapshotRegistryOptions& options_;
    std::vector<std::string> ids_;
    std::vector<CacheSnapshotPtr> snapshots_;
  };
  static SnapshotInfo Info(const std::string& id, const Entry& entry);
  // Pinned, or its lease not yet run out: callers can name it.
  static bool Live(const Entry& entry, absl::Time now);
  // The live entry of that id, or end().
  absl::flat_hash_map<std::string, Entry>::iterator FindLive(const std::string& snapshot_id,
                                                             absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Registers `entry` under a new id, its lease started (unless pinned).
  SnapshotInfo Insert(Entry entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Puts the entry's deadline in deadlines_ unless one waits there already
  // or it cannot expire (pinned, or no lease).
  void QueueDeadline(const std::string& id, Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  absl::Status CheckPinBudget(uint64_t more_bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // RESOURCE_EXHAUSTED naming max_snapshots unless `more` fit beside those
  // held after `leaving` go.
  absl::Status CheckCount(uint64_t more, uint64_t leaving) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Drops `it`'s entry, handing it to `dropped`.
  void Erase(absl::flat_hash_map<std::string, Entry>::iterator it, Dropped& dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const LeaseClock& clock_;
  const SnapshotRegistryOptions options_;
  mutable absl::Mutex mutex_;
  // Mutable so that const lookups can hand out an iterator whose lease they renew.
  mutable absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mutex_);
  LeaseQueue deadlines_ ABSL_GUARDED_BY(mutex_);
  uint64_t pinned_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
  uint64_t expired_ ABSL_GUARDED_BY(mutex_) = 0;
  mutable uint64_t use_clock_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace kvcache::engine
