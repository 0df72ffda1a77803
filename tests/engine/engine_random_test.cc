// Long random operation sequences against the CPU reference (random_driver.h).
//
// The configurations cover page token counts that do and do not divide the
// rotating window (1, 3, 5, 16 against max_size 7, 8, 13, 32), keep 0 and 4,
// batch 1 and 3, every dtype, 1-2 heads, small head dims with k != v sometimes,
// and caches mixing standard and rotating layers. The direct transfer path runs
// the whole matrix (48 configurations) at 20,000 operations each; the two
// staging paths (slower on lavapipe: a submission per transfer) run every third
// configuration of each group at 2,000.
//
// KVCACHED_TEST_SEED=<n> in the environment changes every seed (to explore);
// a failure prints the config, the seed and the operation index.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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
  std::printf("[ %-38s ] seed %llu: %llu ops (%llu updates, %llu fetches, restores %llu ok / "
              "%llu refused, %llu merges, %llu splits, %llu other refusals)\n",
              config.name.c_str(), static_cast<unsigned long long>(config.seed),
              static_cast<unsigned long long>(s.operations),
              static_cast<unsigned long long>(s.updates),
              static_cast<unsigned long long>(s.fetches),
              static_cast<unsigned long long>(s.restores_ok),
              static_cast<unsigned long long>(s.restores_refused),
              static_cast<unsigned long long>(s.merges_ok),
              static_cast<unsigned long long>(s.splits_ok),
              static_cast<unsigned long long>(s.refusals));
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
      // Every page is back on the free list once snapshots and caches are gone.
      EXPECT_EQ(pool->stats().used_pages, 0u) << config.name;
    }
  }
};

TEST_P(EngineRandomTest, StandardLayers) { RunConfigs(StandardConfigs()); }
TEST_P(EngineRandomTest, RotatingLayersNoSinks) { RunConfigs(RotatingConfigs(0)); }
TEST_P(EngineRandomTest, RotatingLayersWithSinks) { RunConfigs(RotatingConfigs(4)); }
TEST_P(EngineRandomTest, MixedStandardAndRotatingLayers) { RunConfigs(MixedConfigs()); }

INSTANTIATE_TEST_SUITE_P(TransferPaths, EngineRandomTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
