// Descriptor sets of whole storage buffers for one compute set layout, from
// pools added as each fills up (a pipeline does not know up front how many
// buffers, hence sets, it will bind):
//
//   pools_:  [ full ][ full ] ... [ last: sets_in_last_pool_ of sets_per_pool ]
//
// Pools are never reset one by one; Clear drops them all. Each set frees
// itself into its pool, so an owner destroys its sets before this (declares
// its set cache after it, and clears that cache before calling Clear).
// Not thread-safe: its owner serializes calls, as it does its recording.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu/device.h"

namespace kvcache::gpu {

class DescriptorPools {
 public:
  // Each set of the layouts passed to Allocate has `bindings_per_set` storage
  // buffer bindings, 0 to bindings_per_set - 1.
  DescriptorPools(const Device& device, uint32_t sets_per_pool, uint32_t bindings_per_set);

  // A set of `layout` binding the whole of buffers[i] at binding i. Vulkan
  // errors (a pool or set the device has no memory for) come back as a status.
  absl::StatusOr<vk::raii::DescriptorSet> Allocate(vk::DescriptorSetLayout layout,
                                                   absl::Span<const vk::Buffer> buffers);
  // Drops every pool; every set allocated from them must be gone first.
  void Clear();
  // Pools created since the last Clear (full ones included).
  size_t pool_count() const { return pools_.size(); }

 private:
  // Throws vk::SystemError (Allocate runs it under VkTry).
  vk::raii::DescriptorSet AllocateAndBind(vk::DescriptorSetLayout layout,
                                          absl::Span<const vk::Buffer> buffers);

  const Device& device_;
  const uint32_t sets_per_pool_;
  const uint32_t bindings_per_set_;
  std::vector<vk::raii::DescriptorPool> pools_;
  uint32_t sets_in_last_pool_ = 0;
};

}  // namespace kvcache::gpu
