// mlx affine quantization of rows into pool pages, and back, on the device
// (shaders/quantize.comp, shaders/dequantize.comp):
//
//   Quantize:    caller's pieces --memcpy--> scratch --quantize.comp--> page planes
//   Dequantize:  page planes --dequantize.comp--> scratch --memcpy--> caller
//
// A run is `rows` consecutive rows of a dense [rows, dim] tensor (rows
// [first_row, first_row + rows)) and where they lie in one page: their packed
// words, scales and biases, each plane holding the rows back to back from its
// own byte offset. Runs of one submission are grouped by slab (one descriptor
// set each) and by job (one pipeline per format): one dispatch per group. Calls
// larger than the scratch buffer go out as several submissions, each waited
// for on a fence. Works on both transfer paths: slabs are storage buffers on
// both. Thread-safe: callers take turns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "gpu/buffer.h"
#include "gpu/command_runner.h"
#include "gpu/page_allocator.h"
#include "gpu/quant_format.h"
#include "gpu/quant_job.h"
#include "gpu/quant_kernels.h"
#include "gpu/quant_pipelines.h"

namespace kvcache::gpu {

struct QuantizerOptions {
  // Shaders or native CPU kernels (PoolOptions::quantize_kernel).
  QuantKernel kernel = QuantKernel::kAuto;
  // The CPU kernels' instruction set (tests pick each one).
  QuantIsa host_isa = BestQuantIsa();
  // Pair neighbouring 16-bit scales through subgroup shuffles where the device
  // has them (quantize.comp); false takes the atomic fallback
  // (quantize_atomic.comp) that devices without them get, so tests cover it.
  bool subgroup_shuffle = true;
};

class Quantizer {
 public:
  // options.kernel kHost needs host-mapped pages (PagePool::Create checks).
  Quantizer(const Device& device, const PageAllocator& pages, QuantizerOptions options = {});
  ~Quantizer();

  // True when calls run the native CPU kernels rather than the shaders.
  bool on_host() const { return on_host_; }

  // Each call has completed on the device when it returns. INVALID_ARGUMENT,
  // naming the job and run, with nothing written, for a bad format, a run
  // outside its page or tensor, or a misaligned plane. The runs of one call
  // must not overlap. On a device error some runs may have been written.
  absl::Status Quantize(absl::Span<const QuantizeJob> jobs);
  absl::Status Dequantize(absl::Span<const DequantizeJob> jobs);

 private:
  struct Batch;

  absl::Status CheckRun(const char* call, size_t job, size_t index, const QuantFormat& format,
                        const QuantRun& run, uint64_t tensor_rows) const;
  // Creates the pipelines, runner and buffers on first use, and grows the
  // scratch buffer towards `wanted_bytes`.
  absl::Status Prepare(uint64_t wanted_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // What Quantize and Dequantize share: checks `jobs`, then runs them through
  // `on_host` (the native kernel) or through the scratch buffer and the
  // `direction` shader, `stage` moving each piece's rows into or out of it.
  template <typename Job, typename HostKernel, typename Stage>
  absl::Status RunJobs(QuantDirection direction, absl::Span<const Job> jobs, HostKernel&& on_host,
                       Stage&& stage);
  // Splits every run of `jobs` into pieces that fit the scratch buffer, calling
  // `stage(batch, job, first_row, rows, scratch_offset)` for each and submitting
  // (through `flush`) whenever the scratch or the run table is full.
  template <typename Job, typename Stage, typename Flush>
  absl::Status Plan(absl::Span<const Job> jobs, Batch& batch, Stage&& stage, Flush&& flush)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  absl::Status Submit(QuantDirection direction, absl::Span<const QuantFormat> formats, Batch& batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void AddRun(Batch& batch, size_t job, const QuantRun& run, uint64_t first_row, uint32_t rows,
              uint64_t scratch_offset, const QuantFormat& format) const;

  const Device& device_;
  const PageAllocator& pages_;
  const QuantizerOptions options_;
  const bool on_host_;
  absl::Mutex mutex_;
  std::unique_ptr<QuantPipelines> pipelines_ ABSL_GUARDED_BY(mutex_);
  std::unique_ptr<CommandRunner> runner_ ABSL_GUARDED_BY(mutex_);
  std::unique_ptr<Buffer> scratch_ ABSL_GUARDED_BY(mutex_);
  std::unique_ptr<Buffer> run_table_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace kvcache::gpu
