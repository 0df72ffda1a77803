// Test support for suites that run on a Vulkan device (lavapipe in CI), with the
// Khronos validation layer on: a validation message during a test fails it.
//
//   class MyTest : public kvcache::testing::GpuTestBase {};
//   TEST_P(MyTest, Works) { auto pool = MakePool(4096, 1 << 20); ASSERT_NE(pool, nullptr); ... }
//   INSTANTIATE_TEST_SUITE_P(AllPaths, MyTest, ::testing::ValuesIn(kAllTransferPaths),
//                            [](const auto& info) { return TransferPathName(info.param); });
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "gpu/device_options.h"
#include "gpu/page_pool.h"
#include "gtest/gtest.h"

namespace kvcache::testing {

// How a page pool moves bytes: the paths every transfer test covers.
enum class TransferPath {
  kDirect,          // host-mapped pages, memcpy (lavapipe's natural path)
  kStagingRegions,  // force_staging, CopyEngine::kCopyRegions
  kStagingShader,   // force_staging, CopyEngine::kComputeShader
  kMappedWrites,    // stage_reads: writes through the mapping, the rest staged
};

// "Direct", "StagingRegions", "StagingShader", "MappedWrites": test-name friendly.
std::string TransferPathName(TransferPath path);
// So googletest and ctest print the path's name, not its bytes.
inline void PrintTo(TransferPath path, std::ostream* out) { *out << TransferPathName(path); }
// "shader", "host", "auto".
std::string QuantKernelName(gpu::QuantKernel kernel);

inline constexpr TransferPath kAllTransferPaths[] = {
    TransferPath::kDirect, TransferPath::kStagingRegions, TransferPath::kStagingShader,
    TransferPath::kMappedWrites};

// The process-wide device for `path`, created on first use with validation on
// and never destroyed. Creation failure is fatal (ADD_FAILURE, then abort).
gpu::Device& TestDevice(TransferPath path);

class GpuTestBase : public ::testing::TestWithParam<TransferPath> {
 protected:
  // Notes how many validation messages the device has reported so far.
  void SetUp() override;
  // Fails the test, listing them, if any validation message came during it.
  void TearDown() override;

  gpu::Device& device() { return TestDevice(GetParam()); }
  // A pool on device(); on failure records a test failure and returns null,
  // so callers write ASSERT_NE(pool, nullptr).
  std::unique_ptr<gpu::PagePool> MakePool(uint64_t page_bytes, uint64_t budget_bytes,
                                          gpu::QuantKernel kernel = gpu::QuantKernel::kAuto);
  // The quantize kernels a pool on this path can run: the shaders always, the
  // native CPU kernels where pages are host-mapped.
  std::vector<gpu::QuantKernel> QuantKernels();

 private:
  uint64_t validation_messages_before_ = 0;
};

}  // namespace kvcache::testing
