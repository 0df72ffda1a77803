#include "gpu/buffer.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace kvcache::gpu {
namespace {

// Fills `out`; throws vk::SystemError on Vulkan errors (CreateBuffer catches).
absl::Status AllocateAndBind(const Device& device, const BufferSpec& spec, Buffer& out) {
  out.buffer = vk::raii::Buffer(device.device(), vk::BufferCreateInfo({}, spec.bytes, spec.usage));
  const vk::MemoryRequirements needs = out.buffer.getMemoryRequirements();
  ASSIGN_OR_RETURN(const uint32_t memory_type,
                   device.FindMemoryType(needs.memoryTypeBits & spec.allowed_memory_types,
                                         spec.required_memory, spec.preferred_memory));
  out.memory =
      vk::raii::DeviceMemory(device.device(), vk::MemoryAllocateInfo(needs.size, memory_type));
  out.buffer.bindMemory(*out.memory, 0);
  if (spec.host_mapped) {
    out.mapped = static_cast<std::byte*>(out.memory.mapMemory(0, VK_WHOLE_SIZE));
  }
  out.bytes = spec.bytes;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Buffer>> CreateBuffer(const Device& device, const BufferSpec& spec) {
  auto buffer = std::make_unique<Buffer>();
  RETURN_IF_ERROR(VkTry(absl::StrCat("allocate a ", spec.bytes, "-byte buffer"),
                        [&] { return AllocateAndBind(device, spec, *buffer); }));
  return buffer;
}

}  // namespace kvcache::gpu
