// The host memory that caches and snapshots hold outside the pool: layer
// objects, page tables, specs, ids, registry and lease entries. Pool pages
// are bounded by the pool; this is bounded here, so that no pattern of calls
// (thousands of snapshots of a 1,024-layer cache, thousands of empty caches)
// can grow the server without limit.
//
// Each cache and snapshot is charged, when it is made, an upper bound of what
// it can come to hold (metadata_budget.cc says how each bound is reached), and
// the charge is returned when it goes. A charge past the budget is refused
// before anything changes: RESOURCE_EXHAUSTED naming metadata_bytes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "engine/layers/cache.h"
#include "engine/layers/cache_spec.h"
#include "engine/prefix/prefix_blocks.h"

namespace kvcache::engine {

// The flag, and the first word of every refusal of this budget.
inline constexpr char kMetadataBudgetName[] = "metadata_bytes";

class MetadataBudget;

// Bytes taken from a MetadataBudget, returned when this is destroyed.
class MetadataCharge {
 public:
  MetadataCharge() = default;
  MetadataCharge(MetadataCharge&& other) noexcept { *this = std::move(other); }
  MetadataCharge& operator=(MetadataCharge&& other) noexcept;
  ~MetadataCharge() { Return(); }
  uint64_t bytes() const { return bytes_; }

 private:
  friend class MetadataBudget;
  MetadataCharge(MetadataBudget* budget, uint64_t bytes) : budget_(budget), bytes_(bytes) {}
  void Return();

  MetadataBudget* budget_ = nullptr;
  uint64_t bytes_ = 0;
};

class MetadataBudget {
 public:
  // 0: no limit (still counted). `quota_of`: the tenant whose own
  // max_metadata_bytes (tokens file) is the limit, named in refusals; empty
  // where the limit is the server's --metadata_bytes.
  explicit MetadataBudget(uint64_t max_bytes, std::string quota_of = "")
      : max_bytes_(max_bytes), quota_of_(std::move(quota_of)) {}
  MetadataBudget(const MetadataBudget&) = delete;
  MetadataBudget& operator=(const MetadataBudget&) = delete;

  // `bytes` more for `what` (a cache, a snapshot), or RESOURCE_EXHAUSTED
  // naming metadata_bytes and what was asked for; nothing taken then.
  absl::StatusOr<MetadataCharge> Charge(uint64_t bytes, const char* what);
  // `bytes` taken whatever is in use (what the engine itself needs to run).
  MetadataCharge Reserve(uint64_t bytes);
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t max_bytes() const { return max_bytes_; }

 private:
  friend class MetadataCharge;
  const uint64_t max_bytes_;
  const std::string quota_of_;
  std::atomic<uint64_t> used_{0};
};

// The most host memory a cache of `spec` holds outside its pages' chunk
// tables beyond one chunk per layer (the pool bounds the rest: see
// PoolTablesBytes).
uint64_t CacheMetadataBytes(const CacheSpec& spec);
// The most a registered snapshot can come to hold alone, once every cache it
// shares page-table chunks with has moved on; `page_bytes` is the pool's.
// `page_bytes` and `page_tokens` are the pool's and the engine's.
uint64_t SnapshotMetadataBytes(const CacheSnapshot& snapshot, uint64_t page_bytes,
                               uint32_t page_tokens);
// What a published prefix of `tokens` adds to its snapshot's charge: the
// tokens, once on the index's tree and once in its entry, and their nodes;
// where a KV-event ledger counts the entry's blocks (null: none, or an entry
// the ledger does not announce), the blocks it may add there.
uint64_t PrefixEntryMetadataBytes(uint64_t tokens, const PrefixBlocks* ledger);
// The chunks live caches' page tables hold beyond their first per layer: one
// per kChunkPages pages of the pool, reserved once.
uint64_t PoolTablesBytes(uint64_t pool_pages);
// A budget for a pool of `pool_bytes` when none is set: an eighth of the
// pool, at least 64 MiB, enough for thousands of snapshots of large models.
uint64_t DefaultMetadataBytes(uint64_t pool_bytes);

}  // namespace kvcache::engine
