#include "engine/snapshot_registry.h"

#include <unistd.h>

#include <random>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvcache::engine {

std::string NewRandomId() {
  // 16 bytes from the kernel's CSPRNG: unguessable ids. Drawn 256 bytes (the
  // most one getentropy call gives) at a time per thread, since the call costs
  // about a microsecond here and a snapshot per drafted token takes many ids.
  // (libstdc++'s std::random_device may use RDSEED, tens of microseconds on VMs.)
  constexpr size_t kIdBytes = 16;
  struct Entropy {
    uint8_t bytes[256];
    size_t used = sizeof(bytes);
  };
  thread_local Entropy entropy;
  if (entropy.used == sizeof(entropy.bytes)) {
    if (getentropy(entropy.bytes, sizeof(entropy.bytes)) != 0) {  // kernels without getrandom(2)
      std::random_device device;
      for (uint8_t& byte : entropy.bytes) byte = static_cast<uint8_t>(device());
    }
    entropy.used = 0;
  }
  const char* id = reinterpret_cast<const char*>(entropy.bytes + entropy.used);
  entropy.used += kIdBytes;
  return absl::BytesToHexString(absl::string_view(id, kIdBytes));
}

SnapshotInfo SnapshotRegistry::Info(const std::string& id, const Entry& entry) {
  return SnapshotInfo{.snapshot_id = id,
                      .cache_id = entry.snapshot->cache_id,
                      .from_offset = entry.snapshot->from,
                      .to_offset = entry.snapshot->to,
                      .size_bytes = entry.snapshot->size_bytes(),
                      .pinned = entry.pinned};
}

SnapshotInfo SnapshotRegistry::Add(CacheSnapshotPtr snapshot, bool pinned) {
  absl::MutexLock lock(&mutex_);
  std::string id = NewRandomId();
  while (entries_.contains(id)) id = NewRandomId();
  const Entry& entry = entries_[id] = Entry{std::move(snapshot), pinned};
  return Info(id, entry);
}

namespace {
absl::Status UnknownSnapshot(const std::string& id) {
  return absl::NotFoundError(absl::StrCat("snapshot_id: no snapshot \"", id, "\""));
}
}  // namespace

absl::StatusOr<CacheSnapshotPtr> SnapshotRegistry::Get(const std::string& snapshot_id) const {
  absl::MutexLock lock(&mutex_);
  auto it = entries_.find(snapshot_id);
  if (it == entries_.end()) return UnknownSnapshot(snapshot_id);
  return it->second.snapshot;
}

absl::Status SnapshotRegistry::Release(const std::string& snapshot_id) {
  CacheSnapshotPtr dropped;  // freed outside the lock
  absl::MutexLock lock(&mutex_);
  auto it = entries_.find(snapshot_id);
  if (it == entries_.end()) return UnknownSnapshot(snapshot_id);
  dropped = std::move(it->second.snapshot);
  entries_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SnapshotInfo>> SnapshotRegistry::Replace(
    const std::vector<std::string>& consumed, std::vector<CacheSnapshotPtr> added) {
  std::vector<CacheSnapshotPtr> dropped;
  absl::MutexLock lock(&mutex_);
  for (const std::string& id : consumed) {
    if (!entries_.contains(id)) return UnknownSnapshot(id);
  }
  bool pinned = false;
  for (const std::string& id : consumed) {
    auto it = entries_.find(id);
    if (it == entries_.end()) continue;  // the same id consumed twice
    pinned |= it->second.pinned;
    dropped.push_back(std::move(it->second.snapshot));
    entries_.erase(it);
  }
  std::vector<SnapshotInfo> infos;
  for (CacheSnapshotPtr& snapshot : added) {
    std::string id = NewRandomId();
    while (entries_.contains(id)) id = NewRandomId();
    const Entry& entry = entries_[id] = Entry{std::move(snapshot), pinned};
    infos.push_back(Info(id, entry));
  }
  return infos;
}

std::vector<SnapshotInfo> SnapshotRegistry::List(const std::string& cache_id) const {
  absl::MutexLock lock(&mutex_);
  std::vector<SnapshotInfo> infos;
  for (const auto& [id, entry] : entries_) {
    if (cache_id.empty() || entry.snapshot->cache_id == cache_id) infos.push_back(Info(id, entry));
  }
  return infos;
}

size_t SnapshotRegistry::size() const {
  absl::MutexLock lock(&mutex_);
  return entries_.size();
}

void SnapshotRegistry::Clear() {
  absl::flat_hash_map<std::string, Entry> dropped;
  absl::MutexLock lock(&mutex_);
  dropped.swap(entries_);
}

}  // namespace kvcache::engine
