// Quantize / dequantize shader throughput (gpu/quantizer.h) beside memcpy of
// the same bytes: one K (or V) update of 8 KV heads x head dim 128 x L tokens,
// f16, group 64, bits 4 and 8, laid out as the engine lays out a quantized
// layer (256 tokens a page, one run per head and page).
//
//   build/bench/gpu/gpu_quant_bench [--benchmark_filter=Quantize]
//
// GB/s are of the f16 input (quantize) or f16 output (dequantize), wall-clock:
// the shaders run on the driver's threads. KVCACHED_BENCH_STAGING=1 forces the
// staging path (device-local slabs); the shaders run the same either way.
#include <time.h>

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

// An update of `tokens` tokens ([H, L, D] f16, gaussian values) and the runs
// that place it in pages of kPageTokens tokens.
struct Fixture {
  Fixture(uint32_t bits, uint64_t tokens)
      : format{.dtype = DType::kFloat16, .dim = kDim, .group_size = 64, .bits = bits},
        input(tokens * kHeads * kDim * 2),
        output(input.size()) {
    auto created = PagePool::Create(BenchDevice(),
                                    {.page_bytes = kPageBytes, .budget_bytes = 64 * kPageBytes});
    if (!created.ok()) std::exit(1);
    pool = *std::move(created);
    const uint64_t page_count = (tokens + kPageTokens - 1) / kPageTokens;
    if (!pool->Allocate(static_cast<uint32_t>(page_count), pages).ok()) std::exit(1);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;
    for (size_t i = 0; i < input.size() / 2; ++i) {
      const _Float16 value = static_cast<_Float16>(normal(rng));
      std::memcpy(input.data() + 2 * i, &value, 2);
    }
    const uint64_t plane_rows = uint64_t{kHeads} * kPageTokens;
    for (uint32_t h = 0; h < kHeads; ++h) {
      for (uint64_t p = 0; p < page_count; ++p) {
        const uint64_t rows = std::min<uint64_t>(kPageTokens, tokens - p * kPageTokens);
        const uint64_t row = uint64_t{h} * kPageTokens;  // row of this head in a plane
        runs.push_back({pages[p], row * format.wq_row_bytes(),
                        plane_rows * format.wq_row_bytes() + row * format.scale_row_bytes(),
                        plane_rows * (format.wq_row_bytes() + format.scale_row_bytes()) +
                            row * format.scale_row_bytes(),
                        h * tokens + p * kPageTokens, static_cast<uint32_t>(rows)});
      }
    }
    piece = input;
  }
  ~Fixture() {
    for (PageId page : pages) pool->Release(page);
  }

  QuantFormat format;
  std::vector<std::byte> input;
  std::vector<std::byte> output;
  absl::Span<const std::byte> piece;
  std::unique_ptr<PagePool> pool;
  std::vector<PageId> pages;
  std::vector<QuantRun> runs;
};

void BM_Quantize(benchmark::State& state) {
  Fixture f(static_cast<uint32_t>(state.range(0)), state.range(1));
  const QuantizeJob job{f.format, {&f.piece, 1}, f.runs};
  // Untimed: the first call builds the pipeline.
  if (!f.pool->Quantize({&job, 1}).ok()) state.SkipWithError("Quantize failed");
  const double start = ProcessCpuSeconds();
  for (auto _ : state) {
    if (!f.pool->Quantize({&job, 1}).ok()) state.SkipWithError("Quantize failed");
  }
  ReportProcessCpu(state, start);
  state.SetBytesProcessed(state.iterations() * f.input.size());
}

void BM_Dequantize(benchmark::State& state) {
  Fixture f(static_cast<uint32_t>(state.range(0)), state.range(1));
  const QuantizeJob job{f.format, {&f.piece, 1}, f.runs};
  if (!f.pool->Quantize({&job, 1}).ok()) state.SkipWithError("Quantize failed");
  const DequantizeJob back{f.format, f.runs, absl::MakeSpan(f.output)};
  if (!f.pool->Dequantize({&back, 1}).ok()) state.SkipWithError("Dequantize failed");
  const double start = ProcessCpuSeconds();
  for (auto _ : state) {
    if (!f.pool->Dequantize({&back, 1}).ok()) state.SkipWithError("Dequantize failed");
    benchmark::DoNotOptimize(f.output.data());
  }
  ReportProcessCpu(state, start);
  state.SetBytesProcessed(state.iterations() * f.output.size());
}

// The ceiling: one memcpy thread moving the same f16 bytes.
void BM_Memcpy(benchmark::State& state) {
  const uint64_t bytes = uint64_t{kHeads} * kDim * 2 * state.range(1);
  std::vector<std::byte> src(bytes, std::byte{0x5a});
  std::vector<std::byte> dst(bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

void Sizes(benchmark::internal::Benchmark* benchmark) {
  benchmark->ArgNames({"bits", "tokens"});
  for (int64_t bits : {4, 8}) {
    for (int64_t tokens : {256, 1024, 4096}) benchmark->Args({bits, tokens});
  }
  benchmark->UseRealTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_Memcpy)->Apply(Sizes);
BENCHMARK(BM_Quantize)->Apply(Sizes);
BENCHMARK(BM_Dequantize)->Apply(Sizes);

}  // namespace
}  // namespace kvcache::gpu

BENCHMARK_MAIN();
