// Moving bytes between host memory and device-local buffers that the host
// cannot map (discrete GPUs, or DeviceOptions::force_staging):
//
//   Write:  host --memcpy--> staging ring --copy engine--> device buffer
//   Read:   device buffer --copy engine--> staging ring --memcpy--> host
//   Copy:   device buffer --copy engine--> device buffer
//
// The work goes through one of a few lanes, each with its own ring, command
// buffer and fence: a call takes a lane no other call holds where there is
// one, so that concurrent calls (the service's Fetch streams) overlap their
// waits on the device instead of queueing behind one ring. Only the queue
// submission itself is serialised (the device's queue mutex). A batch larger
// than its lane's ring (or than CopyPipeline::kMaxCopies pieces) goes out as
// several submissions, each waited for on its fence before the ring is
// refilled. Thread-safe.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu/buffer.h"
#include "gpu/copy_pipeline.h"
#include "gpu/device.h"

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
  // All lanes' rings together: large enough that an 8 MiB batch is one
  // submission, small enough to keep per-pool host memory modest. Never
  // larger than the pool it serves.
  static constexpr uint64_t kStagingRingBytes = 32 << 20;
  // As many lanes as the ring bytes give at least kMinLaneBytes each, up to
  // kMaxLanes (a small pool has one).
  static constexpr size_t kMaxLanes = 4;
  static constexpr uint64_t kMinLaneBytes = 8 << 20;

  static absl::StatusOr<std::unique_ptr<StagedTransfer>> Create(const Device& device,
                                                                CopyEngine engine,
                                                                uint64_t ring_bytes);
  ~StagedTransfer();

  // Each call has completed on the device when it returns. Ranges within one
  // call must not overlap (the copies of one submission run in any order);
  // calls that run at once must not touch the same bytes.
  absl::Status Write(absl::Span<const HostToDevice> writes);
  absl::Status Read(absl::Span<const DeviceToHost> reads);
  absl::Status Copy(absl::Span<const BufferCopy> copies);

 private:
  class Lane;
  class Claim;

  explicit StagedTransfer(std::vector<std::unique_ptr<Lane>> lanes);

  std::vector<std::unique_ptr<Lane>> lanes_;
  std::atomic<size_t> turn_{0};  // the lane a call waits for when all are held
};

}  // namespace kvcache::gpu
