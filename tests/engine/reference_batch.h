// The CPU reference of the batch operations: a port of mlx-lm's BatchKVCache
// extract / filter / extend / merge (and BatchRotatingKVCache's) over the
// reference model's token lists, written from mlx-lm's algorithms and the
// contract in engine/batch/batch_ops.h, not from the engine's code:
//
//   extract(r)   mlx: keys[r:r+1, :, padding:_idx]         -> row r's tokens from its padding on
//   filter(rows) mlx: keys[rows]; then keys[..., d:, :]    -> d = min padding of the kept rows
//   extend(o)    mlx: mx.pad(keys, (left, 0)) per cache    -> left = max(_idx) - cache._idx
//   merge(cs)    mlx: zeros(B, H, max_length, D), row i's tokens at [padding_i, max_length)
//
// Positions are absolute as everywhere in the reference. For rotating layers the
// lists are the temporal order (sinks, then the window); every row's list is
// right-aligned at the new offset, and the new window is as long as the
// longest, but never longer than that of a row that has lost tokens of its own
// to the ring (its window starts after its padding): zeros must not stand where
// a row's own tokens were.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "reference_model.h"

namespace kvcache::testing {

// What the engine must answer: a status code and, when OK, the resulting cache.
struct RefBatchResult {
  absl::StatusCode code = absl::StatusCode::kOk;
  std::unique_ptr<RefCache> cache;
};

// Refusals: FAILED_PRECONDITION when a cache is out of step or padding would
// land in a rotating layer that keeps sinks; INVALID_ARGUMENT for a bad row,
// an empty or out-of-range keep_rows, no caches, or layouts that differ apart
// from batch size.
RefBatchResult RefExtractRow(const RefCache& cache, uint32_t row);
RefBatchResult RefFilterRows(const RefCache& cache, const std::vector<uint32_t>& keep_rows);
RefBatchResult RefExtend(const RefCache& cache, const RefCache& other);
RefBatchResult RefMerge(const std::vector<const RefCache*>& caches);

// One row's bytes of a token: K [H, Dk] and V [H, Dv] (quantized layers: H
// packed rows per side, see reference_quantized.h).
struct RefRowBytes {
  std::vector<std::byte> keys;
  std::vector<std::byte> values;
};
RefRowBytes RowOf(const RefShape& shape, const RefToken& token, uint32_t row);
// A token of rows.size() rows at `position`.
RefToken StackRows(const std::vector<RefRowBytes>& rows, uint64_t position);

}  // namespace kvcache::testing
