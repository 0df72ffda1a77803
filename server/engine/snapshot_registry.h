// Snapshot ids: unguessable 128-bit random names for immutable CacheSnapshots.
// Holding a snapshot holds its pages; releasing the last holder frees them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/cache.h"

namespace kvcache::engine {

struct SnapshotInfo {
  std::string snapshot_id;
  std::string cache_id;
  uint64_t from_offset = 0;
  uint64_t to_offset = 0;
  uint64_t size_bytes = 0;
  bool pinned = false;
};

// 32 lowercase hex digits from the OS's random source.
std::string NewRandomId();

class SnapshotRegistry {
 public:
  SnapshotInfo Add(CacheSnapshotPtr snapshot, bool pinned);
  absl::StatusOr<CacheSnapshotPtr> Get(const std::string& snapshot_id) const;
  absl::Status Release(const std::string& snapshot_id);
  // Replaces `consumed` ids by `added` snapshots atomically: NOT_FOUND (and no
  // change) if any consumed id is gone by now.
  absl::StatusOr<std::vector<SnapshotInfo>> Replace(const std::vector<std::string>& consumed,
                                                    std::vector<CacheSnapshotPtr> added);
  std::vector<SnapshotInfo> List(const std::string& cache_id) const;
  size_t size() const;
  void Clear();

 private:
  struct Entry {
    CacheSnapshotPtr snapshot;
    bool pinned = false;
  };
  static SnapshotInfo Info(const std::string& id, const Entry& entry);

  mutable absl::Mutex mutex_;
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace kvcache::engine
