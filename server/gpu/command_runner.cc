#include "gpu/command_runner.h"

#include <cstdint>
#include <limits>

#include "core/status_macros.h"

namespace kvcache::gpu {
namespace {

constexpr vk::PipelineStageFlags kCopyStages =
    vk::PipelineStageFlagBits::eTransfer | vk::PipelineStageFlagBits::eComputeShader;
constexpr vk::AccessFlags kCopyWrites =
    vk::AccessFlagBits::eTransferWrite | vk::AccessFlagBits::eShaderWrite;
constexpr vk::AccessFlags kCopyAccesses =
    kCopyWrites | vk::AccessFlagBits::eTransferRead | vk::AccessFlagBits::eShaderRead;

}  // namespace

absl::StatusOr<std::unique_ptr<CommandRunner>> CommandRunner::Create(const Device& device) {
  auto runner = std::unique_ptr<CommandRunner>(new CommandRunner(device));
  RETURN_IF_ERROR(VkTry("create a command buffer", [&]() -> absl::Status {
    const vk::raii::Device& vk_device = device.device();
    runner->command_pool_ = vk::raii::CommandPool(
        vk_device, vk::CommandPoolCreateInfo(vk::CommandPoolCreateFlagBits::eResetCommandBuffer,
                                             device.queue_family()));
    vk::raii::CommandBuffers buffers(
        vk_device,
        vk::CommandBufferAllocateInfo(*runner->command_pool_, vk::CommandBufferLevel::ePrimary, 1));
    runner->commands_ = std::move(buffers.front());
    runner->done_ = vk::raii::Fence(vk_device, vk::FenceCreateInfo());
    return absl::OkStatus();
  }));
  return runner;
}

absl::Status CommandRunner::Run(Recorder record) {
  return VkTry("run transfer commands", [&] { return RecordSubmitAndWait(record); });
}

absl::Status CommandRunner::RecordSubmitAndWait(Recorder record) {
  // A Vulkan error thrown mid-recording leaves the buffer recording; start clean.
  commands_.reset();
  commands_.begin(vk::CommandBufferBeginInfo(vk::CommandBufferUsageFlagBits::eOneTimeSubmit));
  commands_.pipelineBarrier(vk::PipelineStageFlagBits::eAllCommands, kCopyStages, {},
                            vk::MemoryBarrier(vk::AccessFlagBits::eMemoryWrite, kCopyAccesses),
                            nullptr, nullptr);
  const absl::Status recorded = record(commands_);
  commands_.pipelineBarrier(kCopyStages, vk::PipelineStageFlagBits::eHost, {},
                            vk::MemoryBarrier(kCopyWrites, vk::AccessFlagBits::eHostRead), nullptr,
                            nullptr);
  commands_.end();
  RETURN_IF_ERROR(recorded);
  const vk::CommandBuffer command_buffer = *commands_;
  {
    absl::MutexLock lock(&device_.queue_mutex());
    device_.queue().submit(vk::SubmitInfo({}, {}, command_buffer), *done_);
  }
  const vk::Result waited =
      device_.device().waitForFences(*done_, VK_TRUE, std::numeric_limits<uint64_t>::max());
  RETURN_IF_ERROR(VkStatus(waited, "wait for transfer commands"));
  device_.device().resetFences(*done_);
  return absl::OkStatus();
}

}  // namespace kvcache::gpu
