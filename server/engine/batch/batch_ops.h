// The batch operations of mlx-lm's BatchKVCache / BatchRotatingKVCache on whole
// caches. All rows of a cache share one position axis (the layers' common
// offset, mlx-lm's `_idx`); row r holds its own tokens at [left_padding[r],
// offset) and padding before, so its mlx-lm `offset` (its RoPE position) is
// offset - left_padding[r]:
//
//   row 0   pad pad  a0  a1  a2  a3      left_padding {2, 0}, offset 6
//   row 1    b0  b1  b2  b3  b4  b5
//
//   extract(r)   a one-row cache of row r's positions [left_padding[r], offset),
//                moved to start at 0.
//   filter(rows) keeps those rows (in that order, repeats allowed), then drops
//                the d = min(their padding) positions all of them pad (d capped
//                at the offset, so every row keeps offset - left_padding).
//   extend(o)    right-aligns both caches at m = max(offsets): each row moves by
//                m - its cache's offset, its padding grows by as much (zeros in
//                front); this cache's rows, then o's.
//   merge(cs)    a new batch of every row of every cache, in order: row i's own
//                tokens right-aligned at the longest row's length (its padding
//                max_length - length, zeros).
//
// Padding contents travel with their row where mlx-lm slices or pads the
// buffer (filter, extend) and are zeros where it builds a new one (merge).
// Rotating layers hold each row's window right-aligned at the new offset
// (RotatingLayer::AssembleRows); mlx-lm's BatchRotatingKVCache rebases its
// positions where this keeps every row's positions absolute, so a row's own
// tokens come back in the same temporal order with the same bytes, at
// positions that may differ from mlx-lm's. Rotating layers that keep sinks
// (keep > 0) cannot take padding: such batches need rows of equal lengths.
//
// Each operation plans the new cache (Plan*) and then builds it completely
// (AssembleBatch) from frozen snapshots of its sources, so a failure changes
// nothing; the engine swaps the result in (filter, extend) or registers it
// (extract, merge).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/layers/cache.h"
#include "engine/layers/cache_spec.h"
#include "gpu/page_pool.h"

namespace kvcache::engine {

// One row of a batch being built: row `row` of `source` (a frozen snapshot of
// a cache whose layers are in step), moved by `shift` (see RowSource).
struct BatchRow {
  const CacheSnapshot* source = nullptr;
  uint32_t row = 0;
  int64_t shift = 0;
  uint64_t padding = 0;  // the row's left padding in its source
  bool copy_padding = true;
};

struct BatchPlan {
  std::string field;  // the request field that refusals of the result name
  CacheSpec spec;     // the new cache's: batch_size and left_padding set
  uint64_t offset = 0;
  std::vector<BatchRow> rows;
};

// INVALID_ARGUMENT naming `row` when out of range.
absl::StatusOr<BatchPlan> PlanExtractRow(const CacheSnapshot& frozen, uint32_t row);
// INVALID_ARGUMENT naming keep_rows when empty or naming the entry out of range.
absl::StatusOr<BatchPlan> PlanFilterRows(const CacheSnapshot& frozen,
                                         absl::Span<const uint32_t> keep_rows);
// INVALID_ARGUMENT naming other_id when the layouts (apart from batch size) differ.
absl::StatusOr<BatchPlan> PlanExtend(const CacheSnapshot& frozen, const CacheSnapshot& other);
// INVALID_ARGUMENT naming cache_ids (empty) or cache_ids[i] (layout differs from
// cache_ids[0]). A snapshot may appear more than once: its rows repeat.
absl::StatusOr<BatchPlan> PlanMerge(absl::Span<const CacheSnapshot* const> frozen_caches);

// The planned cache, every layer assembled. FAILED_PRECONDITION when padding
// would land in a rotating layer that keeps sinks; INVALID_ARGUMENT naming
// plan.field when the result exceeds `limits` or a token of the new batch
// does not fit a page. Nothing is left allocated on failure.
absl::StatusOr<std::unique_ptr<Cache>> AssembleBatch(const BatchPlan& plan, gpu::PagePool& pool,
                                                     uint32_t page_tokens,
                                                     const SpecLimits& limits);

}  // namespace kvcache::engine
