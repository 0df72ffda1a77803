// Long random operation sequences with batch operations (extract / filter /
// merge / extend, mlx-lm BatchKVCache) among the usual ones, against the CPU
// reference (random_driver.h, reference_batch.h). Caches start batched (2 to 4
// rows) with left padding; partners of 1 to 3 rows with random padding are
// merged or appended; results are adopted, so batch sizes and padding keep
// changing (which changes how many tokens fit a page: rows move between pages
// of different sizes). Standard layers, rotating layers without sinks (the
// only kind that takes padding), one rotating layer with sinks (batched at
// equal lengths only), mixed caches, quantized layers (packed rows compared
// exactly), chunked layers and recurrent states.
//
// Direct path: 10,000 operations per configuration; staging paths: 1,000.
// KVCACHED_TEST_SEED=<n> changes every seed; a failure prints config, seed and
// operation index.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "chunked_recurrent_test_util.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "random_driver.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {
namespace {

using engine::CacheSpec;

constexpr uint64_t kPageBytes = 8 << 10;
constexpr uint64_t kBudgetBytes = 96 << 20;
constexpr uint64_t kFullOperations = 10000;
constexpr uint64_t kStagingOperations = 1000;

CacheSpec Padded(CacheSpec spec, std::vector<uint32_t> padding) {
  spec.batch_size = static_cast<uint32_t>(padding.size());
  spec.left_padding = std::move(padding);
  return spec;
}

RandomConfig Config(std::string name, CacheSpec spec, uint32_t page_tokens) {
  return RandomConfig{.name = std::move(name),
                      .spec = std::move(spec),
                      .page_tokens = page_tokens,
                      .batch_ops = true};
}

std::vector<RandomConfig> StandardConfigs() {
  return {
      Config(
          "bstd2L_p3_f16_pad205",
          Padded(MakeSpec({StandardLayerSpec(1, 4), StandardLayerSpec(2, 8, 4)}, DType::kFloat16),
                 {2, 0, 5}),
          3),
      Config("bstd1L_p16_f32_pad03",
             Padded(MakeSpec({StandardLayerSpec(2, 8, 4)}, DType::kFloat32), {0, 3}), 16),
      Config("bstd1L_p1_bf16_pad1104",
             Padded(MakeSpec({StandardLayerSpec(1, 4, 8)}, DType::kBFloat16), {1, 1, 0, 4}), 1),
  };
}

std::vector<RandomConfig> RotatingConfigs() {
  return {
      Config("brot7_p3_f16_pad049",
             Padded(MakeSpec({RotatingLayerSpec(1, 4, 0, 7, 0)}, DType::kFloat16), {0, 4, 9}), 3),
      Config("brot13_2L_p5_f32_pad30",
             Padded(MakeSpec({RotatingLayerSpec(2, 8, 4, 13, 0), RotatingLayerSpec(1, 4, 0, 8, 0)},
                             DType::kFloat32),
                    {3, 0}),
             5),
      Config("brot8_p16_bf16_pad2020",
             Padded(MakeSpec({RotatingLayerSpec(2, 4, 8, 8, 0)}, DType::kBFloat16), {2, 0, 2, 0}),
             16),
      // Sinks: no padding, so only equal lengths batch.
      Config(
          "brot8_k4_2L_p3_f16",
          MakeSpec({RotatingLayerSpec(1, 4, 0, 8, 4), StandardLayerSpec(1, 4)}, DType::kFloat16, 2),
          3),
  };
}

std::vector<RandomConfig> MixedConfigs() {
  return {
      Config("bmix2L_rot7_p5_f16_pad130",
             Padded(MakeSpec({StandardLayerSpec(2, 4), RotatingLayerSpec(1, 8, 4, 7, 0)},
                             DType::kFloat16),
                    {1, 3, 0}),
             5),
      Config("bmix3L_rot13_p3_f32_pad04",
             Padded(MakeSpec({RotatingLayerSpec(1, 4, 8, 13, 0), StandardLayerSpec(2, 8),
                              RotatingLayerSpec(2, 4, 0, 8, 0)},
                             DType::kFloat32),
                    {0, 4}),
             3),
  };
}

// Chunked layers (start positions right-aligned like windows) and recurrent
// ones (states picked by row) beside attention layers.
std::vector<RandomConfig> ChunkedAndRecurrentConfigs() {
  const engine::LayerSpec state = RecurrentLayerSpec(3, 8, 2, 4, 4);
  return {
      Config(
          "bchunk8_std_p3_f16_pad203",
          Padded(MakeSpec({ChunkedLayerSpec(1, 4, 0, 8), StandardLayerSpec(2, 4)}, DType::kFloat16),
                 {2, 0, 3}),
          3),
      Config("brec_std_p5_f32_pad10",
             Padded(MakeSpec({state, StandardLayerSpec(1, 8, 4)}, DType::kFloat32), {1, 0}), 5),
      Config(
          "brec_rot7_chunk5_p3_bf16_pad021",
          Padded(MakeSpec({state, RotatingLayerSpec(1, 4, 0, 7, 0), ChunkedLayerSpec(2, 4, 8, 5)},
                          DType::kBFloat16),
                 {0, 2, 1}),
          3),
  };
}

// Quantized layers: packed rows (wq, scales, biases) move between batches as
// stored, compared packed with the reference.
std::vector<RandomConfig> QuantizedConfigs() {
  const auto quantized = [](uint32_t heads, uint32_t k, uint32_t v, uint32_t group, uint32_t bits) {
    return engine::LayerSpec{.num_kv_heads = heads, .k_head_dim = k, .v_head_dim = v,
                             .kind = engine::QuantizedKind{.group_size = group, .bits = bits}};
  };
  return {
      Config("bq4_rot7_p3_f16_pad03",
             Padded(MakeSpec({quantized(2, 32, 64, 32, 4), RotatingLayerSpec(1, 4, 0, 7, 0)},
                             DType::kFloat16),
                    {0, 3}),
             3),
      Config("bstd_q8_p5_bf16_pad201",
             Padded(MakeSpec({StandardLayerSpec(1, 4), quantized(1, 64, 64, 64, 8)},
                             DType::kBFloat16),
                    {2, 0, 1}),
             5),
  };
}

uint64_t BaseSeed() {
  const char* env = std::getenv("KVCACHED_TEST_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : 20240611;
}

class EngineBatchRandomTest : public GpuTestBase {
 protected:
  void RunConfigs(std::vector<RandomConfig> configs) {
    const bool full = GetParam() == TransferPath::kDirect;
    for (size_t i = 0; i < configs.size(); ++i) {
      configs[i].operations = full ? kFullOperations : kStagingOperations;
      configs[i].seed = BaseSeed() + 7919 * i;
      RunOne(configs[i]);
      if (HasFailure()) return;
    }
  }

  void RunOne(const RandomConfig& config) {
    std::unique_ptr<gpu::PagePool> pool = MakePool(kPageBytes, kBudgetBytes);
    ASSERT_NE(pool, nullptr);
    {
      engine::Engine engine(*pool, engine::EngineOptions{.page_tokens = config.page_tokens});
      RandomDriver driver(engine, config);
      if (HasFailure()) return;
      driver.Run();
      driver.Finish();
      const RandomRunStats& s = driver.stats();
      std::printf(
          "[ %-30s ] seed %llu: %llu ops (%llu steps, %llu fetches, batch ops %llu ok / "
          "%llu refused, restores %llu ok / %llu refused)\n",
          config.name.c_str(), static_cast<unsigned long long>(config.seed),
          static_cast<unsigned long long>(s.operations), static_cast<unsigned long long>(s.steps),
          static_cast<unsigned long long>(s.fetches),
          static_cast<unsigned long long>(s.batch_ops_ok),
          static_cast<unsigned long long>(s.batch_ops_refused),
          static_cast<unsigned long long>(s.restores_ok),
          static_cast<unsigned long long>(s.restores_refused));
      PrintSpeculationStats(config, s);
      EXPECT_EQ(s.operations, config.operations) << config.name;
      ExpectSpeculationCoverage(config.name, s);
      // Each run exercises the batch operations, and the long ones their refusals.
      EXPECT_GT(s.batch_ops_ok, config.operations / 40) << config.name;
      if (config.operations >= kFullOperations) {
        EXPECT_GT(s.batch_ops_refused, 0u) << config.name;
      }
    }
    // Every page is back on the free list once snapshots and caches are gone.
    EXPECT_EQ(pool->stats().used_pages, 0u) << config.name;
  }
};

TEST_P(EngineBatchRandomTest, BatchedStandardLayers) { RunConfigs(StandardConfigs()); }
TEST_P(EngineBatchRandomTest, BatchedRotatingLayers) { RunConfigs(RotatingConfigs()); }
TEST_P(EngineBatchRandomTest, BatchedMixedLayers) { RunConfigs(MixedConfigs()); }
TEST_P(EngineBatchRandomTest, BatchedQuantizedLayers) { RunConfigs(QuantizedConfigs()); }
TEST_P(EngineBatchRandomTest, BatchedChunkedAndRecurrentLayers) {
  RunConfigs(ChunkedAndRecurrentConfigs());
}

INSTANTIATE_TEST_SUITE_P(TransferPaths, EngineBatchRandomTest,
                         ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
