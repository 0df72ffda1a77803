#include "engine/engine.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/client_text.h"
#include "core/status_macros.h"
#include "engine/batch/batch_ops.h"
#include "engine/engine_locked_cache.h"

namespace kvcache::engine {
namespace {

// Every layer of `cache` frozen, which must be in step; refusals name `field`.
absl::StatusOr<CacheSnapshotPtr> FrozenInStep(const Cache& cache, const std::string& cache_id,
                                              const std::string& field) {
  if (absl::Status in_step = cache.CommonOffset().status(); !in_step.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(field, ": ", in_step.message()));
  }
  return cache.Freeze(cache_id);
}

}  // namespace

Engine::Engine(gpu::PagePool& pool, EngineOptions options)
    : pool_(pool),
      options_(std::move(options)),
      clock_(options_.clock != nullptr ? *options_.clock : LeaseClock::System()),
      metadata_(options_.metadata_bytes != 0
                    ? options_.metadata_bytes
                    : DefaultMetadataBytes(pool.stats().max_pages * pool.page_bytes()),
                options_.metadata_quota_of),
      pool_tables_(metadata_.Reserve(PoolTablesBytes(pool.stats().max_pages))),
      snapshots_(clock_,
                 SnapshotRegistryOptions{.default_ttl = options_.default_ttl,
                                         .max_pinned_bytes = options_.max_pinned_bytes,
                                         .max_snapshots = options_.max_snapshots,
                                         .id_prefix = options_.id_prefix,
                                         .on_drop = [this](absl::Span<const std::string> ids) {
                                           prefixes_.ForgetAny(ids);
                                         }}) {
  if (options_.prefix_blocks != nullptr) prefixes_.CountBlocksIn(options_.prefix_blocks);
}

Engine::~Engine() {
  {
    absl::MutexLock lock(&speculations_mutex_);
    speculations_.clear();
  }
  snapshots_.Clear();
  absl::MutexLock lock(&caches_mutex_);
  caches_.clear();
}

absl::StatusOr<std::shared_ptr<Engine::Entry>> Engine::FindEntry(const std::string& cache_id) const {
  absl::MutexLock lock(&caches_mutex_);
  auto it = caches_.find(cache_id);
  if (it == caches_.end()) return UnknownCache(cache_id);
  // Renewed under the lock ExpireCaches takes: a call either renews it in
  // time or finds it gone.
  if (!it->second->lease.RenewIfLive(clock_)) return UnknownCache(cache_id);
  return it->second;
}

CacheInfo Engine::Describe(const std::string& cache_id, const Cache& cache, const Lease& lease) {
  CacheInfo info{.cache_id = cache_id, .spec = cache.spec(), .layer_offsets = cache.layer_offsets()};
  info.offset = *std::min_element(info.layer_offsets.begin(), info.layer_offsets.end());
  info.in_step = cache.CommonOffset().ok();
  info.size_bytes = cache.size_bytes();
  info.ttl = lease.ttl();
  info.expires_at = lease.expires_at();
  return info;
}

absl::StatusOr<CacheInfo> Engine::CreateCache(const CacheSpec& spec, absl::Duration ttl) {
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<CacheInfo> {
    RETURN_IF_ERROR(ValidateSpec(spec, options_.limits));
    ASSIGN_OR_RETURN(std::unique_ptr<Cache> cache,
                     Cache::Create(NormalizeSpec(spec), pool_, options_.page_tokens));
    return AddCache(std::move(cache), ttl);
  });
}

absl::StatusOr<MetadataCharge> Engine::ChargeCache(const Cache& cache) {
  return metadata_.Charge(CacheMetadataBytes(cache.spec()), "a cache");
}

absl::StatusOr<MetadataCharge> Engine::ChargeSnapshot(const CacheSnapshot& snapshot) {
  return metadata_.Charge(SnapshotMetadataBytes(snapshot, pool_.page_bytes(), options_.page_tokens),
                          "a snapshot");
}

absl::StatusOr<CacheInfo> Engine::AddCache(std::unique_ptr<Cache> cache, absl::Duration ttl) {
  ASSIGN_OR_RETURN(MetadataCharge metadata, ChargeCache(*cache));
  auto entry = std::make_shared<Entry>(ttl == absl::ZeroDuration() ? options_.default_ttl : ttl);
  std::string id = NewRandomId(options_.id_prefix);
  entry->lease.Renew(clock_.Now());
  CacheInfo info = Describe(id, *cache, entry->lease);
  {
    absl::MutexLock lock(&entry->mutex);
    entry->cache = std::move(cache);
    entry->metadata = std::move(metadata);
  }
  absl::MutexLock lock(&caches_mutex_);
  if (options_.max_caches != 0 && caches_.size() >= options_.max_caches) {
    // `entry` goes with its cache's pages and metadata charge.
    return absl::ResourceExhaustedError(
        absl::StrFormat("max_caches: %d caches are held, the quota (delete some)", caches_.size()));
  }
  cache_deadlines_.Push(entry->lease.expires_at(), id);
  caches_[id] = std::move(entry);
  return info;
}

absl::StatusOr<CacheInfo> Engine::GetCache(const std::string& cache_id) const {
  ASSIGN_OR_RETURN(LockedCache cache, LockedCache::Open(*this, cache_id));
  return cache.Describe(cache_id);
}

absl::StatusOr<CacheSpec> Engine::GetSpec(const std::string& cache_id) const {
  ASSIGN_OR_RETURN(LockedCache cache, LockedCache::Open(*this, cache_id));
  return cache->spec();
}

absl::Status Engine::RefreshSpec(const std::string& cache_id, uint64_t& layout_id,
                                 CacheSpec& spec) const {
  ASSIGN_OR_RETURN(LockedCache cache, LockedCache::Open(*this, cache_id));
  if (cache->layout_id() != layout_id) {
    spec = cache->spec();
    layout_id = cache->layout_id();
  }
  return absl::OkStatus();
}

// A listing names no handle: it renews nothing, and leaves out those whose
// lease has run out.
std::vector<CacheInfo> Engine::ListCaches() const {
  std::vector<std::pair<std::string, std::shared_ptr<Entry>>> entries;
  {
    absl::MutexLock lock(&caches_mutex_);
    const absl::Time now = clock_.Now();
    for (const auto& [id, entry] : caches_) {
      if (!entry->lease.ExpiredAt(now)) entries.emplace_back(id, entry);
    }
  }
  std::vector<CacheInfo> infos;
  for (auto& [id, entry] : entries) {
    absl::StatusOr<LockedCache> cache = LockedCache::OpenEntry(std::move(entry), id);
    if (cache.ok()) infos.push_back(cache->Describe(id));
  }
  return infos;
}

absl::Status Engine::DeleteCache(const std::string& cache_id) {
  std::shared_ptr<Entry> entry;
  {
    absl::MutexLock lock(&caches_mutex_);
    auto it = caches_.find(cache_id);
    // One whose lease ran out is the reaper's to delete.
    if (it == caches_.end() || it->second->lease.ExpiredAt(clock_.Now())) {
      return UnknownCache(cache_id);
    }
    entry = std::move(it->second);
    caches_.erase(it);
  }
  Retire(*entry);
  return absl::OkStatus();
}

void Engine::Retire(Entry& entry) {
  absl::MutexLock lock(&entry.mutex);
  entry.deleted = true;
  if (entry.speculation != nullptr) {  // ends with its cache: later use is NOT_FOUND
    const std::string speculation_id = entry.speculation->id();
    entry.speculation.reset();
    ForgetSpeculation(speculation_id);
  }
  entry.cache->Free();
}

absl::StatusOr<uint64_t> Engine::Update(const std::string& cache_id, uint32_t layer,
                                        const KvInput& kv, std::optional<uint64_t> expected_offset) {
  if (kv.tokens > options_.max_update_tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tokens: %d in one update, more than the limit of %d", kv.tokens,
        options_.max_update_tokens));
  }
  return UpdateLayer(cache_id, layer, expected_offset,
                     [&](Cache& cache) { return cache.Update(layer, kv); });
}

absl::StatusOr<uint64_t> Engine::UpdateState(const std::string& cache_id, uint32_t layer,
                                             const StateInput& state,
                                             std::optional<uint64_t> expected_offset) {
  return UpdateLayer(cache_id, layer, expected_offset,
                     [&](Cache& cache) { return cache.UpdateState(layer, state); });
}

absl::StatusOr<uint64_t> Engine::UpdateLayer(
    const std::string& cache_id, uint32_t layer, std::optional<uint64_t> expected_offset,
    absl::FunctionRef<absl::Status(Cache&)> apply) {
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<uint64_t> {
    ASSIGN_OR_RETURN(LockedCache cache, LockedCache::Open(*this, cache_id));
    RETURN_IF_ERROR(cache.RefuseWhileSpeculating("cache_id"));
    if (layer >= cache->num_layers()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "layer: %d is out of range; the cache has %d layers", layer, cache->num_layers()));
    }
    const uint64_t offset = cache->layer(layer).offset();
    if (expected_offset.has_value() && *expected_offset != offset) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "expected_offset: layer %d is at offset %d, not %d", layer, offset, *expected_offset));
    }
    RETURN_IF_ERROR(apply(*cache));
    return cache->layer(layer).offset();
  });
}

absl::StatusOr<std::shared_ptr<const CacheSnapshot>> Engine::Freeze(
    const std::string& cache_id, const std::string& snapshot_id) const {
  if (!snapshot_id.empty()) {
    // A cache named beside the snapshot is not read, but it is named: it
    // must exist, and its lease is renewed like any named handle's.
    if (!cache_id.empty()) RETURN_IF_ERROR(FindEntry(cache_id).status());
    return tiering_.Acquire(snapshot_id);
  }
  ASSIGN_OR_RETURN(LockedCache cache, LockedCache::Open(*this, cache_id));
  return cache->Freeze(cache_id);
}

absl::StatusOr<uint64_t> Engine::Trim(const std::string& cache_id, uint64_t n, CacheInfo* after) {
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<uint64_t> {
    ASSIGN_OR_RETURN(LockedCache cache, LockedCache::Open(*this, cache_id));
    RETURN_IF_ERROR(cache.RefuseWhileSpeculating("cache_id"));
    ASSIGN_OR_RETURN(const uint64_t trimmed, cache->Trim(n));
    if (after != nullptr) *after = cache.Describe(cache_id);
    return trimmed;
  });
}

absl::StatusOr<SnapshotInfo> Engine::Snapshot(const std::string& cache_id, uint64_t from_offset,
                                              bool pinned, absl::Duration ttl) {
  // No pages are taken, but the metadata budget may need prefix entries gone.
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<SnapshotInfo> {
    ASSIGN_OR_RETURN(LockedCache cache, LockedCache::Open(*this, cache_id));
    ASSIGN_OR_RETURN(CacheSnapshotPtr snapshot, cache->Snapshot(cache_id, from_offset));
    ASSIGN_OR_RETURN(MetadataCharge metadata, ChargeSnapshot(*snapshot));
    return snapshots_.Add(std::move(snapshot), std::move(metadata), pinned, ttl);
  });
}

absl::StatusOr<CacheInfo> Engine::Restore(const std::string& cache_id,
                                          const std::string& snapshot_id, uint64_t target_offset) {
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<CacheInfo> {
    CacheSnapshotPtr snapshot;
    if (!snapshot_id.empty()) {
      ASSIGN_OR_RETURN(snapshot, tiering_.Acquire(snapshot_id));
    }
    ASSIGN_OR_RETURN(LockedCache cache, LockedCache::Open(*this, cache_id));
    RETURN_IF_ERROR(cache.RefuseWhileSpeculating("cache_id"));
    RETURN_IF_ERROR(cache->Restore(snapshot.get(), target_offset));
    return cache.Describe(cache_id);
  });
}

absl::StatusOr<SnapshotInfo> Engine::MergeSnapshots(const std::string& parent_id,
                                                    const std::string& child_id) {
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<SnapshotInfo> {
    if (parent_id == child_id) {
      return absl::FailedPreconditionError("child_id: a snapshot cannot be merged with itself");
    }
    ASSIGN_OR_RETURN(CacheSnapshotPtr parent, tiering_.Acquire(parent_id));
    ASSIGN_OR_RETURN(CacheSnapshotPtr child, tiering_.Acquire(child_id));
    ASSIGN_OR_RETURN(CacheSnapshotPtr merged, engine::MergeSnapshots(*parent, *child));
    // Charged before the inputs' charges return: a merge needs room for its
    // result while both inputs still exist.
    std::vector<MetadataCharge> metadata(1);
    ASSIGN_OR_RETURN(metadata[0], ChargeSnapshot(*merged));
    ASSIGN_OR_RETURN(
        std::vector<SnapshotInfo> added,
        snapshots_.Replace({parent_id, child_id}, {std::move(merged)}, std::move(metadata)));
    return added[0];
  });
}

absl::StatusOr<std::pair<SnapshotInfo, SnapshotInfo>> Engine::SplitSnapshot(
    const std::string& snapshot_id, uint64_t at) {
  return tiering_.RetryAfterEviction(
      [&]() -> absl::StatusOr<std::pair<SnapshotInfo, SnapshotInfo>> {
        ASSIGN_OR_RETURN(CacheSnapshotPtr snapshot, tiering_.Acquire(snapshot_id));
        ASSIGN_OR_RETURN(auto halves, engine::SplitSnapshot(*snapshot, at));
        std::vector<MetadataCharge> metadata(2);
        ASSIGN_OR_RETURN(metadata[0], ChargeSnapshot(*halves.first));
        ASSIGN_OR_RETURN(metadata[1], ChargeSnapshot(*halves.second));
        ASSIGN_OR_RETURN(
            std::vector<SnapshotInfo> added,
            snapshots_.Replace({snapshot_id}, {std::move(halves.first), std::move(halves.second)},
                               std::move(metadata)));
        return std::make_pair(added[0], added[1]);
      });
}

absl::Status Engine::ReleaseSnapshot(const std::string& snapshot_id) {
  return snapshots_.Release(snapshot_id);
}

std::vector<SnapshotInfo> Engine::ListSnapshots(const std::string& cache_id) const {
  return snapshots_.List(cache_id);
}

absl::StatusOr<CacheInfo> Engine::ExtractRow(const std::string& cache_id, uint32_t row) {
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<CacheInfo> {
    CacheSnapshotPtr frozen;
    {
      ASSIGN_OR_RETURN(LockedCache cache, LockedCache::Open(*this, cache_id));
      ASSIGN_OR_RETURN(frozen, FrozenInStep(*cache, cache_id, "cache_id"));
    }
    ASSIGN_OR_RETURN(const BatchPlan plan, PlanExtractRow(*frozen, row));
    ASSIGN_OR_RETURN(std::unique_ptr<Cache> built,
                     AssembleBatch(plan, pool_, options_.page_tokens, options_.limits));
    return AddCache(std::move(built));
  });
}

absl::StatusOr<CacheInfo> Engine::FilterRows(const std::string& cache_id,
                                             absl::Span<const uint32_t> keep_rows) {
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<CacheInfo> {
    ASSIGN_OR_RETURN(LockedCache cache, LockedCache::Open(*this, cache_id));
    RETURN_IF_ERROR(cache.RefuseWhileSpeculating("cache_id"));
    ASSIGN_OR_RETURN(const CacheSnapshotPtr frozen, FrozenInStep(*cache, cache_id, "cache_id"));
    ASSIGN_OR_RETURN(const BatchPlan plan, PlanFilterRows(*frozen, keep_rows));
    ASSIGN_OR_RETURN(std::unique_ptr<Cache> built,
                     AssembleBatch(plan, pool_, options_.page_tokens, options_.limits));
    ASSIGN_OR_RETURN(MetadataCharge metadata, ChargeCache(*built));
    cache.Replace(std::move(built), std::move(metadata));
    return cache.Describe(cache_id);
  });
}

// The sources are read under their locks and released before the copy: a
// merge changes none of them.
absl::StatusOr<CacheInfo> Engine::MergeCaches(absl::Span<const std::string> cache_ids) {
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<CacheInfo> {
    std::vector<std::string> fields;
    for (size_t i = 0; i < cache_ids.size(); ++i) {
      fields.push_back(absl::StrCat("cache_ids[", i, "]"));
    }
    std::vector<CacheSnapshotPtr> frozen_caches;
    {
      ASSIGN_OR_RETURN(auto locked, LockedCache::OpenInOrder(*this, cache_ids, fields));
      for (size_t i = 0; i < cache_ids.size(); ++i) {
        const auto it = std::find_if(locked.begin(), locked.end(), [&](const auto& entry) {
          return entry.first == cache_ids[i];
        });
        ASSIGN_OR_RETURN(CacheSnapshotPtr frozen,
                         FrozenInStep(*it->second, cache_ids[i], fields[i]));
        frozen_caches.push_back(std::move(frozen));
      }
    }
    std::vector<const CacheSnapshot*> sources;
    for (const CacheSnapshotPtr& frozen : frozen_caches) sources.push_back(frozen.get());
    ASSIGN_OR_RETURN(const BatchPlan plan, PlanMerge(sources));
    ASSIGN_OR_RETURN(std::unique_ptr<Cache> built,
                     AssembleBatch(plan, pool_, options_.page_tokens, options_.limits));
    return AddCache(std::move(built));
  });
}

absl::StatusOr<CacheInfo> Engine::ExtendCache(const std::string& cache_id,
                                              const std::string& other_id) {
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<CacheInfo> {
    const std::string ids[] = {cache_id, other_id};
    const std::string fields[] = {"cache_id", "other_id"};
    ASSIGN_OR_RETURN(auto locked, LockedCache::OpenInOrder(*this, ids, fields));
    const auto find = [&](const std::string& id) -> LockedCache& {
      return std::find_if(locked.begin(), locked.end(),
                          [&](const auto& entry) { return entry.first == id; })
          ->second;
    };
    LockedCache& cache = find(cache_id);
    RETURN_IF_ERROR(cache.RefuseWhileSpeculating("cache_id"));
    ASSIGN_OR_RETURN(const CacheSnapshotPtr frozen, FrozenInStep(*cache, cache_id, "cache_id"));
    ASSIGN_OR_RETURN(const CacheSnapshotPtr other,
                     FrozenInStep(*find(other_id), other_id, "other_id"));
    ASSIGN_OR_RETURN(const BatchPlan plan, PlanExtend(*frozen, *other));
    ASSIGN_OR_RETURN(std::unique_ptr<Cache> built,
                     AssembleBatch(plan, pool_, options_.page_tokens, options_.limits));
    ASSIGN_OR_RETURN(MetadataCharge metadata, ChargeCache(*built));
    cache.Replace(std::move(built), std::move(metadata));
    return cache.Describe(cache_id);
  });
}

absl::StatusOr<RenewedLeases> Engine::RenewLease(absl::Span<const std::string> cache_ids,
                                                 absl::Span<const std::string> snapshot_ids) {
  absl::MutexLock lock(&caches_mutex_);
  const absl::Time now = clock_.Now();
  for (size_t i = 0; i < cache_ids.size(); ++i) {
    const auto it = caches_.find(cache_ids[i]);
    if (it == caches_.end() || it->second->lease.ExpiredAt(now)) {
      return absl::NotFoundError(
          absl::StrCat("cache_ids[", i, "]: no cache ", Quoted(cache_ids[i])));
    }
  }
  RenewedLeases renewed;
  ASSIGN_OR_RETURN(renewed.snapshots, snapshots_.Renew(snapshot_ids, "snapshot_ids"));
  for (const std::string& id : cache_ids) {
    Lease& lease = caches_.find(id)->second->lease;
    lease.Renew(now);
    renewed.caches.push_back(
        LeaseInfo{.id = id, .ttl = lease.ttl(), .expires_at = lease.expires_at()});
  }
  return renewed;
}

absl::StatusOr<SnapshotInfo> Engine::SetPinned(const std::string& snapshot_id, bool pinned) {
  if (!pinned) return snapshots_.SetPinned(snapshot_id, pinned);
  // Refused before its pages come back, which could move other snapshots'
  // down: a refused pin changes nothing. (A pin racing this one for the
  // budget can still win it meanwhile; then this one is refused after.)
  RETURN_IF_ERROR(snapshots_.CheckPinnable(snapshot_id));
  // Held (so not evicted again) from being brought back until it is pinned.
  ASSIGN_OR_RETURN(const CacheSnapshotPtr resident, tiering_.Acquire(snapshot_id));
  return snapshots_.SetPinned(snapshot_id, pinned);
}

size_t Engine::QueuedLeaseDeadlines() const {
  absl::MutexLock lock(&caches_mutex_);
  return cache_deadlines_.size() + snapshots_.queued_deadlines();
}

std::pair<uint64_t, uint64_t> Engine::ExpireLeases() {
  const uint64_t caches = ExpireCaches();
  return {caches, snapshots_.Expire()};
}

uint64_t Engine::ExpireCaches() {
  uint64_t count = 0;
  for (;;) {
    std::vector<std::shared_ptr<Entry>> expired;
    size_t due_count = 0;
    {
      absl::MutexLock lock(&caches_mutex_);
      const absl::Time now = clock_.Now();
      const std::vector<std::string> due = cache_deadlines_.PopDue(now, kExpiriesPerLock);
      due_count = due.size();
      for (const std::string& id : due) {
        auto it = caches_.find(id);
        if (it == caches_.end()) continue;  // deleted since
        if (it->second->lease.ExpiredAt(now)) {
          expired.push_back(std::move(it->second));
          caches_.erase(it);
        } else {
          cache_deadlines_.Push(it->second->lease.expires_at(), id);  // renewed since
        }
      }
    }
    // Out of the map now: no call can find them; in-flight ones finish first
    // (Retire takes each cache's lock), as with DeleteCache.
    for (const std::shared_ptr<Entry>& entry : expired) Retire(*entry);
    count += expired.size();
    if (due_count < kExpiriesPerLock) break;
  }
  caches_expired_.fetch_add(count, std::memory_order_relaxed);
  return count;
}

absl::StatusOr<uint32_t> Engine::EvictIdleBytes(uint64_t bytes) {
  if (!tiering_.enabled()) {
    return absl::FailedPreconditionError(
        "host_bytes: this server has no lower tier to evict to (start kvcached with --host_bytes, "
        "or --data_dir and --disk_bytes)");
  }
  const uint64_t page_bytes = pool_.page_bytes();
  // Rounded up without bytes + page_bytes - 1, which wraps near 2^64.
  const uint64_t pages =
      bytes == 0 ? UINT32_MAX : bytes / page_bytes + (bytes % page_bytes != 0 ? 1 : 0);
  return tiering_.EvictIdle(static_cast<uint32_t>(std::min<uint64_t>(pages, UINT32_MAX)));
}

EngineStats Engine::Stats() const {
  EngineStats stats{.pool = pool_.stats(),
                    .snapshots = snapshots_.size(),
                    .caches_expired = caches_expired_.load(std::memory_order_relaxed),
                    .snapshots_expired = snapshots_.expired(),
                    .pinned_bytes = snapshots_.pinned_bytes(),
                    .max_pinned_bytes = options_.max_pinned_bytes,
                    .metadata_bytes = metadata_.used(),
                    .max_metadata_bytes = metadata_.max_bytes(),
                    .prefixes = prefixes_.Stats(),
                    .account = pool_.account_usage()};
  stats.prefixes.dropped = prefixes_dropped_.load(std::memory_order_relaxed);
  if (options_.saved_files != nullptr) {
    stats.saved_bytes = options_.saved_files->used_bytes();
    stats.max_saved_bytes = options_.saved_files->max_bytes();
  }
  absl::MutexLock lock(&caches_mutex_);
  stats.caches = caches_.size();
  return stats;
}

}  // namespace kvcache::engine
