// Recording buffer-to-buffer copies for the staged transfer path, by either
// CopyEngine: vkCmdCopyBuffer regions, or the compute shader shaders/copy_runs.comp.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu/buffer.h"
#include "gpu/descriptor_pools.h"
#include "gpu/device.h"

namespace kvcache::gpu {

// `bytes` bytes from `src` at `src_offset` to `dst` at `dst_offset`. The source
// and destination ranges of all copies recorded together must not overlap.
struct BufferCopy {
  vk::Buffer src;
  uint64_t src_offset;
  vk::Buffer dst;
  uint64_t dst_offset;
  uint64_t bytes;
};

// Mirrors `Run` in shaders/copy_runs.comp (std430 array stride 12).
struct CopyRun {
  uint32_t src_word;
  uint32_t dst_word;
  uint32_t words;
};
static_assert(sizeof(CopyRun) == 12);

// Mirrors the push-constant block of shaders/copy_runs.comp.
struct CopyRunsPush {
  uint32_t first_run;
  uint32_t run_count;
};
static_assert(sizeof(CopyRunsPush) == 8);

// Records `copies` as one vkCmdCopyBuffer per (src, dst) buffer pair.
void RecordCopyRegions(const vk::raii::CommandBuffer& commands,
                       absl::Span<const BufferCopy> copies);

// The copy_runs compute pipeline, its run table (host-mapped) and one cached
// descriptor set per (src, dst) buffer pair. The buffers must outlive it; the
// caller serializes Record calls and waits for each submission before the next.
class CopyPipeline {
 public:
  // Most copies per Record: the run table's capacity (and under the 65535
  // workgroups a dispatch may have along x).
  static constexpr uint32_t kMaxCopies = 16384;

  static absl::StatusOr<std::unique_ptr<CopyPipeline>> Create(const Device& device);

  // Records `copies` (at most kMaxCopies): the 4-byte-aligned body of each copy
  // through the shader; unaligned head and tail bytes, and copies whose source
  // and destination disagree mod 4, as copy regions.
  absl::Status Record(const vk::raii::CommandBuffer& commands, absl::Span<const BufferCopy> copies);

 private:
  using BufferPair = std::pair<VkBuffer, VkBuffer>;
  struct RunGroup {
    std::vector<CopyRun> runs;
    uint32_t max_words = 0;
  };

  explicit CopyPipeline(const Device& device);
  absl::Status Init();
  // Splits `copies` into shader runs grouped by buffer pair and leftover regions.
  void SplitCopies(absl::Span<const BufferCopy> copies,
                   absl::flat_hash_map<BufferPair, RunGroup>& groups,
                   std::vector<BufferCopy>& regions) const;
  absl::StatusOr<vk::DescriptorSet> DescriptorSetFor(const BufferPair& buffers);

  const Device& device_;
  std::unique_ptr<Buffer> run_table_;
  vk::raii::ShaderModule shader_{nullptr};
  vk::raii::DescriptorSetLayout set_layout_{nullptr};
  vk::raii::PipelineLayout pipeline_layout_{nullptr};
  vk::raii::Pipeline pipeline_{nullptr};
  // The pools are never cleared; the sets (declared after, so destroyed first)
  // live as long as the pipeline.
  DescriptorPools descriptor_pools_;
  absl::flat_hash_map<BufferPair, vk::raii::DescriptorSet> descriptor_sets_;
};

}  // namespace kvcache::gpu
