#include "engine/snapshot_registry.h"

#include <unistd.h>

#include <algorithm>
#include <random>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/client_text.h"
#include "core/status_macros.h"

namespace kvcache::engine {

std::string NewRandomId(absl::string_view prefix) {
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
  return absl::StrCat(prefix, absl::BytesToHexString(absl::string_view(id, kIdBytes)));
}

SnapshotInfo SnapshotRegistry::Info(const std::string& id, const Entry& entry) {
  return SnapshotInfo{
      .snapshot_id = id,
      .cache_id = entry.snapshot->cache_id,
      .from_offset = entry.snapshot->from,
      .to_offset = entry.snapshot->to,
      .size_bytes = entry.snapshot->size_bytes(),
      .tiers = entry.snapshot->Tiers(),
      .pinned = entry.pinned,
      .ttl = entry.lease.ttl(),
      .expires_at = entry.pinned ? absl::InfiniteFuture() : entry.lease.expires_at(),
      .last_use = entry.last_use};
}

namespace {

absl::Status UnknownSnapshot(const std::string& id, const std::string& field = "snapshot_id") {
  return absl::NotFoundError(absl::StrCat(field, ": no snapshot ", Quoted(id)));
}

}  // namespace

bool SnapshotRegistry::Live(const Entry& entry, absl::Time now) {
  return entry.pinned || !entry.lease.ExpiredAt(now);
}

absl::flat_hash_map<std::string, SnapshotRegistry::Entry>::iterator SnapshotRegistry::FindLive(
    const std::string& snapshot_id, absl::Time now) const {
  auto it = entries_.find(snapshot_id);
  if (it != entries_.end() && !Live(it->second, now)) return entries_.end();
  return it;
}

SnapshotInfo SnapshotRegistry::Insert(Entry entry) {
  std::string id = NewRandomId(options_.id_prefix);
  while (entries_.contains(id)) id = NewRandomId(options_.id_prefix);
  if (entry.pinned) {
    pinned_bytes_ += entry.snapshot->size_bytes();
  } else {
    entry.lease.Renew(clock_.Now());
  }
  entry.last_use = ++use_clock_;
  Entry& added = entries_.try_emplace(id, std::move(entry)).first->second;
  QueueDeadline(id, added);
  return Info(id, added);
}

void SnapshotRegistry::QueueDeadline(const std::string& id, Entry& entry) {
  if (entry.queued || entry.pinned || !entry.lease.has_ttl()) return;
  deadlines_.Push(entry.lease.expires_at(), id);
  entry.queued = true;
}

absl::Status SnapshotRegistry::CheckPinBudget(uint64_t more_bytes) const {
  if (options_.max_pinned_bytes == 0 || pinned_bytes_ + more_bytes <= options_.max_pinned_bytes) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrFormat(
      "max_pinned_bytes: pinning %d more bytes would pass the budget of %d (%d pinned)", more_bytes,
      options_.max_pinned_bytes, pinned_bytes_));
}

absl::Status SnapshotRegistry::CheckCount(uint64_t more, uint64_t leaving) const {
  const uint64_t after = entries_.size() - leaving + more;
  if (options_.max_snapshots == 0 || after <= options_.max_snapshots) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrFormat(
      "max_snapshots: %d snapshots are held, the quota (prefix entries count; release some)",
      entries_.size()));
}

SnapshotRegistry::Dropped::~Dropped() {
  snapshots_.clear();
  if (options_.on_drop && !ids_.empty()) options_.on_drop(ids_);
}

void SnapshotRegistry::Dropped::Add(std::string id, CacheSnapshotPtr snapshot) {
  ids_.push_back(std::move(id));
  snapshots_.push_back(std::move(snapshot));
}

void SnapshotRegistry::Erase(absl::flat_hash_map<std::string, Entry>::iterator it,
                             Dropped& dropped) {
  if (it->second.pinned) pinned_bytes_ -= it->second.snapshot->size_bytes();
  dropped.Add(it->first, std::move(it->second.snapshot));
  entries_.erase(it);
}

absl::StatusOr<SnapshotInfo> SnapshotRegistry::Add(CacheSnapshotPtr snapshot,
                                                   MetadataCharge metadata, bool pinned,
                                                   absl::Duration ttl) {
  absl::MutexLock lock(&mutex_);
  RETURN_IF_ERROR(CheckCount(1, 0));
  if (pinned) RETURN_IF_ERROR(CheckPinBudget(snapshot->size_bytes()));
  if (ttl == absl::ZeroDuration()) ttl = options_.default_ttl;
  return Insert(Entry{.snapshot = std::move(snapshot),
                      .metadata = std::move(metadata),
                      .pinned = pinned,
                      .lease = Lease(ttl)});
}

absl::StatusOr<CacheSnapshotPtr> SnapshotRegistry::Get(const std::string& snapshot_id) const {
  absl::MutexLock lock(&mutex_);
  const absl::Time now = clock_.Now();
  auto it = FindLive(snapshot_id, now);
  if (it == entries_.end()) return UnknownSnapshot(snapshot_id);
  // Renewed under the lock that Expire takes: a call either renews it in
  // time or finds it gone.
  it->second.lease.Renew(now);
  it->second.last_use = ++use_clock_;
  return it->second.snapshot;
}

void SnapshotRegistry::VisitForEviction(
    absl::FunctionRef<void(const CacheSnapshotPtr&, bool, uint64_t)> visit,
    absl::FunctionRef<void()> then) const {
  absl::MutexLock lock(&mutex_);
  for (const auto& [id, entry] : entries_) visit(entry.snapshot, entry.pinned, entry.last_use);
  then();
}

std::optional<SnapshotInfo> SnapshotRegistry::Peek(const std::string& snapshot_id) const {
  absl::MutexLock lock(&mutex_);
  auto it = FindLive(snapshot_id, clock_.Now());
  if (it == entries_.end()) return std::nullopt;
  return Info(it->first, it->second);
}

absl::Status SnapshotRegistry::Release(const std::string& snapshot_id) {
  Dropped dropped(options_);  // freed outside the lock
  absl::MutexLock lock(&mutex_);
  auto it = FindLive(snapshot_id, clock_.Now());
  if (it == entries_.end()) return UnknownSnapshot(snapshot_id);  // expired: the reaper's
  Erase(it, dropped);
  return absl::OkStatus();
}

bool SnapshotRegistry::ReleaseUnpinned(const std::string& snapshot_id) {
  Dropped dropped(options_);
  absl::MutexLock lock(&mutex_);
  auto it = FindLive(snapshot_id, clock_.Now());
  if (it == entries_.end() || it->second.pinned) return false;
  Erase(it, dropped);
  return true;
}

absl::StatusOr<std::vector<SnapshotInfo>> SnapshotRegistry::Replace(
    const std::vector<std::string>& consumed, std::vector<CacheSnapshotPtr> added,
    std::vector<MetadataCharge> metadata) {
  Dropped dropped(options_);
  absl::MutexLock lock(&mutex_);
  bool pinned = false;
  // The longest of their leases, where a handle without one outlives any.
  absl::Duration ttl;
  bool unleased = false;
  uint64_t consumed_pinned_bytes = 0;
  uint64_t distinct_consumed = 0;
  const absl::Time now = clock_.Now();
  for (size_t i = 0; i < consumed.size(); ++i) {
    auto it = FindLive(consumed[i], now);
    if (it == entries_.end()) return UnknownSnapshot(consumed[i]);
    const bool repeated =
        std::find(consumed.begin(), consumed.begin() + i, consumed[i]) != consumed.begin() + i;
    distinct_consumed += repeated ? 0 : 1;
    if (it->second.pinned && !repeated) consumed_pinned_bytes += it->second.snapshot->size_bytes();
    pinned |= it->second.pinned;
    unleased |= !it->second.lease.has_ttl();
    ttl = std::max(ttl, it->second.lease.ttl());
  }
  if (unleased) ttl = absl::ZeroDuration();
  RETURN_IF_ERROR(CheckCount(added.size(), distinct_consumed));
  if (pinned) {
    uint64_t added_bytes = 0;
    for (const CacheSnapshotPtr& snapshot : added) added_bytes += snapshot->size_bytes();
    if (added_bytes > consumed_pinned_bytes) {
      RETURN_IF_ERROR(CheckPinBudget(added_bytes - consumed_pinned_bytes));
    }
  }
  for (const std::string& id : consumed) {
    auto it = entries_.find(id);
    if (it != entries_.end()) Erase(it, dropped);  // else the same id consumed twice
  }
  std::vector<SnapshotInfo> infos;
  for (size_t i = 0; i < added.size(); ++i) {
    infos.push_back(Insert(Entry{.snapshot = std::move(added[i]),
                                 .metadata = std::move(metadata[i]),
                                 .pinned = pinned,
                                 .lease = Lease(ttl)}));
  }
  return infos;
}

std::vector<SnapshotInfo> SnapshotRegistry::List(const std::string& cache_id) const {
  absl::MutexLock lock(&mutex_);
  const absl::Time now = clock_.Now();
  std::vector<SnapshotInfo> infos;
  for (const auto& [id, entry] : entries_) {
    if (!Live(entry, now)) continue;
    if (cache_id.empty() || entry.snapshot->cache_id == cache_id) infos.push_back(Info(id, entry));
  }
  return infos;
}

absl::StatusOr<SnapshotInfo> SnapshotRegistry::SetPinned(const std::string& snapshot_id,
                                                         bool pinned) {
  absl::MutexLock lock(&mutex_);
  const absl::Time now = clock_.Now();
  auto it = FindLive(snapshot_id, now);
  if (it == entries_.end()) return UnknownSnapshot(snapshot_id);
  Entry& entry = it->second;
  const uint64_t bytes = entry.snapshot->size_bytes();
  if (pinned && !entry.pinned) {
    RETURN_IF_ERROR(CheckPinBudget(bytes));
    pinned_bytes_ += bytes;
  } else if (!pinned && entry.pinned) {
    pinned_bytes_ -= bytes;
  }
  entry.pinned = pinned;
  // Naming it renews it; an unpinned lease runs from now.
  entry.lease.Renew(now);
  entry.last_use = ++use_clock_;
  QueueDeadline(snapshot_id, entry);
  return Info(snapshot_id, entry);
}

absl::Status SnapshotRegistry::CheckPinnable(const std::string& snapshot_id) const {
  absl::MutexLock lock(&mutex_);
  auto it = FindLive(snapshot_id, clock_.Now());
  if (it == entries_.end()) return UnknownSnapshot(snapshot_id);
  if (it->second.pinned) return absl::OkStatus();
  return CheckPinBudget(it->second.snapshot->size_bytes());
}

absl::StatusOr<std::vector<LeaseInfo>> SnapshotRegistry::Renew(absl::Span<const std::string> ids,
                                                               const std::string& field) {
  absl::MutexLock lock(&mutex_);
  const absl::Time now = clock_.Now();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (FindLive(ids[i], now) == entries_.end()) {
      return UnknownSnapshot(ids[i], absl::StrCat(field, "[", i, "]"));
    }
  }
  std::vector<LeaseInfo> leases;
  for (const std::string& id : ids) {
    Entry& entry = entries_.find(id)->second;
    entry.lease.Renew(now);
    entry.last_use = ++use_clock_;
    const SnapshotInfo info = Info(id, entry);
    leases.push_back(LeaseInfo{.id = id,
                               .ttl = entry.pinned ? absl::ZeroDuration() : info.ttl,
                               .expires_at = info.expires_at});
  }
  return leases;
}

uint64_t SnapshotRegistry::Expire() {
  uint64_t count = 0;
  for (;;) {
    Dropped dropped(options_);  // freed outside the lock, between batches
    absl::MutexLock lock(&mutex_);
    const absl::Time now = clock_.Now();
    const std::vector<std::string> due = deadlines_.PopDue(now, kExpiriesPerLock);
    for (const std::string& id : due) {
      auto it = entries_.find(id);
      if (it == entries_.end()) continue;  // released since
      it->second.queued = false;
      if (it->second.pinned) continue;  // SetPinned queues it again when unpinned
      if (it->second.lease.ExpiredAt(now)) {
        Erase(it, dropped);
        ++count;
      } else {
        QueueDeadline(id, it->second);  // renewed since
      }
    }
    expired_ += dropped.size();
    if (due.size() < kExpiriesPerLock) return count;
  }
}

size_t SnapshotRegistry::size() const {
  absl::MutexLock lock(&mutex_);
  return entries_.size();
}

size_t SnapshotRegistry::queued_deadlines() const {
  absl::MutexLock lock(&mutex_);
  return deadlines_.size();
}

uint64_t SnapshotRegistry::pinned_bytes() const {
  absl::MutexLock lock(&mutex_);
  return pinned_bytes_;
}

uint64_t SnapshotRegistry::expired() const {
  absl::MutexLock lock(&mutex_);
  return expired_;
}

void SnapshotRegistry::Clear() {
  absl::flat_hash_map<std::string, Entry> dropped;
  absl::MutexLock lock(&mutex_);
  dropped.swap(entries_);
  deadlines_ = LeaseQueue();
  pinned_bytes_ = 0;
}

}  // namespace kvcache::engine
