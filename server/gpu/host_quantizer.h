// The Quantizer's path for host-mapped pages on a CPU device (gpu/quantizer.h
// chooses it): each run's rows go through the native kernels
// (gpu/quant_kernels.h) straight between the caller's memory and the page
// planes, with no scratch buffer, submission or fence. Rows of the input that
// straddle two of its pieces are gathered first, one row at a time. Large
// calls are shared out by run among the cores (gpu/host_workers.h).
#pragma once

#include "absl/types/span.h"
#include "gpu/page_allocator.h"
#include "gpu/quant_kernels.h"

namespace kvcache::gpu {

struct QuantizeJob;
struct DequantizeJob;

// The jobs must have passed the Quantizer's checks; pages must be host-mapped.
void QuantizeOnHost(QuantIsa isa, const PageAllocator& pages, absl::Span<const QuantizeJob> jobs);
void DequantizeOnHost(QuantIsa isa, const PageAllocator& pages,
                      absl::Span<const DequantizeJob> jobs);

}  // namespace kvcache::gpu
