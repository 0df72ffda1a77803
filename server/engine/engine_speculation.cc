// Engine's speculation calls (engine.h; semantics in engine/speculation/speculation.h).
// A speculation lives in its cache's entry, under the cache's mutex; the
// engine maps its id to that entry.
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/client_text.h"
#include "core/status_macros.h"
#include "engine/engine.h"
#include "engine/engine_locked_cache.h"

namespace kvcache::engine {
namespace {

absl::Status UnknownSpeculation(const std::string& speculation_id) {
  return absl::NotFoundError(
      absl::StrCat("speculation_id: no open speculation ", Quoted(speculation_id)));
}

}  // namespace

SpeculationInfo Engine::DescribeSpeculation(const std::string& cache_id,
                                            const Speculation& speculation) {
  return SpeculationInfo{.speculation_id = speculation.id(),
                         .cache_id = cache_id,
                         .isolated = speculation.isolated(),
                         .committed_offset = speculation.committed(),
                         .layer_offsets = speculation.layer_offsets()};
}

absl::StatusOr<SpeculationInfo> Engine::BeginSpeculation(const std::string& cache_id,
                                                         bool isolated) {
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<SpeculationInfo> {
    ASSIGN_OR_RETURN(LockedCache cache, LockedCache::Open(*this, cache_id));
    if (cache.speculation() != nullptr) {
      return absl::FailedPreconditionError(
          "cache_id: a speculation is already open on this cache; commit or abort it first");
    }
    std::string id;
    {
      // Reserved before the drafts exist; a lookup meanwhile finds the cache
      // without it and answers NOT_FOUND.
      absl::MutexLock lock(&speculations_mutex_);
      do id = NewRandomId(options_.id_prefix);
      while (speculations_.contains(id));
      speculations_.emplace(id, SpeculationOwner{cache_id, cache.entry()});
    }
    absl::StatusOr<std::unique_ptr<Speculation>> speculation =
        Speculation::Begin(*cache, id, isolated);
    if (!speculation.ok()) {
      ForgetSpeculation(id);
      return speculation.status();
    }
    cache.speculation_slot() = *std::move(speculation);
    return DescribeSpeculation(cache_id, *cache.speculation());
  });
}

absl::StatusOr<Engine::LockedCache> Engine::OpenSpeculation(const std::string& speculation_id,
                                                            const std::string& cache_id,
                                                            std::string* owner_id) const {
  std::shared_ptr<Entry> entry;  // only this is copied: an update per layer comes here
  {
    absl::MutexLock lock(&speculations_mutex_);
    auto it = speculations_.find(speculation_id);
    if (it == speculations_.end()) return UnknownSpeculation(speculation_id);
    // Named with another cache: as unknown, so no one learns what it belongs to.
    if (!cache_id.empty() && cache_id != it->second.cache_id) {
      return UnknownSpeculation(speculation_id);
    }
    entry = it->second.entry;
    if (owner_id != nullptr) *owner_id = it->second.cache_id;
  }
  // A call on the speculation names its cache too: renewed under the lock the
  // reaper expires caches under, as FindEntry does, so that a call either
  // renews it in time or finds it gone (renewed outside it, a call could be
  // acknowledged just before the reaper, which had found the lease run out,
  // deleted the cache with what the call wrote).
  if (entry->lease.has_ttl()) {
    absl::MutexLock lock(&caches_mutex_);
    if (!entry->lease.RenewIfLive(clock_)) return UnknownSpeculation(speculation_id);
  }
  absl::StatusOr<LockedCache> cache = LockedCache::OpenEntry(std::move(entry), cache_id);
  // Ended (and perhaps another begun) between the lookup and the lock.
  if (!cache.ok() || cache->speculation() == nullptr ||
      cache->speculation()->id() != speculation_id) {
    return UnknownSpeculation(speculation_id);
  }
  return cache;
}

void Engine::ForgetSpeculation(const std::string& speculation_id) {
  SpeculationOwner dropped;  // released outside the lock
  absl::MutexLock lock(&speculations_mutex_);
  auto it = speculations_.find(speculation_id);
  if (it == speculations_.end()) return;
  dropped = std::move(it->second);
  speculations_.erase(it);
}

void Engine::EndSpeculation(LockedCache& cache) {
  const std::string id = cache.speculation()->id();
  cache.speculation_slot().reset();  // releases what only the drafts held
  cache->NoteChanged();
  ForgetSpeculation(id);
}

absl::StatusOr<SpeculationInfo> Engine::GetSpeculation(const std::string& speculation_id,
                                                        const std::string& cache_id) const {
  std::string owner_id;
  ASSIGN_OR_RETURN(LockedCache cache, OpenSpeculation(speculation_id, cache_id, &owner_id));
  return DescribeSpeculation(owner_id, *cache.speculation());
}

absl::StatusOr<uint64_t> Engine::UpdateSpeculation(const std::string& speculation_id,
                                                   const std::string& cache_id, uint32_t layer,
                                                   const KvInput& kv,
                                                   std::optional<uint64_t> expected_offset) {
  if (kv.tokens > options_.max_update_tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tokens: %d in one update, more than the limit of %d", kv.tokens,
        options_.max_update_tokens));
  }
  return UpdateDraft(speculation_id, cache_id, layer, expected_offset,
                     [&](Speculation& speculation) { return speculation.Update(layer, kv); });
}

absl::StatusOr<uint64_t> Engine::UpdateSpeculationState(const std::string& speculation_id,
                                                        const std::string& cache_id,
                                                        uint32_t layer, const StateInput& state,
                                                        std::optional<uint64_t> expected_offset) {
  return UpdateDraft(speculation_id, cache_id, layer, expected_offset,
                     [&](Speculation& speculation) { return speculation.UpdateState(layer, state); });
}

absl::StatusOr<uint64_t> Engine::UpdateDraft(const std::string& speculation_id,
                                             const std::string& cache_id, uint32_t layer,
                                             std::optional<uint64_t> expected_offset,
                                             absl::FunctionRef<absl::Status(Speculation&)> apply) {
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<uint64_t> {
    ASSIGN_OR_RETURN(LockedCache cache, OpenSpeculation(speculation_id, cache_id));
    Speculation& speculation = *cache.speculation();
    if (layer >= speculation.num_layers()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "layer: %d is out of range; the cache has %d layers", layer, speculation.num_layers()));
    }
    const uint64_t offset = speculation.layer_offset(layer);
    if (expected_offset.has_value() && *expected_offset != offset) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "expected_offset: layer %d of the speculation is at offset %d (committed + drafted), "
          "not %d",
          layer, offset, *expected_offset));
    }
    RETURN_IF_ERROR(apply(speculation));
    return speculation.layer_offset(layer);
  });
}

absl::StatusOr<std::shared_ptr<const CacheSnapshot>> Engine::Freeze(
    const std::string& cache_id, const std::string& snapshot_id,
    const std::string& speculation_id) const {
  if (speculation_id.empty()) return Freeze(cache_id, snapshot_id);
  if (!snapshot_id.empty()) {
    return absl::InvalidArgumentError(
        "speculation_id: read a snapshot or a speculation, not both (snapshot_id is set)");
  }
  std::string owner_id;
  ASSIGN_OR_RETURN(LockedCache cache, OpenSpeculation(speculation_id, cache_id, &owner_id));
  return cache.speculation()->Freeze(owner_id);
}

absl::StatusOr<CacheInfo> Engine::CommitSpeculation(const std::string& speculation_id,
                                                    uint64_t accepted) {
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<CacheInfo> {
    std::string cache_id;
    ASSIGN_OR_RETURN(LockedCache cache, OpenSpeculation(speculation_id, "", &cache_id));
    RETURN_IF_ERROR(cache.speculation()->Commit(accepted));
    EndSpeculation(cache);
    return cache.Describe(cache_id);
  });
}

absl::StatusOr<CacheInfo> Engine::AbortSpeculation(const std::string& speculation_id) {
  std::string cache_id;
  ASSIGN_OR_RETURN(LockedCache cache, OpenSpeculation(speculation_id, "", &cache_id));
  EndSpeculation(cache);
  return cache.Describe(cache_id);
}

}  // namespace kvcache::engine
