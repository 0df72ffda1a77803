// Long random operation sequences against the CPU reference (random_driver.h).
//
// The configurations cover page token counts that do and do not divide the
// rotating window (1, 3, 5, 16 against max_size 7, 8, 13, 32), keep 0 and 4,
// batch 1 and 3, every dtype, 1-2 heads, small head dims with k != v sometimes,
// and caches mixing standard and rotating layers. Chunked layers (chunk sizes
// as the windows), recurrent layers (states of one page and of several), and
// two hybrid layouts: Qwen3-Next's 3 recurrent : 1 attention, and Llama 4's
// 3 chunked : 1 global beside a Gemma 3-like sliding window + chunked + global.
// Quantized layers (bits, group sizes, dtypes, Dk != Dv), alone and mixed, and
// hybrids whose later layers are quantized (after a global and a recurrent
// layer, or a sliding window and a chunked one).
// The direct transfer path runs the whole matrix (98 configurations) at 20,000
// operations each; the two staging paths (slower on lavapipe: a submission per
// transfer) run every third configuration of each group at 2,000.
//
// KVCACHED_TEST_SEED=<n> in the environment changes every seed (to explore);
// a failure prints the config, the seed and the operation index.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "chunked_recurrent_test_util.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "random_driver.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {
namespace {

using engine::CacheSpec;

constexpr uint64_t kPageBytes = 8 << 10;  // room for 16 tokens of the widest layer here
constexpr uint64_t kBudgetBytes = 96 << 20;
constexpr uint64_t kFullOperations = 20000;
constexpr uint64_t kStagingOperations = 2000;
constexpr size_t kStagingStride = 3;

struct ConfigSeed {
  std::string name;
  CacheSpec spec;
  uint32_t page_tokens;
};

// Cycled through by each group so that every dtype, batch 1 and 3, 1 and 2
// heads, head dims 4 and 8, and k_head_dim != v_head_dim all appear.
struct Variant {
  DType dtype;
  uint32_t batch;
  uint32_t heads;
  uint32_t k_dim;
  uint32_t v_dim;  // 0: same as k_dim
};
constexpr Variant kVariants[] = {
    {DType::kFloat16, 1, 1, 4, 0}, {DType::kFloat32, 3, 2, 8, 4}, {DType::kBFloat16, 1, 2, 4, 8},
    {DType::kFloat16, 3, 1, 8, 0}, {DType::kFloat32, 1, 1, 8, 8}, {DType::kBFloat16, 3, 2, 4, 0},
};
constexpr uint32_t kPageTokens[] = {1, 3, 5, 16};  // 16 > every window, 3 and 5 divide none
constexpr uint32_t kWindows[] = {7, 8, 13, 32};

std::string VariantName(const Variant& v) {
  return absl::StrCat(std::string(DTypeName(v.dtype)), "_b", v.batch, "_h", v.heads, "_d",
                      v.k_dim, "x",
                      v.v_dim == 0 ? v.k_dim : v.v_dim);
}

// page tokens x (one or two layers); the second layer has other dims.
std::vector<ConfigSeed> StandardConfigs() {
  std::vector<ConfigSeed> configs;
  for (uint32_t page_tokens : kPageTokens) {
    for (uint32_t layers : {1, 2}) {
      const Variant& v = kVariants[configs.size() % std::size(kVariants)];
      std::vector<engine::LayerSpec> specs = {StandardLayerSpec(v.heads, v.k_dim, v.v_dim)};
      if (layers == 2) specs.push_back(StandardLayerSpec(3 - v.heads, 12 - v.k_dim));
      configs.push_back({absl::StrCat("std", layers, "L_p", page_tokens, "_", VariantName(v)),
                         MakeSpec(specs, v.dtype, v.batch), page_tokens});
    }
  }
  return configs;
}

// page tokens x window, for one keep.
std::vector<ConfigSeed> RotatingConfigs(uint32_t keep) {
  std::vector<ConfigSeed> configs;
  for (uint32_t page_tokens : kPageTokens) {
    for (uint32_t window : kWindows) {
      const size_t i = configs.size();
      const Variant& v = kVariants[(i + i / 3 + keep) % std::size(kVariants)];
      configs.push_back(
          {absl::StrCat("rot", window, "_k", keep, "_p", page_tokens, "_", VariantName(v)),
           MakeSpec({RotatingLayerSpec(v.heads, v.k_dim, v.v_dim, window, keep)}, v.dtype,
                    v.batch),
           page_tokens});
    }
  }
  return configs;
}

// page tokens x two layouts: [standard, rotating] and [rotating, standard,
// rotating], windows and keeps varying.
std::vector<ConfigSeed> MixedConfigs() {
  std::vector<ConfigSeed> configs;
  for (uint32_t page_tokens : kPageTokens) {
    for (bool three_layers : {false, true}) {
      const size_t i = configs.size();
      const Variant& v = kVariants[i % std::size(kVariants)];
      const uint32_t window = kWindows[i % std::size(kWindows)];
      const uint32_t keep = i % 2 == 0 ? 4 : 0;
      std::vector<engine::LayerSpec> specs = {
          StandardLayerSpec(v.heads, v.k_dim, v.v_dim),
          RotatingLayerSpec(3 - v.heads, 12 - v.k_dim, 0, window, keep)};
      if (three_layers) {
        specs.insert(specs.begin(), RotatingLayerSpec(1, 4, 8, kWindows[(i + 1) % 4], 4 - keep));
      }
      configs.push_back({absl::StrCat("mix", specs.size(), "L_rot", window, "_k", keep, "_p",
                                      page_tokens, "_", VariantName(v)),
                         MakeSpec(specs, v.dtype, v.batch), page_tokens});
    }
  }
  return configs;
}

// page tokens x chunk size; every other one adds a second chunked layer with
// its own chunk size and dims.
std::vector<ConfigSeed> ChunkedConfigs() {
  std::vector<ConfigSeed> configs;
  for (uint32_t page_tokens : kPageTokens) {
    for (uint32_t chunk : kWindows) {
      const size_t i = configs.size();
      const Variant& v = kVariants[(i + i / 4) % std::size(kVariants)];
      std::vector<engine::LayerSpec> specs = {ChunkedLayerSpec(v.heads, v.k_dim, v.v_dim, chunk)};
      if (i % 2 == 1) {
        specs.push_back(ChunkedLayerSpec(3 - v.heads, 12 - v.k_dim, 0, chunk / 2 + 1));
      }
      configs.push_back({absl::StrCat("chunk", chunk, "_", specs.size(), "L_p", page_tokens, "_",
                                      VariantName(v)),
                         MakeSpec(specs, v.dtype, v.batch), page_tokens});
    }
  }
  return configs;
}

// A small state (one page) and one that spans several pages of kPageBytes at
// batch 3 in float32 (conv and delta both crossing page ends).
engine::LayerSpec SmallState() { return RecurrentLayerSpec(3, 8, 2, 4, 4); }
engine::LayerSpec LargeState() { return RecurrentLayerSpec(3, 20, 4, 16, 32); }

// Every variant's dtype and batch; one layer, or a large and a small one.
std::vector<ConfigSeed> RecurrentConfigs() {
  std::vector<ConfigSeed> configs;
  for (const Variant& v : kVariants) {
    const bool two = configs.size() % 2 == 1;
    std::vector<engine::LayerSpec> specs = {two ? LargeState() : SmallState()};
    if (two) specs.push_back(SmallState());
    configs.push_back({absl::StrCat("rec", specs.size(), "L_", VariantName(v)),
                       MakeSpec(specs, v.dtype, v.batch), 16});
  }
  return configs;
}

// Qwen3-Next: three recurrent layers, then one attention layer (standard, or
// a rotating window), for each page token count.
std::vector<ConfigSeed> RecurrentAttentionConfigs() {
  std::vector<ConfigSeed> configs;
  for (uint32_t page_tokens : kPageTokens) {
    for (bool rotating : {false, true}) {
      const size_t i = configs.size();
      const Variant& v = kVariants[i % std::size(kVariants)];
      const uint32_t window = kWindows[i % std::size(kWindows)];
      const engine::LayerSpec attention =
          rotating ? RotatingLayerSpec(v.heads, v.k_dim, v.v_dim, window, i % 4 == 1 ? 4 : 0)
                   : StandardLayerSpec(v.heads, v.k_dim, v.v_dim);
      std::vector<engine::LayerSpec> specs = {
          SmallState(), i % 3 == 0 ? LargeState() : SmallState(), SmallState(), attention};
      configs.push_back({absl::StrCat("qwen3next_", rotating ? "rot" : "std", "_p", page_tokens,
                                      "_", VariantName(v)),
                         MakeSpec(specs, v.dtype, v.batch), page_tokens});
    }
  }
  return configs;
}

// Llama 4: three chunked layers, then a global one; and a Gemma 3-like sliding
// window beside a chunked and a global layer.
std::vector<ConfigSeed> ChunkedAttentionConfigs() {
  std::vector<ConfigSeed> configs;
  for (uint32_t page_tokens : kPageTokens) {
    for (bool llama4 : {true, false}) {
      const size_t i = configs.size();
      const Variant& v = kVariants[(i + 3) % std::size(kVariants)];
      const uint32_t size = kWindows[i % std::size(kWindows)];
      std::vector<engine::LayerSpec> specs;
      if (llama4) {
        for (int c = 0; c < 3; ++c) {
          specs.push_back(ChunkedLayerSpec(v.heads, v.k_dim, v.v_dim, size));
        }
      } else {
        specs.push_back(RotatingLayerSpec(v.heads, v.k_dim, v.v_dim, size, i % 4 == 1 ? 4 : 0));
        specs.push_back(ChunkedLayerSpec(3 - v.heads, 12 - v.k_dim, 0, kWindows[(i + 1) % 4]));
      }
      specs.push_back(StandardLayerSpec(v.heads, v.k_dim, v.v_dim));
      configs.push_back({absl::StrCat(llama4 ? "llama4_chunk" : "swa_chunk_global_w", size, "_p",
                                      page_tokens, "_", VariantName(v)),
                         MakeSpec(specs, v.dtype, v.batch), page_tokens});
    }
  }
  return configs;
}

// Quantized layers (mlx-lm QuantizedKVCache): bits 4 and 8, group 32, 64 and
// 128, every dtype, Dk != Dv, batch 1 and 3, each page token count, alone and
// beside standard and rotating layers.
struct QuantizedSeed {
  uint32_t bits, group;
  DType dtype;
  uint32_t batch, heads, k_dim, v_dim, page_tokens;
  int neighbour;  // 0: none, 1: a standard layer after, 2: a rotating layer before
};
// Every third is what the staging paths run: f16, bf16 and f32 among them.
constexpr QuantizedSeed kQuantizedSeeds[] = {
    {8, 64, DType::kFloat16, 1, 2, 64, 64, 16, 0},   {4, 64, DType::kFloat16, 3, 2, 128, 64, 1, 0},
    {8, 128, DType::kFloat32, 1, 1, 128, 128, 3, 0}, {4, 32, DType::kBFloat16, 3, 1, 64, 32, 5, 0},
    {8, 32, DType::kBFloat16, 1, 2, 32, 96, 16, 0},  {8, 64, DType::kFloat16, 3, 1, 64, 128, 3, 1},
    {4, 128, DType::kFloat32, 3, 1, 128, 256, 5, 0}, {4, 32, DType::kBFloat16, 1, 2, 32, 32, 16, 2},
};

std::vector<ConfigSeed> QuantizedConfigs() {
  std::vector<ConfigSeed> configs;
  for (const QuantizedSeed& q : kQuantizedSeeds) {
    std::vector<engine::LayerSpec> specs = {
        engine::LayerSpec{.num_kv_heads = q.heads, .k_head_dim = q.k_dim, .v_head_dim = q.v_dim,
                          .kind = engine::QuantizedKind{.group_size = q.group, .bits = q.bits}}};
    if (q.neighbour == 1) specs.push_back(StandardLayerSpec(2, 8, 4));
    if (q.neighbour == 2) specs.insert(specs.begin(), RotatingLayerSpec(1, 8, 0, 13, 4));
    configs.push_back({absl::StrCat("quant", q.bits, "_g", q.group, "_", specs.size(), "L_p",
                                    q.page_tokens, "_", std::string(DTypeName(q.dtype)), "_b",
                                    q.batch, "_h", q.heads, "_d", q.k_dim, "x", q.v_dim),
                       MakeSpec(specs, q.dtype, q.batch), q.page_tokens});
  }
  return configs;
}

// Hybrids with quantized layers after the first few (as mlx-lm's
// quantized_kv_start leaves the first layers in full precision): a global layer
// and a recurrent one before them, or a sliding window and a chunked layer.
std::vector<ConfigSeed> HybridQuantizedConfigs() {
  std::vector<ConfigSeed> configs;
  for (uint32_t page_tokens : kPageTokens) {
    const size_t i = configs.size();
    const Variant& v = kVariants[(i * 2 + 1) % std::size(kVariants)];
    const engine::QuantizedKind quantized{.group_size = 32, .bits = i % 2 == 0 ? 4u : 8u};
    const engine::LayerSpec q{.num_kv_heads = 1, .k_head_dim = 32, .v_head_dim = 64,
                              .kind = quantized};
    std::vector<engine::LayerSpec> specs;
    if (i % 2 == 0) {
      specs = {StandardLayerSpec(v.heads, v.k_dim, v.v_dim), SmallState(), q, q};
    } else {
      specs = {RotatingLayerSpec(v.heads, v.k_dim, v.v_dim, kWindows[i], 0),
               ChunkedLayerSpec(1, 8, 4, kWindows[i - 1]), q, q};
    }
    configs.push_back({absl::StrCat(i % 2 == 0 ? "std_rec" : "rot_chunk", "_then_quant",
                                    quantized.bits, "_p", page_tokens, "_", VariantName(v)),
                       MakeSpec(specs, v.dtype, v.batch), page_tokens});
  }
  return configs;
}

uint64_t BaseSeed() {
  const char* env = std::getenv("KVCACHED_TEST_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : 20240611;
}

// FNV-1a: a seed per configuration that is the same with every standard library.
uint64_t NameHash(const std::string& name) {
  uint64_t hash = 14695981039346656037ull;
  for (char c : name) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return hash;
}

void PrintStats(const RandomConfig& config, const RandomRunStats& s) {
  std::printf("[ %-38s ] seed %llu: %llu ops (%llu steps, %llu states, %llu fetches, restores "
              "%llu ok / %llu refused, %llu merges, %llu splits, %llu other refusals)\n",
              config.name.c_str(), static_cast<unsigned long long>(config.seed),
              static_cast<unsigned long long>(s.operations),
              static_cast<unsigned long long>(s.steps),
              static_cast<unsigned long long>(s.state_updates),
              static_cast<unsigned long long>(s.fetches),
              static_cast<unsigned long long>(s.restores_ok),
              static_cast<unsigned long long>(s.restores_refused),
              static_cast<unsigned long long>(s.merges_ok),
              static_cast<unsigned long long>(s.splits_ok),
              static_cast<unsigned long long>(s.refusals));
  PrintSpeculationStats(config, s);
}

class EngineRandomTest : public GpuTestBase {
 protected:
  void RunConfigs(const std::vector<ConfigSeed>& seeds) {
    const bool full = GetParam() == TransferPath::kDirect;
    for (size_t i = 0; i < seeds.size(); ++i) {
      // Staging paths: every third configuration, which still spans every
      // page token count and window of the group.
      if (!full && i % kStagingStride != 0) continue;
      RandomConfig config{.name = seeds[i].name,
                          .spec = seeds[i].spec,
                          .page_tokens = seeds[i].page_tokens,
                          .operations = full ? kFullOperations : kStagingOperations,
                          .seed = BaseSeed() + NameHash(seeds[i].name) % 100000};
      RunOne(config);
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
      PrintStats(config, s);
      EXPECT_EQ(s.operations, config.operations) << config.name;
      // Each run reaches restores that succeed and ones that are refused.
      EXPECT_GT(s.restores_ok, 0u) << config.name;
      EXPECT_GT(s.restores_refused, 0u) << config.name;
      ExpectSpeculationCoverage(config.name, s);
      // Every page is back on the free list once snapshots and caches are gone.
      EXPECT_EQ(pool->stats().used_pages, 0u) << config.name;
    }
  }
};

TEST_P(EngineRandomTest, StandardLayers) { RunConfigs(StandardConfigs()); }
TEST_P(EngineRandomTest, RotatingLayersNoSinks) { RunConfigs(RotatingConfigs(0)); }
TEST_P(EngineRandomTest, RotatingLayersWithSinks) { RunConfigs(RotatingConfigs(4)); }
TEST_P(EngineRandomTest, MixedStandardAndRotatingLayers) { RunConfigs(MixedConfigs()); }
TEST_P(EngineRandomTest, ChunkedLayers) { RunConfigs(ChunkedConfigs()); }
TEST_P(EngineRandomTest, RecurrentLayers) { RunConfigs(RecurrentConfigs()); }
TEST_P(EngineRandomTest, RecurrentAndAttentionLayers) { RunConfigs(RecurrentAttentionConfigs()); }
TEST_P(EngineRandomTest, ChunkedSlidingAndGlobalLayers) { RunConfigs(ChunkedAttentionConfigs()); }
TEST_P(EngineRandomTest, QuantizedLayers) { RunConfigs(QuantizedConfigs()); }
TEST_P(EngineRandomTest, HybridLayersWithQuantizedAfterTheFirst) {
  RunConfigs(HybridQuantizedConfigs());
}

INSTANTIATE_TEST_SUITE_P(TransferPaths, EngineRandomTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
