#include "gpu/descriptor_pools.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace kvcache::gpu {

DescriptorPools::DescriptorPools(const Device& device, uint32_t sets_per_pool,
                                 uint32_t bindings_per_set)
    : device_(device), sets_per_pool_(sets_per_pool), bindings_per_set_(bindings_per_set) {}

absl::StatusOr<vk::raii::DescriptorSet> DescriptorPools::Allocate(
    vk::DescriptorSetLayout layout, absl::Span<const vk::Buffer> buffers) {
  if (buffers.size() != bindings_per_set_) {
    return absl::InternalError(absl::StrCat("descriptor set: ", buffers.size(),
                                            " buffers for ", bindings_per_set_, " bindings"));
  }
  vk::raii::DescriptorSet set(nullptr);
  RETURN_IF_ERROR(VkTry("allocate a descriptor set", [&] {
    set = AllocateAndBind(layout, buffers);
    return absl::OkStatus();
  }));
  return set;
}

vk::raii::DescriptorSet DescriptorPools::AllocateAndBind(vk::DescriptorSetLayout layout,
                                                         absl::Span<const vk::Buffer> buffers) {
  const vk::raii::Device& device = device_.device();
  if (pools_.empty() || sets_in_last_pool_ == sets_per_pool_) {
    const vk::DescriptorPoolSize size(vk::DescriptorType::eStorageBuffer,
                                      sets_per_pool_ * bindings_per_set_);
    pools_.emplace_back(
        device, vk::DescriptorPoolCreateInfo(vk::DescriptorPoolCreateFlagBits::eFreeDescriptorSet,
                                             sets_per_pool_, size));
    sets_in_last_pool_ = 0;
  }
  vk::raii::DescriptorSets sets(device, vk::DescriptorSetAllocateInfo(*pools_.back(), layout));
  ++sets_in_last_pool_;
  std::vector<vk::DescriptorBufferInfo> infos;
  std::vector<vk::WriteDescriptorSet> writes;
  infos.reserve(buffers.size());  // the writes point into it
  for (uint32_t i = 0; i < buffers.size(); ++i) {
    infos.emplace_back(buffers[i], 0, VK_WHOLE_SIZE);
    writes.emplace_back(*sets.front(), i, 0, vk::DescriptorType::eStorageBuffer, nullptr,
                        infos.back());
  }
  device.updateDescriptorSets(writes, nullptr);
  return std::move(sets.front());
}

void DescriptorPools::Clear() {
  pools_.clear();
  sets_in_last_pool_ = 0;
}

}  // namespace kvcache::gpu
