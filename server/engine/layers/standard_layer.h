// StandardLayer: mlx-lm KVCache / ollama KVCache. Every token is kept; a
// snapshot [from, to) shares the pages covering that range. With a quantized
// geometry it is mlx-lm QuantizedKVCache: the same semantics (trim, snapshot,
// restore, merge, split, copy-on-write) over pages of packed planes, written
// and read through the device's quantize / dequantize shaders.
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

class StandardSnapshot final : public LayerSnapshot {
 public:
  StandardSnapshot(PageTable table, const PageGeometry& geometry, uint64_t from, uint64_t to)
      : table_(std::move(table)), geometry_(geometry), from_(from), to_(to) {}

  uint64_t from() const override { return from_; }
  uint64_t to() const override { return to_; }
  std::vector<TokenRange> Ranges() const override { return {{from_, to_}}; }
  absl::Status Read(TokenRange range, const KvOutput& out) const override;
  absl::Status Mapped(TokenRange range, KvMappedPieces& out) const override;
  // Quantized geometry only: the range's planes as stored.
  absl::Status ReadPacked(TokenRange range, const PackedOutput& out) const override;
  uint64_t size_bytes() const override;
  const PageTable& held_pages() const override { return table_; }
  const PageGeometry& geometry() const { return geometry_; }
  absl::StatusOr<LayerSnapshotPtr> MergedWith(const LayerSnapshot& child) const override;
  absl::StatusOr<std::pair<LayerSnapshotPtr, LayerSnapshotPtr>> SplitAt(
      uint64_t at) const override;
  const PageTable& table() const { return table_; }

 private:
  PageTable table_;
  PageGeometry geometry_;
  uint64_t from_;
  uint64_t to_;
};

class StandardLayer final : public Layer, public StagedAppend {
 public:
  StandardLayer(gpu::PagePool& pool, const PageGeometry& geometry)
      : table_(&pool), geometry_(geometry) {}

  uint64_t offset() const override { return offset_; }
  absl::Status Update(const KvInput& kv) override;
  std::vector<TokenRange> Ranges() const override;
  absl::Status Read(TokenRange range, const KvOutput& out) const override;
  absl::Status CheckTrimmable() const override { return absl::OkStatus(); }
  uint64_t TrimmableTokens() const override { return offset_; }
  uint64_t Trim(uint64_t n) override;
  absl::StatusOr<LayerSnapshotPtr> Snapshot(uint64_t from_offset) const override;
  absl::StatusOr<std::unique_ptr<Layer>> Restored(const LayerSnapshot* snapshot,
                                                  uint64_t target) const override;
  // Positions [0, offset): each row's source tokens shifted, zeros elsewhere.
  absl::Status AssembleRows(absl::Span<const RowSource> rows, uint64_t offset) override;
  // Tokens [0, offset) from `held`, or as stored from `packed` (quantized).
  absl::Status Load(const LayerContents& contents) override;
  void Free() override;
  uint64_t size_bytes() const override;

  // Speculation: staged tokens are written in place past the offset; commit
  // moves the offset (ollama speculativeKVCache).
  absl::Status Stage(uint64_t staged, const KvInput& kv) override;
  LayerSnapshotPtr FreezeStaged(uint64_t staged) const override;
  void Adopt(uint64_t tokens) override { offset_ += tokens; }
  void DropStaged() override;
  StagedAppend* staged_append() override { return this; }

 private:
  StandardLayer(PageTable table, const PageGeometry& geometry, uint64_t offset)
      : table_(std::move(table)), geometry_(geometry), offset_(offset) {}

  PageTable table_;
  PageGeometry geometry_;
  uint64_t offset_ = 0;
  // token_store.h: appending past a snapshot copies nothing. Mutable: taking
  // a snapshot may claim the right, under the cache's lock like every call.
  mutable InPlaceWrites writes_;
};

}  // namespace kvcache::engine
