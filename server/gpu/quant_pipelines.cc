#include "gpu/quant_pipelines.h"

#include <array>
#include <span>

#include "core/status_macros.h"
#include "kvcached_shaders.h"

namespace kvcache::gpu {
namespace {

constexpr uint32_t kBindingsPerSet = 3;  // scratch, slab, run table
constexpr uint32_t kSetsPerDescriptorPool = 16;

vk::raii::ShaderModule ModuleOf(const vk::raii::Device& device, std::span<const uint32_t> spirv) {
  return vk::raii::ShaderModule(device,
                                vk::ShaderModuleCreateInfo({}, spirv.size_bytes(), spirv.data()));
}

// quantize.comp pairs neighbouring 16-bit scales through subgroup shuffles;
// quantize_atomic.comp, for devices without them, writes each atomically.
bool CanShuffleInCompute(const vk::raii::PhysicalDevice& physical_device) {
  const auto chain =
      physical_device
          .getProperties2<vk::PhysicalDeviceProperties2, vk::PhysicalDeviceSubgroupProperties>();
  const auto& subgroup = chain.get<vk::PhysicalDeviceSubgroupProperties>();
  return (subgroup.supportedStages & vk::ShaderStageFlagBits::eCompute) &&
         (subgroup.supportedOperations & vk::SubgroupFeatureFlagBits::eShuffle) &&
         subgroup.subgroupSize % 2 == 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<QuantPipelines>> QuantPipelines::Create(const Device& device,
                                                                       bool subgroup_shuffle) {
  auto pipelines = std::unique_ptr<QuantPipelines>(new QuantPipelines(device));
  RETURN_IF_ERROR(VkTry("create the quantize pipelines", [&] {
    pipelines->Init(subgroup_shuffle);
    return absl::OkStatus();
  }));
  return pipelines;
}

QuantPipelines::QuantPipelines(const Device& device)
    : device_(device), descriptor_pools_(device, kSetsPerDescriptorPool, kBindingsPerSet) {}

void QuantPipelines::Init(bool subgroup_shuffle) {
  const vk::raii::Device& device = device_.device();
  quantize_ = ModuleOf(device, subgroup_shuffle && CanShuffleInCompute(device_.physical_device())
                                   ? shaders::quantize()
                                   : shaders::quantize_atomic());
  dequantize_ = ModuleOf(device, shaders::dequantize());
  std::array<vk::DescriptorSetLayoutBinding, kBindingsPerSet> bindings;
  for (uint32_t i = 0; i < kBindingsPerSet; ++i) {
    bindings[i] = vk::DescriptorSetLayoutBinding(i, vk::DescriptorType::eStorageBuffer, 1,
                                                 vk::ShaderStageFlagBits::eCompute);
  }
  set_layout_ =
      vk::raii::DescriptorSetLayout(device, vk::DescriptorSetLayoutCreateInfo({}, bindings));
  const vk::PushConstantRange push_range(vk::ShaderStageFlagBits::eCompute, 0, sizeof(QuantPush));
  const vk::DescriptorSetLayout set_layout = *set_layout_;
  layout_ =
      vk::raii::PipelineLayout(device, vk::PipelineLayoutCreateInfo({}, set_layout, push_range));
}

vk::Pipeline QuantPipelines::Get(const QuantPipelineKey& key) {
  if (auto found = pipelines_.find(key); found != pipelines_.end()) return *found->second;
  // constant_id 0..3 of shaders/quant_common.glsl: dtype, group size, bits, alignment.
  const std::array<uint32_t, 4> values = {static_cast<uint32_t>(key.dtype), key.group_size,
                                          key.bits, key.wq_aligned ? 1u : 0u};
  std::array<vk::SpecializationMapEntry, 4> entries;
  for (uint32_t i = 0; i < entries.size(); ++i) {
    entries[i] = vk::SpecializationMapEntry(i, i * sizeof(uint32_t), sizeof(uint32_t));
  }
  const vk::SpecializationInfo specialization(static_cast<uint32_t>(entries.size()), entries.data(),
                                              sizeof(values), values.data());
  const vk::ShaderModule module =
      key.direction == QuantDirection::kQuantize ? *quantize_ : *dequantize_;
  const vk::PipelineShaderStageCreateInfo stage({}, vk::ShaderStageFlagBits::eCompute, module,
                                                "main", &specialization);
  auto [inserted, unused] = pipelines_.emplace(
      key, vk::raii::Pipeline(device_.device(), nullptr,
                              vk::ComputePipelineCreateInfo({}, stage, *layout_)));
  return *inserted->second;
}

absl::StatusOr<vk::DescriptorSet> QuantPipelines::SetFor(vk::Buffer scratch, vk::Buffer slab,
                                                         vk::Buffer run_table) {
  if (auto found = sets_.find(static_cast<VkBuffer>(slab)); found != sets_.end()) {
    return *found->second;
  }
  ASSIGN_OR_RETURN(vk::raii::DescriptorSet set,
                   descriptor_pools_.Allocate(*set_layout_, {scratch, slab, run_table}));
  auto [inserted, unused] = sets_.emplace(static_cast<VkBuffer>(slab), std::move(set));
  return *inserted->second;
}

void QuantPipelines::ForgetSets() {
  sets_.clear();
  descriptor_pools_.Clear();
}

}  // namespace kvcache::gpu
