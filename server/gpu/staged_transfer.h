// Moving bytes between host memory and device-local buffers that the host
// cannot map (discrete GPUs, or DeviceOptions::force_staging):
//
//   Write:  host --memcpy--> staging ring --copy engine--> device buffer
//   Read:   device buffer --copy engine--> staging ring --memcpy--> host
//   Copy:   device buffer --copy engine--> device buffer
//
// A batch larger than the ring (or than CopyPipeline::kMaxCopies pieces) goes
// out as several submissions, each waited for on its fence before the ring is
// refilled. Thread-safe: concurrent callers take turns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "gpu/buffer.h"
#include "gpu/command_runner.h"
#include "gpu/copy_pipeline.h"
#include "gpu/device.h"
#include "gpu/staging.h"

namespace kvcache::gpu {

struct HostToDevice {
  const std::byte* src;
  BufferSlice dst;
};

struct DeviceToHost {
  BufferSlice src;
  std::byte* dst;
};

class StagedTransfer {
 public:
  // Large enough that a 16 MiB batch is one submission, small enough to keep
  // per-pool host memory modest. Never larger than the pool it serves.
  static constexpr uint64_t kStagingRingBytes = 32 << 20;

  static absl::StatusOr<std::unique_ptr<StagedTransfer>> Create(const Device& device,
                                                                CopyEngine engine,
                                                                uint64_t ring_bytes);

  // Each call has completed on the device when it returns. Ranges within one
  // call must not overlap (the copies of one submission run in any order).
  absl::Status Write(absl::Span<const HostToDevice> writes);
  absl::Status Read(absl::Span<const DeviceToHost> reads);
  absl::Status Copy(absl::Span<const BufferCopy> copies);

 private:
  // Bytes waiting in the ring for a Read's submission to finish.
  struct PendingRead {
    uint64_t ring_offset;
    std::byte* dst;
    uint64_t bytes;
  };

  StagedTransfer(CopyEngine engine, std::unique_ptr<StagingRing> ring,
                 std::unique_ptr<CommandRunner> runner, std::unique_ptr<CopyPipeline> pipeline);
  // Ring space for up to `bytes` bytes of a device range starting at
  // `device_offset`, submitting what is pending first when full.
  absl::StatusOr<StagingRing::Slice> Reserve(uint64_t device_offset, uint64_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Submits the pending copies, waits, delivers pending reads, empties the ring.
  absl::Status Flush() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Records `copies` through `pipeline` (kComputeShader) or as copy regions.
  absl::Status RecordPending(const vk::raii::CommandBuffer& commands, CopyPipeline* pipeline,
                             absl::Span<const BufferCopy> copies) const;

  const CopyEngine engine_;
  absl::Mutex mutex_;
  std::unique_ptr<StagingRing> ring_ ABSL_GUARDED_BY(mutex_);
  std::unique_ptr<CommandRunner> runner_ ABSL_GUARDED_BY(mutex_);
  std::unique_ptr<CopyPipeline> pipeline_ ABSL_GUARDED_BY(mutex_);  // kComputeShader only
  std::vector<BufferCopy> pending_copies_ ABSL_GUARDED_BY(mutex_);
  std::vector<PendingRead> pending_reads_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace kvcache::gpu
