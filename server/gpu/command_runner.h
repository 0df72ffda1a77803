// One command buffer and one fence for synchronous work on the device's queue:
//
//   record (between two barriers) -> vkQueueSubmit under queue_mutex() -> wait fence
//
// The leading barrier orders the commands after everything submitted before
// them (other pools' work included); the trailing one makes their writes
// visible to the host, so a Read may memcpy out once the fence signals.
// Not thread-safe: its owner serializes Run calls.
#pragma once

#include <memory>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "gpu/device.h"

namespace kvcache::gpu {

class CommandRunner {
 public:
  using Recorder = absl::FunctionRef<absl::Status(const vk::raii::CommandBuffer&)>;

  static absl::StatusOr<std::unique_ptr<CommandRunner>> Create(const Device& device);

  // Records with `record`, submits, and returns once the device has finished.
  // Vulkan errors (thrown by vulkan_raii.hpp) come back as a status.
  absl::Status Run(Recorder record);

 private:
  explicit CommandRunner(const Device& device) : device_(device) {}
  absl::Status RecordSubmitAndWait(Recorder record);

  const Device& device_;
  vk::raii::CommandPool command_pool_{nullptr};
  vk::raii::CommandBuffer commands_{nullptr};
  vk::raii::Fence done_{nullptr};
};

}  // namespace kvcache::gpu
