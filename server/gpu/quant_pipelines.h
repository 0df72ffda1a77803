// The compute pipelines of shaders/quantize.comp and shaders/dequantize.comp:
// one pipeline per (direction, dtype, group size, bits, wq alignment), built on
// first use
// (the format is specialization constants, so each is compiled with constant
// loop bounds), and one descriptor set per slab over {scratch, slab, run table}.
// Not thread-safe: gpu::Quantizer serializes calls.
#pragma once

#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "gpu/descriptor_pools.h"
#include "gpu/device.h"

namespace kvcache::gpu {

enum class QuantDirection { kQuantize, kDequantize };

// Mirrors QuantRun in shaders/quant_common.glsl (std430 array stride 32).
struct QuantShaderRun {
  uint32_t scratch_byte;
  uint32_t wq_byte;
  uint32_t scales_byte;
  uint32_t biases_byte;
  uint32_t groups;
  uint32_t unused[3];
};
static_assert(sizeof(QuantShaderRun) == 32);

// Mirrors the push-constant block of shaders/quant_common.glsl.
struct QuantPush {
  uint32_t first_run;
  uint32_t run_count;
};
static_assert(sizeof(QuantPush) == 8);

struct QuantPipelineKey {
  QuantDirection direction;
  DType dtype;
  uint32_t group_size;
  uint32_t bits;
  bool wq_aligned;  // the runs' packed words start 16-byte aligned
  template <typename H>
  friend H AbslHashValue(H h, const QuantPipelineKey& k) {
    return H::combine(std::move(h), k.direction, k.dtype, k.group_size, k.bits, k.wq_aligned);
  }
  bool operator==(const QuantPipelineKey&) const = default;
};

class QuantPipelines {
 public:
  // `subgroup_shuffle`: use quantize.comp where the device can shuffle (else,
  // or when false, quantize_atomic.comp).
  static absl::StatusOr<std::unique_ptr<QuantPipelines>> Create(const Device& device,
                                                                bool subgroup_shuffle);

  const vk::raii::PipelineLayout& layout() const { return layout_; }
  // Throws vk::SystemError (callers run under VkTry).
  vk::Pipeline Get(const QuantPipelineKey& key);
  // The set binding {scratch, slab, run_table}; sets are cached per slab until
  // ForgetSets (call it when the scratch or run table buffer changes).
  absl::StatusOr<vk::DescriptorSet> SetFor(vk::Buffer scratch, vk::Buffer slab,
                                           vk::Buffer run_table);
  void ForgetSets();

 private:
  explicit QuantPipelines(const Device& device);
  void Init(bool subgroup_shuffle);

  const Device& device_;
  vk::raii::ShaderModule quantize_{nullptr};
  vk::raii::ShaderModule dequantize_{nullptr};
  vk::raii::DescriptorSetLayout set_layout_{nullptr};
  vk::raii::PipelineLayout layout_{nullptr};
  absl::flat_hash_map<QuantPipelineKey, vk::raii::Pipeline> pipelines_;
  // Pools fill up; ForgetSets frees every set and pool (declared first, so
  // destroyed after the sets).
  DescriptorPools descriptor_pools_;
  absl::flat_hash_map<VkBuffer, vk::raii::DescriptorSet> sets_;
};

}  // namespace kvcache::gpu
