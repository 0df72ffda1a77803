#include "gpu/staging.h"

#include <algorithm>

#include "core/status_macros.h"

namespace kvcache::gpu {

namespace {
constexpr uint64_t kSliceAlignment = 16;
}  // namespace

absl::StatusOr<std::unique_ptr<StagingRing>> StagingRing::Create(const Device& device,
                                                                 uint64_t bytes) {
  // Host-cached memory where there is a choice: Read copies back out of it.
  ASSIGN_OR_RETURN(
      std::unique_ptr<Buffer> buffer,
      CreateBuffer(device, {.bytes = bytes,
                            .usage = vk::BufferUsageFlagBits::eStorageBuffer |
                                     vk::BufferUsageFlagBits::eTransferSrc |
                                     vk::BufferUsageFlagBits::eTransferDst,
                            .required_memory = vk::MemoryPropertyFlagBits::eHostVisible |
                                               vk::MemoryPropertyFlagBits::eHostCoherent,
                            .preferred_memory = vk::MemoryPropertyFlagBits::eHostCached,
                            .host_mapped = true}));
  return std::unique_ptr<StagingRing>(new StagingRing(std::move(buffer)));
}

StagingRing::Slice StagingRing::Reserve(uint64_t bytes, uint64_t phase) {
  const uint64_t start =
      (cursor_ + kSliceAlignment - 1) / kSliceAlignment * kSliceAlignment + phase % 4;
  if (start >= capacity()) return {};
  const Slice slice{start, std::min(bytes, capacity() - start)};
  cursor_ = slice.offset + slice.bytes;
  return slice;
}

}  // namespace kvcache::gpu
