// What a quantize or dequantize call asks of the pool (PagePool::Quantize,
// gpu/quantizer.h): plain structs, apart from the quantizer so that the
// engine names them without the quantizer's Vulkan headers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/types/span.h"
#include "gpu/page_id.h"
#include "gpu/quant_format.h"

namespace kvcache::gpu {

struct QuantRun {
  PageId page;
  uint64_t wq_offset;      // in the page; the slab offset must be 4-byte aligned
  uint64_t scales_offset;  // in the page; aligned to the dtype's size
  uint64_t biases_offset;  // likewise
  uint64_t first_row;      // in the job's tensor
  uint32_t rows;
};

// The input tensor comes in pieces that read as their concatenation.
struct QuantizeJob {
  QuantFormat format;
  absl::Span<const absl::Span<const std::byte>> input;
  absl::Span<const QuantRun> runs;
};

struct DequantizeJob {
  QuantFormat format;
  absl::Span<const QuantRun> runs;
  absl::Span<std::byte> output;
};

}  // namespace kvcache::gpu
