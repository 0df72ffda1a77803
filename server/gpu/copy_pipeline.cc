#include "gpu/copy_pipeline.h"

#include <algorithm>
#include <array>
#include <span>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kvcached_shaders.h"

namespace kvcache::gpu {
namespace {

// Must match kTileWords in copy_runs.comp: words one workgroup copies.
constexpr uint64_t kTileWords = 4096;
// Dispatches have at least 65535 workgroups along each axis (Vulkan minimum).
constexpr uint64_t kMaxWorkgroups = 65535;
// One run may span at most kMaxWorkgroups tiles (1 GiB); longer bodies split.
constexpr uint64_t kMaxRunWords = kTileWords * kMaxWorkgroups;
constexpr uint32_t kSetsPerDescriptorPool = 64;
// The validation layer checks the regions of one vkCmdCopyBuffer pairwise for
// overlap; 16384 regions in one command took it 20 s. Chunks keep that linear,
// and cost nothing without the layer.
constexpr size_t kMaxRegionsPerCommand = 256;
constexpr uint32_t kBindingsPerSet = 3;  // source, destination, run table
static_assert(CopyPipeline::kMaxCopies <= kMaxWorkgroups);

using BufferPair = std::pair<VkBuffer, VkBuffer>;

BufferPair PairOf(const BufferCopy& copy) {
  return {static_cast<VkBuffer>(copy.src), static_cast<VkBuffer>(copy.dst)};
}

}  // namespace

void RecordCopyRegions(const vk::raii::CommandBuffer& commands,
                       absl::Span<const BufferCopy> copies) {
  absl::flat_hash_map<BufferPair, std::vector<vk::BufferCopy>> regions_by_pair;
  for (const BufferCopy& copy : copies) {
    if (copy.bytes == 0) continue;
    regions_by_pair[PairOf(copy)].emplace_back(copy.src_offset, copy.dst_offset, copy.bytes);
  }
  for (const auto& [buffers, regions] : regions_by_pair) {
    for (size_t first = 0; first < regions.size(); first += kMaxRegionsPerCommand) {
      const size_t count = std::min(kMaxRegionsPerCommand, regions.size() - first);
      commands.copyBuffer(buffers.first, buffers.second,
                          vk::ArrayProxy<const vk::BufferCopy>(count, regions.data() + first));
    }
  }
}

absl::StatusOr<std::unique_ptr<CopyPipeline>> CopyPipeline::Create(const Device& device) {
  auto pipeline = std::unique_ptr<CopyPipeline>(new CopyPipeline(device));
  RETURN_IF_ERROR(VkTry("create the copy_runs pipeline", [&] { return pipeline->Init(); }));
  return pipeline;
}

CopyPipeline::CopyPipeline(const Device& device)
    : device_(device), descriptor_pools_(device, kSetsPerDescriptorPool, kBindingsPerSet) {}

absl::Status CopyPipeline::Init() {
  const vk::raii::Device& device = device_.device();
  const std::span<const uint32_t> spirv = shaders::copy_runs();
  shader_ = vk::raii::ShaderModule(
      device, vk::ShaderModuleCreateInfo({}, spirv.size_bytes(), spirv.data()));
  std::array<vk::DescriptorSetLayoutBinding, kBindingsPerSet> bindings;
  for (uint32_t i = 0; i < kBindingsPerSet; ++i) {
    bindings[i] = vk::DescriptorSetLayoutBinding(i, vk::DescriptorType::eStorageBuffer, 1,
                                                 vk::ShaderStageFlagBits::eCompute);
  }
  set_layout_ =
      vk::raii::DescriptorSetLayout(device, vk::DescriptorSetLayoutCreateInfo({}, bindings));
  const vk::PushConstantRange push_range(vk::ShaderStageFlagBits::eCompute, 0,
                                         sizeof(CopyRunsPush));
  const vk::DescriptorSetLayout set_layout = *set_layout_;
  pipeline_layout_ =
      vk::raii::PipelineLayout(device, vk::PipelineLayoutCreateInfo({}, set_layout, push_range));
  const vk::PipelineShaderStageCreateInfo stage({}, vk::ShaderStageFlagBits::eCompute, *shader_,
                                                "main");
  pipeline_ = vk::raii::Pipeline(device, nullptr,
                                 vk::ComputePipelineCreateInfo({}, stage, *pipeline_layout_));
  ASSIGN_OR_RETURN(
      run_table_,
      CreateBuffer(device_, {.bytes = kMaxCopies * sizeof(CopyRun),
                             .usage = vk::BufferUsageFlagBits::eStorageBuffer,
                             .required_memory = vk::MemoryPropertyFlagBits::eHostVisible |
                                                vk::MemoryPropertyFlagBits::eHostCoherent,
                             .host_mapped = true}));
  return absl::OkStatus();
}

//   src  ..|h h|w w w w|w w w w|t|..     h: head bytes up to a 4-byte boundary
//   dst  ....|h h|w w w w|w w w w|t|     w: whole words, copied by the shader
//                                        t: tail bytes after the last word
// Only copies whose ends agree mod 4 have a word-aligned body on both sides.
void CopyPipeline::SplitCopies(absl::Span<const BufferCopy> copies,
                               absl::flat_hash_map<BufferPair, RunGroup>& groups,
                               std::vector<BufferCopy>& regions) const {
  for (const BufferCopy& copy : copies) {
    const uint64_t head = (4 - copy.src_offset % 4) % 4;
    if (copy.src_offset % 4 != copy.dst_offset % 4 || copy.bytes < head + 4) {
      regions.push_back(copy);
      continue;
    }
    const uint64_t words = (copy.bytes - head) / 4;
    const uint64_t tail = copy.bytes - head - words * 4;
    regions.push_back({copy.src, copy.src_offset, copy.dst, copy.dst_offset, head});
    regions.push_back({copy.src, copy.src_offset + copy.bytes - tail, copy.dst,
                       copy.dst_offset + copy.bytes - tail, tail});
    RunGroup& group = groups[PairOf(copy)];
    const uint64_t first_src_word = (copy.src_offset + head) / 4;
    const uint64_t first_dst_word = (copy.dst_offset + head) / 4;
    for (uint64_t done = 0; done < words; done += kMaxRunWords) {
      const uint64_t run_words = std::min(kMaxRunWords, words - done);
      group.runs.push_back({static_cast<uint32_t>(first_src_word + done),
                            static_cast<uint32_t>(first_dst_word + done),
                            static_cast<uint32_t>(run_words)});
      group.max_words = std::max(group.max_words, static_cast<uint32_t>(run_words));
    }
  }
}

absl::Status CopyPipeline::Record(const vk::raii::CommandBuffer& commands,
                                  absl::Span<const BufferCopy> copies) {
  absl::flat_hash_map<BufferPair, RunGroup> groups;
  std::vector<BufferCopy> regions;
  SplitCopies(copies, groups, regions);
  auto* run_table = reinterpret_cast<CopyRun*>(run_table_->mapped);
  uint32_t next_run = 0;
  if (!groups.empty()) commands.bindPipeline(vk::PipelineBindPoint::eCompute, *pipeline_);
  for (const auto& [buffers, group] : groups) {
    if (next_run + group.runs.size() > kMaxCopies) {
      return absl::InternalError(
          absl::StrCat("copy_runs: more than ", kMaxCopies, " runs recorded in one submission"));
    }
    ASSIGN_OR_RETURN(const vk::DescriptorSet set, DescriptorSetFor(buffers));
    std::copy(group.runs.begin(), group.runs.end(), run_table + next_run);
    const CopyRunsPush push{next_run, static_cast<uint32_t>(group.runs.size())};
    commands.bindDescriptorSets(vk::PipelineBindPoint::eCompute, *pipeline_layout_, 0, set, {});
    commands.pushConstants<CopyRunsPush>(*pipeline_layout_, vk::ShaderStageFlagBits::eCompute, 0,
                                         push);
    const uint64_t tiles = (group.max_words + kTileWords - 1) / kTileWords;
    commands.dispatch(push.run_count, static_cast<uint32_t>(tiles), 1);
    next_run += push.run_count;
  }
  RecordCopyRegions(commands, regions);
  return absl::OkStatus();
}

absl::StatusOr<vk::DescriptorSet> CopyPipeline::DescriptorSetFor(const BufferPair& buffers) {
  if (auto found = descriptor_sets_.find(buffers); found != descriptor_sets_.end()) {
    return *found->second;
  }
  ASSIGN_OR_RETURN(vk::raii::DescriptorSet set,
                   descriptor_pools_.Allocate(*set_layout_, {buffers.first, buffers.second,
                                                             *run_table_->buffer}));
  auto [inserted, unused] = descriptor_sets_.emplace(buffers, std::move(set));
  return *inserted->second;
}

}  // namespace kvcache::gpu
