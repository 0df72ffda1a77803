// Engine::LockedCache, shared by engine.cc and engine_speculation.cc (not part
// of the engine's interface): a cache found by id whose mutex is held for the
// rest of the call, with the speculation open on it, if any.
// A scoped lockable for clang's thread-safety analysis: constructing one
// acquires the entry's mutex, moving one hands it on, destroying one releases
// it. The analysis cannot follow a lock out of the function that took it (Open
// returns it through StatusOr), so the accessors assert the lock at run time.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/client_text.h"
#include "core/status_macros.h"
#include "engine/engine.h"
#include "engine/speculation/speculation.h"

namespace kvcache::engine {

inline absl::Status UnknownCache(const std::string& cache_id) {
  return absl::NotFoundError(absl::StrCat("cache_id: no cache ", Quoted(cache_id)));
}

class ABSL_SCOPED_LOCKABLE Engine::LockedCache {
 public:
  static absl::StatusOr<LockedCache> Open(const Engine& engine, const std::string& cache_id) {
    ASSIGN_OR_RETURN(std::shared_ptr<Entry> entry, engine.FindEntry(cache_id));
    return OpenEntry(std::move(entry), cache_id);
  }
  // `entry` locked; NOT_FOUND (naming cache_id) once deleted.
  static absl::StatusOr<LockedCache> OpenEntry(std::shared_ptr<Entry> entry,
                                               const std::string& cache_id) {
    LockedCache locked(entry);
    if (entry->deleted) return UnknownCache(cache_id);
    return locked;
  }
  // Every distinct id of `ids` opened in id order, so that calls locking the same
  // caches cannot deadlock; NOT_FOUND names the id's entry of `fields`.
  static absl::StatusOr<std::vector<std::pair<std::string, LockedCache>>> OpenInOrder(
      const Engine& engine, absl::Span<const std::string> ids,
      absl::Span<const std::string> fields) {
    std::vector<size_t> order(ids.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return ids[a] < ids[b]; });
    std::vector<std::pair<std::string, LockedCache>> opened;
    for (size_t i : order) {
      if (!opened.empty() && opened.back().first == ids[i]) continue;
      absl::StatusOr<LockedCache> cache = Open(engine, ids[i]);
      if (!cache.ok()) {
        return absl::NotFoundError(absl::StrCat(fields[i], ": no cache ", Quoted(ids[i])));
      }
      opened.emplace_back(ids[i], *std::move(cache));
    }
    return opened;
  }
  LockedCache(LockedCache&& other) noexcept ABSL_EXCLUSIVE_LOCK_FUNCTION(other.entry_->mutex)
      : entry_(std::move(other.entry_)) {}
  ~LockedCache() ABSL_UNLOCK_FUNCTION() {
    if (entry_) entry_->mutex.Unlock();
  }
  Cache& operator*() const {
    entry_->mutex.AssertHeld();
    return *entry_->cache;
  }
  Cache* operator->() const {
    entry_->mutex.AssertHeld();
    return entry_->cache.get();
  }
  const std::shared_ptr<Entry>& entry() const { return entry_; }
  // The cache described for the caller, its lease included.
  CacheInfo Describe(const std::string& cache_id) const {
    entry_->mutex.AssertHeld();
    return Engine::Describe(cache_id, *entry_->cache, entry_->lease);
  }
  // Puts `cache` in the old one's place and frees the old one's pages.
  // Puts `cache` in the old one's place, with its metadata charge.
  void Replace(std::unique_ptr<Cache> cache, MetadataCharge metadata) {
    entry_->mutex.AssertHeld();
    entry_->cache.swap(cache);
    entry_->metadata = std::move(metadata);
    cache->Free();
  }
  // The speculation open on the cache, or null.
  Speculation* speculation() const {
    entry_->mutex.AssertHeld();
    return entry_->speculation.get();
  }
  std::unique_ptr<Speculation>& speculation_slot() const {
    entry_->mutex.AssertHeld();
    return entry_->speculation;
  }
  // FAILED_PRECONDITION (naming `field`) while a speculation is open: the
  // live layers hold its drafted tokens and must not change under it.
  absl::Status RefuseWhileSpeculating(const char* field) const {
    if (speculation() == nullptr) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": a speculation is open on this cache; commit or abort it first (snapshots and "
               "reads of the committed history stay allowed)"));
  }

 private:
  explicit LockedCache(const std::shared_ptr<Entry>& entry) ABSL_EXCLUSIVE_LOCK_FUNCTION(entry->mutex)
      : entry_(entry) {
    entry_->mutex.Lock();
  }
  std::shared_ptr<Entry> entry_;
};

}  // namespace kvcache::engine
