// The quantized side of token_store (mlx-lm QuantizedKVCache): a quantized
// layer's pages hold, per side (K, V), three planes (packed words, scales,
// biases; see PageGeometry), and its tokens move through the device's
// quantize / dequantize shaders (gpu/quantizer.h):
//
//   [B, H, L, D] dtype  --Quantize-->  K wq | K scales | K biases | V wq | ...
//                       <-Dequantize-
//   PackedOutput        <--Read------  (the planes as stored: mlx's packed form)
//
// Tokens [s0, s1) of one (row, head) within one page are one run of rows in
// each plane, as in the [B, H, L, D] tensor: a transfer is B*H runs per page.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/layers/cache_spec.h"
#include "engine/layers/layer.h"
#include "engine/layers/page_table.h"
#include "gpu/quant_job.h"

namespace kvcache::engine {

// The format of one side's rows: `values` false for K, true for V.
gpu::QuantFormat SideFormat(const PageGeometry& g, bool values);

// Quantizes kv's tokens into positions [offset, offset + L): `targets` holds
// the page of each page index the range touches, in order (already exclusive
// to the caller). On error some target slots may hold new bytes; none other.
absl::Status QuantizeTokens(gpu::PagePool& pool, const PageGeometry& g, uint64_t offset,
                            const KvInput& kv, const std::vector<gpu::PageId>& targets);

// Dequantizes positions `range` (every page present) into `out` as [B, H, L, D].
absl::Status DequantizeTokens(const PageTable& table, const PageGeometry& g, TokenRange range,
                              const KvOutput& out);

// Copies positions `range` out as stored: per side wq [B, H, L, D*bits/32]
// uint32, scales and biases [B, H, L, D/group_size] in the dtype.
// INVALID_ARGUMENT naming the buffer unless each has exactly that size.
absl::Status ReadPackedTokens(const PageTable& table, const PageGeometry& g, TokenRange range,
                              const PackedOutput& out);

// Writes `tokens` tokens' packed planes, exactly as given (no requantizing),
// at positions [0, tokens) of the empty `table`, into fresh pages.
// INVALID_ARGUMENT naming the buffer unless each has the size ReadPackedTokens
// would fill. On error the table may hold pages; the caller drops it.
absl::Status WritePackedTokens(PageTable& table, const PageGeometry& g, uint64_t tokens,
                               const PackedInput& in);

}  // namespace kvcache::engine
