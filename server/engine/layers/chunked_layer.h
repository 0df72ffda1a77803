// ChunkedLayer: mlx-lm ChunkedKVCache (chunk_size, start_position), as llama4's
// chunked-attention layers use it. Before each update the front is trimmed to
// the last chunk_size tokens (mlx-lm maybe_trim_front, which the model calls at
// the start of every forward), then the new tokens are appended:
//
//   positions  0 ........ start_position-1 | start_position ...... offset-1
//              [ trimmed away, pages gone ] [ held: the current chunk     ]
//
//   before an update of L: held = offset - start; if held >= chunk_size,
//   start += held - chunk_size; then offset += L (so up to chunk_size + L held).
//
// Tokens sit in pages by absolute position, as in a standard layer; a page is
// released once every position it covers is below start_position. The rules
// (the CPU reference, tests/engine/reference_chunked.h, implements the same
// ones independently):
//
//   Trim(n)         n = min(offset - start, n); offset -= n (mlx-lm trim).
//   Snapshot(from)  start position s and tokens [max(from, s), offset).
//   live rewind     start <= target <= offset; start is kept.
//   Restore(S, t)   S = (from f, start s, to e). The state as at e, then trimmed
//                   to t: needs s <= t <= e. If s >= f, S holds all of its chunk
//                   and stands alone; else the live layer must still hold the
//                   tokens [s, f) below S's first held token (live start <= s,
//                   live offset >= f). The result's start position is s.
//   Merge(P, C)     adjacent (P.to == C.from); the result is C's state over
//                   [P.from, C.to): start C.start, tokens from max(P.from,
//                   C.start), the ones below C.from taken from P, which must
//                   hold them.
//   Split(S, at)    child: [at, e), start s. Parent: S trimmed to at, which
//                   exists only when s <= at (else null: that state's front was
//                   trimmed away later).
//
// Every refusal is FAILED_PRECONDITION with the reason.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/layers/cache_spec.h"
#include "engine/layers/layer.h"
#include "engine/layers/page_table.h"
#include "engine/layers/staged_append.h"
#include "engine/layers/token_store.h"

namespace kvcache::engine {

// The bookkeeping shared by the layer and its snapshots.
struct ChunkedState {
  uint64_t offset = 0;
  uint64_t start = 0;  // mlx-lm start_position

  uint64_t held() const { return offset - start; }
};

class ChunkedSnapshot final : public LayerSnapshot {
 public:
  // `table` holds the pages of [held_begin(), to).
  ChunkedSnapshot(PageTable table, const PageGeometry& geometry, ChunkedState state, uint64_t from)
      : table_(std::move(table)), geometry_(geometry), state_(state), from_(from) {}

  uint64_t from() const override { return from_; }
  uint64_t to() const override { return state_.offset; }
  uint64_t start_position() const { return state_.start; }
  // The first position held: max(from, start_position).
  uint64_t held_begin() const { return std::max(from_, state_.start); }
  std::vector<TokenRange> Ranges() const override;
  absl::Status Read(TokenRange range, const KvOutput& out) const override;
  absl::Status Mapped(TokenRange range, KvMappedPieces& out) const override;
  uint64_t size_bytes() const override;
  const PageTable& held_pages() const override { return table_; }
  absl::StatusOr<LayerSnapshotPtr> MergedWith(const LayerSnapshot& child) const override;
  absl::StatusOr<std::pair<LayerSnapshotPtr, LayerSnapshotPtr>> SplitAt(uint64_t at) const override;
  const PageTable& table() const { return table_; }
  const ChunkedState& state() const { return state_; }
  const PageGeometry& geometry() const { return geometry_; }

 private:
  PageTable table_;
  PageGeometry geometry_;
  ChunkedState state_;
  uint64_t from_;
};

class ChunkedLayer final : public Layer, public StagedAppend {
 public:
  ChunkedLayer(gpu::PagePool& pool, const PageGeometry& geometry, ChunkedKind kind)
      : table_(&pool), geometry_(geometry), kind_(kind) {}

  uint64_t offset() const override { return state_.offset; }
  absl::Status Update(const KvInput& kv) override;
  std::vector<TokenRange> Ranges() const override;
  absl::Status Read(TokenRange range, const KvOutput& out) const override;
  absl::Status CheckTrimmable() const override { return absl::OkStatus(); }
  // mlx-lm trim: only what it holds above its start position.
  uint64_t TrimmableTokens() const override { return state_.held(); }
  uint64_t Trim(uint64_t n) override;
  absl::StatusOr<LayerSnapshotPtr> Snapshot(uint64_t from_offset) const override;
  absl::StatusOr<std::unique_ptr<Layer>> Restored(const LayerSnapshot* snapshot,
                                                  uint64_t target) const override;
  // Rows right-aligned at `offset`, the start position shared (layer_rows.cc).
  absl::Status AssembleRows(absl::Span<const RowSource> rows, uint64_t offset) override;
  // Tokens [start_position, offset) from `held`.
  absl::Status Load(const LayerContents& contents) override;
  void Free() override;
  uint64_t size_bytes() const override;

  // Speculation: staged tokens are written past the offset; the front is
  // trimmed only when they are adopted (the update they make up).
  absl::Status Stage(uint64_t staged, const KvInput& kv) override;
  LayerSnapshotPtr FreezeStaged(uint64_t staged) const override;
  void Adopt(uint64_t tokens) override;
  void DropStaged() override;
  StagedAppend* staged_append() override { return this; }

 private:
  ChunkedLayer(PageTable table, const PageGeometry& geometry, ChunkedKind kind, ChunkedState state)
      : table_(std::move(table)), geometry_(geometry), kind_(kind), state_(state) {}
  // mlx-lm maybe_trim_front, releasing the pages it empties.
  void TrimFront();
  // The start position TrimFront would leave.
  uint64_t TrimmedStart() const;
  // A layer holding `table`'s pages of [start, target) with that state.
  std::unique_ptr<Layer> Make(const PageTable& table, ChunkedState state, uint64_t target) const;
  absl::StatusOr<std::unique_ptr<Layer>> RestoredFrom(const ChunkedSnapshot& snap,
                                                      uint64_t target) const;
  // `layer` (a ChunkedLayer) remembering it was restored from `snap`.
  static std::unique_ptr<Layer> RestoredLayer(const ChunkedSnapshot& snap,
                                              std::unique_ptr<Layer> layer);

  PageTable table_;
  PageGeometry geometry_;
  ChunkedKind kind_;
  ChunkedState state_;
  // token_store.h: appending past a snapshot copies nothing. Mutable: taking
  // a snapshot may claim the right, under the cache's lock like every call.
  mutable InPlaceWrites writes_;
  // The first staged token went into a page the layer did not hold (an empty
  // chunk's, e.g. in a cache assembled from rows): DropStaged releases it.
  // Adopt clears it, as the page then holds the layer's tokens.
  bool staged_into_new_page_ = false;
};

}  // namespace kvcache::engine
