// Quantize / dequantize throughput (gpu/quantizer.h), with the compute shaders
// (kernel:0) and the native CPU kernels (kernel:1, host-mapped pages only),
// beside memcpy of the same bytes: one K (or V) update of 8 KV heads x head
// dim 128 x L tokens, f16, group 64, bits 4 and 8, laid out as the engine lays
// out a quantized layer (256 tokens a page, one run per head and page).
//
//   build/bench/gpu/gpu_quant_bench [--benchmark_filter=Quantize]
//
// cold:1 cycles the pages (and memcpy's destination) through 256 MiB, more
// than the last-level cache, as a pool's pages are when an update lands;
// cold:0 writes the same pages every time, as cache-resident as it gets.
//
// GB/s are of the f16 input (quantize) or f16 output (dequantize), wall-clock:
// the shaders run on the driver's threads. KVCACHED_BENCH_STAGING=1 forces the
// staging path (device-local slabs), where only the shaders run.
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "gpu/device.h"
#include "gpu/page_pool.h"
#include "gpu/quantizer.h"

namespace kvcache::gpu {
namespace {

constexpr uint32_t kHeads = 8;
constexpr uint32_t kDim = 128;
constexpr uint32_t kPageTokens = 256;
constexpr uint64_t kPageBytes = 512 << 10;
// Pool memory the cold variants cycle through.
constexpr uint64_t kColdBytes = 256 << 20;

Device& BenchDevice() {
  static std::unique_ptr<Device> device = [] {
    DeviceOptions options;
    options.force_staging = std::getenv("KVCACHED_BENCH_STAGING") != nullptr;
    auto created = Device::Create(options);
    if (!created.ok()) {
      std::fprintf(stderr, "Device::Create: %s\n", created.status().ToString().c_str());
      std::exit(1);
    }
    return *std::move(created);
  }();
  return *device;
}

// CPU seconds of the whole process (lavapipe's threads included) so far.
double ProcessCpuSeconds() {
  timespec now;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return now.tv_sec + now.tv_nsec * 1e-9;
}

// Reports the process's CPU time per iteration since `start`: on a shared
// machine a steadier measure of the shader's cost than the wall clock.
void ReportProcessCpu(benchmark::State& state, double start) {
  state.counters["process_cpu_us"] =
      (ProcessCpuSeconds() - start) * 1e6 / static_cast<double>(state.iterations());
}

// An update of `tokens` tokens ([H, L, D] f16, gaussian values) and, for
// each of `copies` sets of pages, the runs that place it in pages of
// kPageTokens tokens.
struct Fixture {
  Fixture(uint32_t bits, uint64_t tokens, QuantKernel kernel, bool cold)
      : format{.dtype = DType::kFloat16, .dim = kDim, .group_size = 64, .bits = bits},
        input(tokens * kHeads * kDim * 2),
        output(input.size()) {
    const uint64_t page_count = (tokens + kPageTokens - 1) / kPageTokens;
    const uint64_t copies = cold ? std::max<uint64_t>(1, kColdBytes / (page_count * kPageBytes)) : 1;
    auto created = PagePool::Create(BenchDevice(), {.page_bytes = kPageBytes,
                                                    .budget_bytes = copies * page_count * kPageBytes,
                                                    .quantize_kernel = kernel});
    if (!created.ok()) return;
    pool = *std::move(created);
    if (!pool->Allocate(static_cast<uint32_t>(copies * page_count), pages).ok()) std::exit(1);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    for (size_t i = 0; i < input.size() / 2; ++i) {
      const _Float16 value = static_cast<_Float16>(normal(rng));
      std::memcpy(input.data() + 2 * i, &value, 2);
    }
    runs.resize(copies);
    for (uint64_t c = 0; c < copies; ++c) PlaceRuns(tokens, page_count, c);
    piece = input;
  }
  // Runs of copy `c`: one per head and page.
  void PlaceRuns(uint64_t tokens, uint64_t page_count, uint64_t c) {
    const uint64_t plane_rows = uint64_t{kHeads} * kPageTokens;
    for (uint32_t h = 0; h < kHeads; ++h) {
      for (uint64_t p = 0; p < page_count; ++p) {
        const uint64_t rows = std::min<uint64_t>(kPageTokens, tokens - p * kPageTokens);
        const uint64_t row = uint64_t{h} * kPageTokens;  // row of this head in a plane
        runs[c].push_back({pages[c * page_count + p], row * format.wq_row_bytes(),
                           plane_rows * format.wq_row_bytes() + row * format.scale_row_bytes(),
                           plane_rows * (format.wq_row_bytes() + format.scale_row_bytes()) +
                               row * format.scale_row_bytes(),
                           h * tokens + p * kPageTokens, static_cast<uint32_t>(rows)});
      }
    }
  }
  QuantizeJob Job(uint64_t copy) const { return {format, {&piece, 1}, runs[copy % runs.size()]}; }
  ~Fixture() {
    for (PageId page : pages) pool->Release(page);
  }
  // False (and the benchmark skipped) where the pool cannot run the kernel.
  bool Ready(benchmark::State& state) {
    if (pool == nullptr) state.SkipWithError("this path cannot run the kernel");
    return pool != nullptr;
  }

  QuantFormat format;
  std::vector<std::byte> input;
  std::vector<std::byte> output;
  absl::Span<const std::byte> piece;
  std::unique_ptr<PagePool> pool;
  std::vector<PageId> pages;
  std::vector<std::vector<QuantRun>> runs;  // per copy
};

QuantKernel KernelArg(const benchmark::State& state) {
  return state.range(2) == 0 ? QuantKernel::kShader : QuantKernel::kHost;
}

void BM_Quantize(benchmark::State& state) {
  Fixture f(static_cast<uint32_t>(state.range(0)), state.range(1), KernelArg(state),
            state.range(3) != 0);
  if (!f.Ready(state)) return;
  // Untimed: the first call builds the pipeline.
  const QuantizeJob first = f.Job(0);
  if (!f.pool->Quantize({&first, 1}).ok()) state.SkipWithError("Quantize failed");
  const double start = ProcessCpuSeconds();
  uint64_t copy = 0;
  for (auto _ : state) {
    const QuantizeJob job = f.Job(++copy);
    if (!f.pool->Quantize({&job, 1}).ok()) state.SkipWithError("Quantize failed");
  }
  ReportProcessCpu(state, start);
  state.SetBytesProcessed(state.iterations() * f.input.size());
}

void BM_Dequantize(benchmark::State& state) {
  Fixture f(static_cast<uint32_t>(state.range(0)), state.range(1), KernelArg(state),
            state.range(3) != 0);
  if (!f.Ready(state)) return;
  for (uint64_t c = 0; c < f.runs.size(); ++c) {
    const QuantizeJob job = f.Job(c);
    if (!f.pool->Quantize({&job, 1}).ok()) state.SkipWithError("Quantize failed");
  }
  const double start = ProcessCpuSeconds();
  uint64_t copy = 0;
  for (auto _ : state) {
    const DequantizeJob back{f.format, f.runs[++copy % f.runs.size()], absl::MakeSpan(f.output)};
    if (!f.pool->Dequantize({&back, 1}).ok()) state.SkipWithError("Dequantize failed");
    benchmark::DoNotOptimize(f.output.data());
  }
  ReportProcessCpu(state, start);
  state.SetBytesProcessed(state.iterations() * f.output.size());
}

// The ceiling: one memcpy thread moving the same f16 bytes, into the same
// destination (cold:0) or one cycling through kColdBytes (cold:1).
void BM_Memcpy(benchmark::State& state) {
  const uint64_t bytes = uint64_t{kHeads} * kDim * 2 * state.range(1);
  const uint64_t copies = state.range(2) != 0 ? std::max<uint64_t>(1, kColdBytes / bytes) : 1;
  std::vector<std::byte> src(bytes, std::byte{0x5a});
  std::vector<std::byte> dst(bytes * copies, std::byte{1});
  uint64_t copy = 0;
  for (auto _ : state) {
    std::memcpy(dst.data() + (++copy % copies) * bytes, src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

void Sizes(benchmark::internal::Benchmark* benchmark) {
  benchmark->ArgNames({"bits", "tokens", "cold"});
  for (int64_t cold : {0, 1}) {
    for (int64_t tokens : {256, 1024, 4096}) benchmark->Args({8, tokens, cold});
  }
  benchmark->UseRealTime()->Unit(benchmark::kMicrosecond);
}

void SizesAndKernels(benchmark::internal::Benchmark* benchmark) {
  benchmark->ArgNames({"bits", "tokens", "kernel", "cold"});
  for (int64_t kernel : {0, 1}) {
    for (int64_t cold : {0, 1}) {
      for (int64_t bits : {4, 8}) {
        for (int64_t tokens : {256, 1024, 4096}) benchmark->Args({bits, tokens, kernel, cold});
      }
    }
  }
  benchmark->UseRealTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_Memcpy)->Apply(Sizes);
BENCHMARK(BM_Quantize)->Apply(SizesAndKernels);
BENCHMARK(BM_Dequantize)->Apply(SizesAndKernels);

}  // namespace
}  // namespace kvcache::gpu

BENCHMARK_MAIN();
