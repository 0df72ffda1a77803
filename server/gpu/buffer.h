// A VkBuffer bound to its own VkDeviceMemory: the one owner of device memory in
// gpu/ (page-pool slabs, the staging ring, the copy shader's run table).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "gpu/device.h"

namespace kvcache::gpu {

// The one view of device memory: `bytes` bytes of `buffer` from `offset`.
struct BufferSlice {
  vk::Buffer buffer;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct BufferSpec {
  uint64_t bytes = 0;
  vk::BufferUsageFlags usage;
  vk::MemoryPropertyFlags required_memory;
  vk::MemoryPropertyFlags preferred_memory;
  // The memory types (a bit per index) the buffer may use at all.
  uint32_t allowed_memory_types = UINT32_MAX;
  // Map the whole buffer for its lifetime (requires HOST_VISIBLE memory).
  bool host_mapped = false;
};

struct Buffer {
  vk::raii::Buffer buffer{nullptr};
  vk::raii::DeviceMemory memory{nullptr};
  uint64_t bytes = 0;
  // The persistent mapping, or null when not host-mapped. Freeing the memory
  // unmaps it.
  std::byte* mapped = nullptr;
};

// RESOURCE_EXHAUSTED when the device or host is out of memory.
absl::StatusOr<std::unique_ptr<Buffer>> CreateBuffer(const Device& device, const BufferSpec& spec);

}  // namespace kvcache::gpu
