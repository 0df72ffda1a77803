#include "engine/metadata_budget.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "engine/layers/host_bytes.h"
#include "engine/layers/layer_factory.h"
#include "engine/layers/page_table.h"
#include "wire/ids/replica_id.h"

namespace kvcache::engine {
namespace {

// One handle's share of what names it, beyond its own objects: the id (a
// heap string of 32 digits, after "NAME:" where the replica is named; charged
// at the longest name, so a budget holds as many handles on every replica) in
// its map, the map's slot (flat_hash_map keeps up to
// 8/7 slots per entry and doubles: 2.3 slots of 48 bytes at worst), the id's
// copies in the lease queue (at most two: the live deadline and one stale one
// being replaced), the registry's or engine's entry (lease, mutex, pointers)
// and the shared_ptr's count beside it.
constexpr uint64_t kIdBytes = HeapBlockBytes(ids::kMaxReplicaNameBytes + 1 + 32 + 1);
constexpr uint64_t kHandleBytes =
    kIdBytes + 112 + 2 * (kIdBytes + 48) + HeapBlockBytes(kSharedCountBytes + 96);

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

uint64_t SpecHostBytes(const CacheSpec& spec) {
  return HeapBlockBytes(spec.layers.size() * sizeof(LayerSpec)) +
         HeapBlockBytes(spec.left_padding.size() * sizeof(uint32_t)) +
         (spec.model.size() > 15 ? HeapBlockBytes(spec.model.size() + 1) : 0);
}

// A page table whose highest page index is below `index_pages`, holding
// `held_pages` pages: its vector's slots, and the chunks it holds (a range of
// pages spans one chunk more than its size needs when it is not aligned).
uint64_t TableBytes(uint64_t index_pages, uint64_t held_pages) {
  const uint64_t slots = CeilDiv(index_pages, PageTable::kChunkPages);
  const uint64_t chunks = std::min(slots, CeilDiv(held_pages, PageTable::kChunkPages) + 1);
  // A vector grown by appends holds up to twice its size.
  return HeapBlockBytes(2 * slots * 2 * sizeof(void*)) + chunks * PageTable::ChunkHostBytes();
}

// The highest page index a layer snapshot's table can use: attention layers
// index pages by position up to to(); recurrent ones (no geometry) by state page.
uint64_t IndexPages(const CacheSnapshot& snapshot, size_t layer, uint64_t held_pages,
                    uint64_t page_bytes, uint32_t page_tokens) {
  if (IsRecurrent(snapshot.spec.layers[layer])) return held_pages;
  const absl::StatusOr<PageGeometry> geometry =
      GeometryFor(snapshot.spec, layer, page_bytes, page_tokens);
  if (!geometry.ok()) return held_pages;
  return std::max(held_pages, CeilDiv(snapshot.layers[layer]->to(), geometry->page_tokens));
}

}  // namespace

MetadataCharge& MetadataCharge::operator=(MetadataCharge&& other) noexcept {
  if (this != &other) {
    Return();
    budget_ = std::exchange(other.budget_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void MetadataCharge::Return() {
  if (budget_ != nullptr) budget_->used_.fetch_sub(bytes_, std::memory_order_relaxed);
  budget_ = nullptr;
  bytes_ = 0;
}

absl::StatusOr<MetadataCharge> MetadataBudget::Charge(uint64_t bytes, const char* what) {
  uint64_t used = used_.load(std::memory_order_relaxed);
  do {
    if (max_bytes_ != 0 && used + bytes > max_bytes_) {
      // Raising the server's flag would not help a tenant held by its own quota.
      const std::string limit =
          quota_of_.empty()
              ? std::string(kMetadataBudgetName)
              : absl::StrFormat("max_%s: tenant %s's quota", kMetadataBudgetName, quota_of_);
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%s: %s needs %d bytes of host memory for its tables and %d of %d are in use; release "
          "caches or snapshots%s",
          limit, what, bytes, used, max_bytes_,
          quota_of_.empty() ? ", or raise --metadata_bytes" : ""));
    }
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return MetadataCharge(this, bytes);
}

MetadataCharge MetadataBudget::Reserve(uint64_t bytes) {
  used_.fetch_add(bytes, std::memory_order_relaxed);
  return MetadataCharge(this, bytes);
}

// A cache: its entry and Cache object, its spec, and per layer the layer
// object and its page table's first chunk. Chunks past the first are the
// pool's (PoolTablesBytes).
uint64_t CacheMetadataBytes(const CacheSpec& spec) {
  const uint64_t layers = spec.layers.size();
  return kHandleBytes + HeapBlockBytes(sizeof(Cache)) + SpecHostBytes(spec) +
         HeapBlockBytes(layers * sizeof(void*)) + layers * (MaxLayerHostBytes() + TableBytes(1, 1));
}

// A snapshot: its entry and CacheSnapshot (with a copy of the spec), and per
// layer held the layer snapshot and every chunk of its table, as if no other
// table shared them.
uint64_t SnapshotMetadataBytes(const CacheSnapshot& snapshot, uint64_t page_bytes,
                               uint32_t page_tokens) {
  uint64_t bytes = kHandleBytes + HeapBlockBytes(kSharedCountBytes + sizeof(CacheSnapshot)) +
                   SpecHostBytes(snapshot.spec) + kIdBytes +
                   HeapBlockBytes(snapshot.layers.size() * sizeof(LayerSnapshotPtr));
  for (size_t layer = 0; layer < snapshot.layers.size(); ++layer) {
    if (snapshot.layers[layer] == nullptr) continue;
    const uint64_t held_pages = CeilDiv(snapshot.layers[layer]->size_bytes(), page_bytes);
    bytes +=
        MaxLayerSnapshotHostBytes() +
        TableBytes(IndexPages(snapshot, layer, held_pages, page_bytes, page_tokens), held_pages);
  }
  return bytes;
}

uint64_t PrefixEntryMetadataBytes(uint64_t tokens, const PrefixBlocks* ledger) {
  // A tree edge may split a node in two: at most two nodes (with their child
  // maps) per entry, plus the entry itself and its id in the index.
  constexpr uint64_t kNodesBytes = 2 * HeapBlockBytes(160);
  const uint64_t ledger_bytes =
      ledger == nullptr ? 0 : tokens / ledger->block_tokens() * ledger->MaxBytesPerBlock();
  return 2 * HeapBlockBytes(tokens * sizeof(uint32_t)) + kNodesBytes + kHandleBytes + ledger_bytes;
}

uint64_t PoolTablesBytes(uint64_t pool_pages) { return TableBytes(pool_pages, pool_pages); }

uint64_t DefaultMetadataBytes(uint64_t pool_bytes) {
  return std::max<uint64_t>(64ull << 20, pool_bytes / 8);
}

}  // namespace kvcache::engine
