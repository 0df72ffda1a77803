// PagePool Write / Read throughput per transfer path, beside a plain memcpy of
// the same bytes. Batches of 64 KiB .. 16 MiB, cut into page-sized runs.
//
//   build/bench/gpu/gpu_copy_bench [--benchmark_filter=Write]
//
// Wall-clock time: on the staged paths the work happens on the driver's threads.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "gpu/device.h"
#include "gpu/page_pool.h"

namespace kvcache::gpu {
namespace {

constexpr uint64_t kPageBytes = 64 << 10;

enum class Path { kDirect, kStagingRegions, kStagingShader };

// One device per path, made on first use and destroyed by main() before it
// returns: destroyed during static destruction instead, a Vulkan instance can
// outlive the driver's own teardown (NVIDIA's crashed there).
std::unique_ptr<Device> devices[3];

Device& BenchDevice(Path path) {
  std::unique_ptr<Device>& device = devices[static_cast<int>(path)];
  if (device == nullptr) {
    DeviceOptions options;
    options.force_staging = path != Path::kDirect;
    options.copy_engine =
        path == Path::kStagingShader ? CopyEngine::kComputeShader : CopyEngine::kCopyRegions;
    auto created = Device::Create(options);
    if (!created.ok()) {
      std::fprintf(stderr, "Device::Create: %s\n", created.status().ToString().c_str());
      std::exit(1);
    }
    device = *std::move(created);
  }
  return *device;
}

// A pool with `batch_bytes` of pages allocated, and a host buffer of that size.
struct Fixture {
  Fixture(Path path, uint64_t batch_bytes) : host(batch_bytes, 0x5a) {
    auto created = PagePool::Create(BenchDevice(path),
                                    {.page_bytes = kPageBytes, .budget_bytes = batch_bytes});
    if (!created.ok()) std::exit(1);
    pool = *std::move(created);
    if (!pool->Allocate(static_cast<uint32_t>(batch_bytes / kPageBytes), pages).ok()) std::exit(1);
  }
  ~Fixture() {
    for (PageId page : pages) pool->Release(page);
  }

  std::unique_ptr<PagePool> pool;
  std::vector<PageId> pages;
  std::vector<unsigned char> host;
};

void BM_Write(benchmark::State& state, Path path) {
  Fixture fixture(path, state.range(0));
  std::vector<WriteRun> runs;
  for (size_t i = 0; i < fixture.pages.size(); ++i) {
    runs.push_back({fixture.pages[i], 0, fixture.host.data() + i * kPageBytes, kPageBytes});
  }
  for (auto _ : state) {
    if (!fixture.pool->Write(runs).ok()) state.SkipWithError("Write failed");
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void BM_Read(benchmark::State& state, Path path) {
  Fixture fixture(path, state.range(0));
  std::vector<ReadRun> runs;
  for (size_t i = 0; i < fixture.pages.size(); ++i) {
    runs.push_back({fixture.pages[i], 0, fixture.host.data() + i * kPageBytes, kPageBytes});
  }
  for (auto _ : state) {
    if (!fixture.pool->Read(runs).ok()) state.SkipWithError("Read failed");
    benchmark::DoNotOptimize(fixture.host.data());
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

// The ceiling: the same bytes, page by page, with one memcpy thread.
void BM_Memcpy(benchmark::State& state) {
  std::vector<unsigned char> src(state.range(0), 0x5a);
  std::vector<unsigned char> dst(state.range(0));
  for (auto _ : state) {
    for (size_t at = 0; at < src.size(); at += kPageBytes) {
      std::memcpy(dst.data() + at, src.data() + at, kPageBytes);
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void BatchSizes(benchmark::internal::Benchmark* benchmark) {
  benchmark->RangeMultiplier(4)->Range(64 << 10, 16 << 20)->UseRealTime();
}

BENCHMARK(BM_Memcpy)->Apply(BatchSizes);
BENCHMARK_CAPTURE(BM_Write, Direct, Path::kDirect)->Apply(BatchSizes);
BENCHMARK_CAPTURE(BM_Write, StagingRegions, Path::kStagingRegions)->Apply(BatchSizes);
BENCHMARK_CAPTURE(BM_Write, StagingShader, Path::kStagingShader)->Apply(BatchSizes);
BENCHMARK_CAPTURE(BM_Read, Direct, Path::kDirect)->Apply(BatchSizes);
BENCHMARK_CAPTURE(BM_Read, StagingRegions, Path::kStagingRegions)->Apply(BatchSizes);
BENCHMARK_CAPTURE(BM_Read, StagingShader, Path::kStagingShader)->Apply(BatchSizes);

}  // namespace
}  // namespace kvcache::gpu

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  for (std::unique_ptr<kvcache::gpu::Device>& device : kvcache::gpu::devices) device.reset();
  return 0;
}
