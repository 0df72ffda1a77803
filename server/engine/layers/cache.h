// A cache: one Layer per LayerSpec, stepping together. Whole-cache snapshots
// are a LayerSnapshot per layer plus the token range they cover.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "engine/layers/cache_spec.h"
#include "engine/layers/layer.h"
#include "gpu/page_pool.h"

namespace kvcache::engine {

// Bytes of distinct pages in each tier.
struct TierBytes {
  uint64_t device = 0;
  uint64_t host = 0;
  uint64_t disk = 0;
};

// The pool's eviction epoch at which a snapshot last had all its pages on the
// device (engine/tiering.h); copies carry the value.
class ResidentEpoch {
 public:
  ResidentEpoch() = default;
  ResidentEpoch(const ResidentEpoch& other) : epoch_(other.load()) {}
  ResidentEpoch& operator=(const ResidentEpoch& other) {
    store(other.load());
    return *this;
  }
  uint64_t load() const { return epoch_.load(std::memory_order_acquire); }
  void store(uint64_t epoch) const { epoch_.store(epoch, std::memory_order_release); }

 private:
  // UINT64_MAX: not known to be resident at any epoch yet.
  mutable std::atomic<uint64_t> epoch_{UINT64_MAX};
};

// An immutable whole-cache snapshot: a registered one, or the live cache (or
// a speculation) frozen for a Fetch (Engine::Freeze). A null layer entry
// holds nothing for that layer (the reference's nil snapshot).
struct CacheSnapshot {
  std::string cache_id;
  CacheSpec spec;
  uint64_t from = 0;
  uint64_t to = 0;
  std::vector<LayerSnapshotPtr> layers;
  // The Cache::layout_id() and generation() it was taken at; 0 when it is not
  // the picture of a live cache (a merge, a split).
  uint64_t source_layout_id = 0;
  uint64_t source_generation = 0;
  ResidentEpoch resident_epoch;

  uint64_t size_bytes() const;
  // Every page of every layer (a page appears once per layer holding it).
  void ForEachPage(absl::FunctionRef<void(gpu::PageId)> visit) const;
  // Where its pages are now (layers hold pages of their own, never shared
  // with another layer of the same snapshot).
  TierBytes Tiers() const;
  // Tokens of `layer` in temporal order, clipped to [window.begin, window.end).
  std::vector<TokenRange> Ranges(uint32_t layer, TokenRange window) const;
  absl::Status Read(uint32_t layer, TokenRange range, const KvOutput& out) const;
  // LayerSnapshot::Mapped of one layer.
  absl::Status Mapped(uint32_t layer, TokenRange range, KvMappedPieces& out) const;
  // Quantized layers: `range` as stored (packed). Recurrent layers: the state.
  absl::Status ReadPacked(uint32_t layer, TokenRange range, const PackedOutput& out) const;
  absl::Status ReadState(uint32_t layer, const StateOutput& out) const;

 private:
  // The layer's snapshot; INVALID_ARGUMENT when out of range or holding nothing.
  absl::StatusOr<const LayerSnapshot*> HeldLayer(uint32_t layer) const;
};

// Whole-snapshot merge and split, layer by layer; no live cache is involved.
// [a,b) + [b,c) -> [a,c): FAILED_PRECONDITION unless same layout and adjacent.
absl::StatusOr<std::shared_ptr<const CacheSnapshot>> MergeSnapshots(const CacheSnapshot& parent,
                                                                    const CacheSnapshot& child);
// [a,c) at b -> ([a,b), [b,c)): FAILED_PRECONDITION unless a < b < c.
absl::StatusOr<std::pair<std::shared_ptr<const CacheSnapshot>, std::shared_ptr<const CacheSnapshot>>>
SplitSnapshot(const CacheSnapshot& snapshot, uint64_t at);

using CacheSnapshotPtr = std::shared_ptr<const CacheSnapshot>;

class Cache {
 public:
  // `spec` must be validated and normalised.
  static absl::StatusOr<std::unique_ptr<Cache>> Create(const CacheSpec& spec, gpu::PagePool& pool,
                                                       uint32_t page_tokens);

  const CacheSpec& spec() const { return spec_; }
  size_t num_layers() const { return layers_.size(); }
  const Layer& layer(size_t index) const { return *layers_[index]; }
  // For a speculation's drafts (engine/layers/layer_draft.h), which stage tokens in
  // the live layers; the engine keeps every other change away while one is
  // open, and calls NoteChanged when it ends.
  Layer& mutable_layer(size_t index) {
    NoteChanged();
    return *layers_[index];
  }
  // New after every change: a snapshot taken at this cache's layout_id() and
  // current generation holds exactly what the cache holds. A count of the
  // cache's own (under its lock), so an Update touches no shared counter.
  uint64_t generation() const { return generation_; }
  // Unique across all caches and fixed for this one, as its spec is: batch
  // operations that change a cache's rows put a new Cache in its place.
  uint64_t layout_id() const { return layout_id_; }
  void NoteChanged() { ++generation_; }
  std::vector<uint64_t> layer_offsets() const;
  // FAILED_PRECONDITION naming the first layer out of step, else the offset.
  absl::StatusOr<uint64_t> CommonOffset() const;
  uint64_t size_bytes() const;

  // INVALID_ARGUMENT naming keys / values when their sizes do not match L tokens.
  absl::Status Update(uint32_t layer, const KvInput& kv);
  absl::Status UpdateState(uint32_t layer, const StateInput& state);
  absl::StatusOr<uint64_t> Trim(uint64_t n);
  absl::StatusOr<CacheSnapshotPtr> Snapshot(const std::string& cache_id, uint64_t from_offset) const;
  // Every layer as it is now (snapshot from 0), for reading without the lock.
  absl::StatusOr<CacheSnapshotPtr> Freeze(const std::string& cache_id) const;
  // snapshot null: rewind live. All layers or none.
  absl::Status Restore(const CacheSnapshot* snapshot, uint64_t target);
  // Batch operations (engine/batch/batch_ops.h): fills empty layer `layer` from
  // other caches' rows up to `offset` (Layer::AssembleRows).
  absl::Status AssembleRows(size_t layer, absl::Span<const RowSource> rows, uint64_t offset);
  void Free();

 private:
  Cache(CacheSpec spec, std::vector<std::unique_ptr<Layer>> layers);

  CacheSpec spec_;
  std::vector<std::unique_ptr<Layer>> layers_;
  const uint64_t layout_id_;
  uint64_t generation_ = 0;
};

}  // namespace kvcache::engine
