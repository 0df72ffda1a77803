// DescriptorPools (gpu/descriptor_pools.h): a new pool starts only when the
// last one is full, Clear starts over, and a set given the wrong number of
// buffers is refused before anything is allocated.
#include "gpu/descriptor_pools.h"

#include <array>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "gpu/buffer.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"

namespace kvcache::gpu {
namespace {

using testing::GpuTestBase;
using testing::TransferPath;
using testing::TransferPathName;

constexpr uint32_t kBindings = 3;

class DescriptorPoolsTest : public GpuTestBase {
 protected:
  void SetUp() override {
    GpuTestBase::SetUp();
    std::array<vk::DescriptorSetLayoutBinding, kBindings> bindings;
    for (uint32_t i = 0; i < kBindings; ++i) {
      bindings[i] = vk::DescriptorSetLayoutBinding(i, vk::DescriptorType::eStorageBuffer, 1,
                                                   vk::ShaderStageFlagBits::eCompute);
    }
    layout_ = vk::raii::DescriptorSetLayout(device().device(),
                                            vk::DescriptorSetLayoutCreateInfo({}, bindings));
    for (auto& buffer : buffers_) {
      auto created = CreateBuffer(device(), {.bytes = 256,
                                             .usage = vk::BufferUsageFlagBits::eStorageBuffer});
      ASSERT_TRUE(created.ok()) << created.status();
      buffer = *std::move(created);
    }
  }

  std::vector<vk::Buffer> Buffers(size_t count) const {
    std::vector<vk::Buffer> buffers;
    for (size_t i = 0; i < count; ++i) buffers.push_back(*buffers_[i]->buffer);
    return buffers;
  }

  vk::raii::DescriptorSetLayout layout_{nullptr};
  std::array<std::unique_ptr<Buffer>, kBindings + 1> buffers_;
};

TEST_P(DescriptorPoolsTest, ANewPoolStartsOnlyWhenTheLastIsFull) {
  constexpr uint32_t kSetsPerPool = 2;
  const struct {
    size_t sets;
    size_t pools;
  } cases[] = {{1, 1}, {2, 1}, {3, 2}, {4, 2}, {5, 3}};
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.sets << " sets");
    DescriptorPools pools(device(), kSetsPerPool, kBindings);
    std::vector<vk::raii::DescriptorSet> sets;
    for (size_t i = 0; i < c.sets; ++i) {
      auto set = pools.Allocate(*layout_, Buffers(kBindings));
      ASSERT_TRUE(set.ok()) << set.status();
      sets.push_back(*std::move(set));
    }
    EXPECT_EQ(pools.pool_count(), c.pools);
    sets.clear();  // before their pools
  }
}

TEST_P(DescriptorPoolsTest, ClearStartsOverWithOnePool) {
  DescriptorPools pools(device(), 1, kBindings);
  {
    std::vector<vk::raii::DescriptorSet> sets;
    for (int i = 0; i < 3; ++i) {
      auto set = pools.Allocate(*layout_, Buffers(kBindings));
      ASSERT_TRUE(set.ok()) << set.status();
      sets.push_back(*std::move(set));
    }
    ASSERT_EQ(pools.pool_count(), 3u);
  }
  pools.Clear();
  EXPECT_EQ(pools.pool_count(), 0u);
  auto set = pools.Allocate(*layout_, Buffers(kBindings));
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(pools.pool_count(), 1u);
}

TEST_P(DescriptorPoolsTest, AWrongNumberOfBuffersIsRefusedBeforeAnyPool) {
  DescriptorPools pools(device(), 4, kBindings);
  for (size_t count : {size_t{0}, size_t{kBindings - 1}, size_t{kBindings + 1}}) {
    SCOPED_TRACE(::testing::Message() << count << " buffers");
    auto set = pools.Allocate(*layout_, Buffers(count));
    EXPECT_EQ(set.status().code(), absl::StatusCode::kInternal);
  }
  EXPECT_EQ(pools.pool_count(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Direct, DescriptorPoolsTest, ::testing::Values(TransferPath::kDirect),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::gpu
