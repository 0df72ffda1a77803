// RecurrentLayer: ollama RecurrentCache / mlx-lm ArraysCache of two arrays, as
// linear-recurrent layers (Qwen3-Next's gated delta net, Mamba) use it. It holds
// no tokens: a conv state [B, conv_tail, conv_dim] and a delta state
// [B, num_v_heads, head_v_dim, head_k_dim] in the cache dtype, which each
// UpdateState replaces whole, advancing the offset by the tokens it consumed.
//
// The state lives in pool pages as one byte stream, conv then delta, spanning
// as many pages as it needs:
//
//   stream  [ conv: B*conv_tail*conv_dim | delta: B*Hv*Dv*Dk ]  (elements of the dtype)
//   pages   [ page 0 ][ page 1 ] ... [ page n-1 (partly used) ]
//
// An update writes the new state into fresh pages and drops its references to
// the old ones, so a snapshot only shares the pages it saw (swapped, never
// copied): Snapshot, Restore and Merge cost no page and no byte.
//
// The rules (ollama RecurrentCache; tests/engine/reference_recurrent.h has the
// same ones, written independently):
//
//   no state yet     before the first update the layer holds no pages and its
//                    state reads as zeros (ollama ensure()). Its offset moves
//                    only with a state, so a whole-cache snapshot (which needs
//                    offset > from >= 0) always finds one.
//   Snapshot(from)   the whole state with its offset; `from` is only recorded
//                    (a state cannot be cut at a position).
//   live rewind      only to the current offset (the state holds every token).
//   Restore(S, t)    only to t == S.to: below, the state would hold tokens
//                    past t; above, it would lack the tokens up to t (ollama
//                    accepts t > S.to and lands at S.to, but every layer must
//                    end at t).
//   Merge(P, C)      C (self-contained; it supersedes P).
//   Split(S, at)     (none, S): no state exists at `at`.
//   Trim             never (mlx-lm ArraysCache is not trimmable).
//
// Keys and values, for writing or reading, are INVALID_ARGUMENT.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/layers/cache_spec.h"
#include "engine/layers/layer.h"
#include "engine/layers/page_table.h"

namespace kvcache::engine {

// The sizes of one layer's state and the pages it takes.
struct StateGeometry {
  RecurrentKind kind;
  uint32_t batch = 1;
  uint32_t elem_bytes = 2;
  uint64_t page_bytes = 0;

  uint64_t conv_bytes() const;
  uint64_t delta_bytes() const;
  uint64_t pages() const;  // pages the whole state takes
};

class RecurrentSnapshot final : public LayerSnapshot {
 public:
  // `pages` empty: no state yet (reads as zeros).
  RecurrentSnapshot(PageTable pages, const StateGeometry& geometry, uint64_t from, uint64_t to)
      : pages_(std::move(pages)), geometry_(geometry), from_(from), to_(to) {}

  uint64_t from() const override { return from_; }
  uint64_t to() const override { return to_; }
  std::vector<TokenRange> Ranges() const override { return {}; }
  absl::Status Read(TokenRange range, const KvOutput& out) const override;
  absl::Status ReadState(const StateOutput& out) const override;
  uint64_t size_bytes() const override;
  const PageTable& held_pages() const override { return pages_; }
  absl::StatusOr<LayerSnapshotPtr> MergedWith(const LayerSnapshot& child) const override;
  bool ChildSupersedes() const override { return true; }
  absl::StatusOr<std::pair<LayerSnapshotPtr, LayerSnapshotPtr>> SplitAt(uint64_t at) const override;
  const PageTable& pages() const { return pages_; }
  const StateGeometry& geometry() const { return geometry_; }

 private:
  PageTable pages_;
  StateGeometry geometry_;
  uint64_t from_;
  uint64_t to_;
};

class RecurrentLayer final : public Layer {
 public:
  // `index` is the layer's place in its cache, for messages.
  RecurrentLayer(gpu::PagePool& pool, const StateGeometry& geometry, uint32_t index)
      : pages_(&pool), geometry_(geometry), index_(index) {}

  uint64_t offset() const override { return offset_; }
  bool has_state() const { return pages_.CountPages() > 0; }
  absl::Status Update(const KvInput& kv) override;
  absl::Status UpdateState(const StateInput& state) override;
  std::vector<TokenRange> Ranges() const override { return {}; }
  absl::Status Read(TokenRange range, const KvOutput& out) const override;
  absl::Status CheckTrimmable() const override;
  uint64_t TrimmableTokens() const override { return 0; }
  uint64_t Trim(uint64_t /*n*/) override { return 0; }
  absl::StatusOr<LayerSnapshotPtr> Snapshot(uint64_t from_offset) const override;
  absl::StatusOr<std::unique_ptr<Layer>> Restored(const LayerSnapshot* snapshot,
                                                  uint64_t target) const override;
  // Each row's conv and delta state rows from its source row (layer_rows.cc).
  absl::Status AssembleRows(absl::Span<const RowSource> rows, uint64_t offset) override;
  // `state` as of `offset` (a state that stands for that many tokens).
  absl::Status Load(const LayerContents& contents) override;
  void Free() override;
  uint64_t size_bytes() const override;
  // Speculation's commit: takes `snapshot`'s state (of a copy of this layer,
  // advanced by drafted states) and its offset; shares its pages.
  void AdoptState(const RecurrentSnapshot& snapshot);
  // A copy of the layer takes the drafted states (recurrent_draft.cc).
  absl::StatusOr<std::unique_ptr<LayerDraft>> MakeDraft(bool isolated) override;

 private:
  RecurrentLayer(PageTable pages, const StateGeometry& geometry, uint32_t index, uint64_t offset)
      : pages_(std::move(pages)), geometry_(geometry), index_(index), offset_(offset) {}
  absl::Status CheckState(const StateInput& state) const;

  PageTable pages_;
  StateGeometry geometry_;
  uint32_t index_;
  uint64_t offset_ = 0;
};

}  // namespace kvcache::engine
