#include "support/gpu_test_base.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "gpu/device.h"

namespace kvcache::testing {

std::string TransferPathName(TransferPath path) {
  switch (path) {
    case TransferPath::kDirect: return "Direct";
    case TransferPath::kStagingRegions: return "StagingRegions";
    case TransferPath::kStagingShader: return "StagingShader";
    case TransferPath::kMappedWrites:
      return "MappedWrites";
  }
  return "Unknown";
}

namespace {

gpu::DeviceOptions OptionsFor(TransferPath path) {
  gpu::DeviceOptions options;
  options.enable_validation = true;
  options.force_staging =
      path == TransferPath::kStagingRegions || path == TransferPath::kStagingShader;
  options.stage_reads = path == TransferPath::kMappedWrites;
  options.copy_engine = path == TransferPath::kStagingShader ? gpu::CopyEngine::kComputeShader
                                                             : gpu::CopyEngine::kCopyRegions;
  return options;
}

gpu::Device* CreateOrDie(TransferPath path) {
  absl::StatusOr<std::unique_ptr<gpu::Device>> device = gpu::Device::Create(OptionsFor(path));
  if (!device.ok()) {
    ADD_FAILURE() << "cannot create the " << TransferPathName(path)
                  << " test device: " << device.status();
    std::abort();
  }
  // On lavapipe the direct path must really be direct, or it tests nothing new.
  if (path == TransferPath::kDirect && (*device)->description().type == "cpu" &&
      !(*device)->direct_host_access()) {
    ADD_FAILURE() << "the CPU device " << (*device)->description().name
                  << " should give direct host access to pages";
  }
  if (path == TransferPath::kMappedWrites && (*device)->description().type == "cpu" &&
      !(*device)->mapped_writes()) {
    ADD_FAILURE() << "the CPU device " << (*device)->description().name
                  << " should map pages for writes";
  }
  return device->release();  // Lives until exit: Vulkan teardown at exit is fragile.
}

}  // namespace

gpu::Device& TestDevice(TransferPath path) {
  static absl::Mutex mutex(absl::kConstInit);
  static gpu::Device* devices[std::size(kAllTransferPaths)] ABSL_GUARDED_BY(mutex) = {};
  absl::MutexLock lock(&mutex);
  gpu::Device*& device = devices[static_cast<size_t>(path)];
  if (device == nullptr) device = CreateOrDie(path);
  return *device;
}

void GpuTestBase::SetUp() {
  validation_messages_before_ = device().validation_message_count();
}

void GpuTestBase::TearDown() {
  const uint64_t reported = device().validation_message_count() - validation_messages_before_;
  if (reported == 0) return;
  const std::vector<std::string> kept = device().validation_messages();
  const std::vector<std::string> during(
      kept.begin() + std::min<size_t>(kept.size(), validation_messages_before_), kept.end());
  ADD_FAILURE() << reported << " Vulkan validation message(s) during this test"
                << (during.empty() ? " (past the kept limit)" : ":\n  ")
                << absl::StrJoin(during, "\n  ");
}

std::string QuantKernelName(gpu::QuantKernel kernel) {
  switch (kernel) {
    case gpu::QuantKernel::kShader: return "shader";
    case gpu::QuantKernel::kHost: return "host";
    case gpu::QuantKernel::kAuto: return "auto";
  }
  return "unknown";
}

std::vector<gpu::QuantKernel> GpuTestBase::QuantKernels() {
  if (!device().direct_host_access()) return {gpu::QuantKernel::kShader};
  return {gpu::QuantKernel::kHost, gpu::QuantKernel::kShader};
}

std::unique_ptr<gpu::PagePool> GpuTestBase::MakePool(uint64_t page_bytes, uint64_t budget_bytes,
                                                     gpu::QuantKernel kernel) {
  gpu::PoolOptions options;
  options.page_bytes = page_bytes;
  options.budget_bytes = budget_bytes;
  options.quantize_kernel = kernel;
  absl::StatusOr<std::unique_ptr<gpu::PagePool>> pool = gpu::PagePool::Create(device(), options);
  if (!pool.ok()) {
    ADD_FAILURE() << "PagePool::Create(page_bytes=" << page_bytes
                  << ", budget_bytes=" << budget_bytes << "): " << pool.status();
    return nullptr;
  }
  return *std::move(pool);
}

}  // namespace kvcache::testing
