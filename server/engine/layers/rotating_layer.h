// RotatingLayer: mlx-lm RotatingKVCache (max_size, keep) with ollama's restore
// rules. What it holds is always the attention sinks plus a recent window:
//
//   positions  0 .. keep-1 | evicted ........... | window_begin .. offset-1
//              [  sinks   ]                        [ the recent tokens      ]
//
// Tokens sit in pages by absolute position like a standard layer's; evicting
// the oldest non-sink token only advances window_begin, and a page is released
// once every position it covers is evicted. So a decode step costs O(1) at any
// window size, and a snapshot shares the same pages as everything else.
// ring_idx mirrors mlx-lm's `_idx` (the write slot in its ring buffer, which
// returns to `keep` on wrap) so its meta_state can be reported exactly.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "engine/layers/cache_spec.h"
#include "engine/layers/layer.h"
#include "engine/layers/page_table.h"
#include "engine/layers/staged_append.h"
#include "engine/layers/token_store.h"

namespace kvcache::engine {

// The bookkeeping of a rotating layer, shared by the layer and its snapshots.
struct RotatingState {
  uint64_t offset = 0;
  uint64_t window_start = 0;  // first held non-sink position (see window_begin())
  uint64_t ring_idx = 0;      // mlx-lm `_idx`

  uint64_t sink_end(uint32_t keep) const { return std::min<uint64_t>(keep, offset); }
  uint64_t window_begin(uint32_t keep) const { return std::max(window_start, sink_end(keep)); }
  uint64_t held(uint32_t keep) const { return sink_end(keep) + offset - window_begin(keep); }
  std::vector<TokenRange> Ranges(uint32_t keep) const;
};

class RotatingSnapshot final : public LayerSnapshot {
 public:
  RotatingSnapshot(PageTable table, const PageGeometry& geometry, RotatingKind kind,
                   RotatingState state, uint64_t from)
      : table_(std::move(table)), geometry_(geometry), kind_(kind), state_(state), from_(from) {}

  uint64_t from() const override { return from_; }
  uint64_t to() const override { return state_.offset; }
  std::vector<TokenRange> Ranges() const override { return state_.Ranges(kind_.keep); }
  absl::Status Read(TokenRange range, const KvOutput& out) const override;
  absl::Status Mapped(TokenRange range, KvMappedPieces& out) const override;
  uint64_t size_bytes() const override;
  const PageTable& held_pages() const override { return table_; }
  absl::StatusOr<LayerSnapshotPtr> MergedWith(const LayerSnapshot& child) const override;
  bool ChildSupersedes() const override { return true; }
  absl::StatusOr<std::pair<LayerSnapshotPtr, LayerSnapshotPtr>> SplitAt(
      uint64_t at) const override;
  const PageTable& table() const { return table_; }
  const RotatingState& state() const { return state_; }
  const PageGeometry& geometry() const { return geometry_; }
  const RotatingKind& kind() const { return kind_; }

 private:
  PageTable table_;
  PageGeometry geometry_;
  RotatingKind kind_;
  RotatingState state_;
  uint64_t from_;
};

class RotatingLayer final : public Layer, public StagedAppend {
 public:
  RotatingLayer(gpu::PagePool& pool, const PageGeometry& geometry, RotatingKind kind)
      : table_(&pool), geometry_(geometry), kind_(kind) {}

  uint64_t offset() const override { return state_.offset; }
  const RotatingState& state() const { return state_; }
  absl::Status Update(const KvInput& kv) override;
  std::vector<TokenRange> Ranges() const override { return state_.Ranges(kind_.keep); }
  absl::Status Read(TokenRange range, const KvOutput& out) const override;
  // mlx-lm: only until the window fills (nothing evicted or overwritten yet).
  absl::Status CheckTrimmable() const override;
  uint64_t TrimmableTokens() const override { return state_.offset; }
  uint64_t Trim(uint64_t n) override;
  absl::StatusOr<LayerSnapshotPtr> Snapshot(uint64_t from_offset) const override;
  absl::StatusOr<std::unique_ptr<Layer>> Restored(const LayerSnapshot* snapshot,
                                                  uint64_t target) const override;
  // Every row's window right-aligned at `offset` (see AssembledState).
  absl::Status AssembleRows(absl::Span<const RowSource> rows, uint64_t offset) override;
  // The sinks and the window from `held` (its L tokens: min(keep, offset)
  // sinks, then the most recent ones) and mlx-lm's `_idx` as ring_idx.
  absl::Status Load(const LayerContents& contents) override;
  void Free() override;
  uint64_t size_bytes() const override;

  // Speculation: staged tokens sit past the offset, where no held position is
  // (the window is never overwritten); Adopt evicts what they push out, as the
  // one Update of them would (ollama speculativeRotatingKVCache.commit).
  absl::Status Stage(uint64_t staged, const KvInput& kv) override;
  LayerSnapshotPtr FreezeStaged(uint64_t staged) const override;
  void Adopt(uint64_t tokens) override;
  void DropStaged() override;
  StagedAppend* staged_append() override { return this; }

 private:
  RotatingLayer(PageTable table, const PageGeometry& geometry, RotatingKind kind,
                RotatingState state)
      : table_(std::move(table)), geometry_(geometry), kind_(kind), state_(state) {}
  // How many of the oldest non-sink tokens an update of `tokens` evicts, and
  // where mlx-lm's write index ends up.
  std::pair<uint64_t, uint64_t> PlanEviction(uint64_t tokens) const;
  // The state an update of `tokens` leaves (its pages aside).
  RotatingState Appended(uint64_t tokens) const;
  // Releases the pages holding only positions evicted on the way to `next`.
  void ReleaseEvicted(const RotatingState& next);
  std::unique_ptr<Layer> TrimmedCopy(const PageTable& table, RotatingState state,
                                     uint64_t target) const;
  // The sources of AssembleRows (null for an all-padding row), checked.
  absl::StatusOr<std::vector<const RotatingSnapshot*>> AssemblySources(
      absl::Span<const RowSource> rows) const;
  RotatingState AssembledState(absl::Span<const RowSource> rows,
                               const std::vector<const RotatingSnapshot*>& sources,
                               uint64_t offset) const;

  PageTable table_;
  PageGeometry geometry_;
  RotatingKind kind_;
  RotatingState state_;
  // token_store.h: appending past a snapshot copies nothing. Mutable: taking
  // a snapshot may claim the right, under the cache's lock like every call.
  mutable InPlaceWrites writes_;
};

}  // namespace kvcache::engine
