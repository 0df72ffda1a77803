// Random operation sequences through the client library, over a real
// loopback port, against the CPU reference (wire_driver.h): every cache kind
// end to end. Standard, rotating (keep 0 and 4, windows that page
// tokens do not divide) and standard+rotating caches; quantized (bits 4 and
// 8, groups 32 and 64, Dk != Dv), chunked and recurrent layers; batched
// caches with left padding and the batch RPCs (standard + rotating, and
// recurrent + quantized + chunked); and two hybrid layouts: Qwen3-Next-like
// (three recurrent layers, one global) and Gemma 3-like (a sliding window with
// sinks, a global layer, a quantized one). Each runs on the direct transfer
// path; the first four also on a staging path. Then two clients at once, each
// on its own cache with its own sequence and reference. About 5% of the
// operations are speculation rounds (tests/engine/driver_core_speculation.cc)
// against reference_speculation.h, on every configuration, batched included.
//
// KVCACHED_E2E_OPS=<n> sets the operations per configuration (default 10,000: about 3 to 6 s per configuration on 2 cores).
// KVCACHED_TEST_SEED=<n> changes every seed (to explore); a failure prints the
// configuration, the seed and the operation index.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <tuple>
#include <variant>
#include <vector>

#include "chunked_recurrent_test_util.h"
#include "e2e_test_util.h"
#include "gtest/gtest.h"
#include "wire_driver.h"

namespace kvcache::testing {
namespace {

constexpr uint64_t kDefaultOperations = 10000;
constexpr uint64_t kConcurrentOperations = 1500;

// Operations per configuration: KVCACHED_E2E_OPS, else kDefaultOperations.
uint64_t Operations() {
  const char* env = std::getenv("KVCACHED_E2E_OPS");
  const uint64_t ops = env != nullptr ? std::strtoull(env, nullptr, 10) : 0;
  return ops > 0 ? ops : kDefaultOperations;
}

struct E2eConfig {
  std::string name;
  engine::CacheSpec spec;
  uint32_t page_tokens;
  bool batch_ops = false;
  bool staging_too = false;  // also run on the staging transfer path
  bool lane_too = false;     // also run with Update and Fetch on the data lane
};

engine::LayerSpec Quantized(uint32_t heads, uint32_t k_dim, uint32_t v_dim, uint32_t group,
                            uint32_t bits) {
  return engine::LayerSpec{.num_kv_heads = heads, .k_head_dim = k_dim, .v_head_dim = v_dim,
                           .kind = engine::QuantizedKind{.group_size = group, .bits = bits}};
}

engine::CacheSpec Padded(engine::CacheSpec spec, std::vector<uint32_t> padding) {
  spec.batch_size = static_cast<uint32_t>(padding.size());
  spec.left_padding = std::move(padding);
  return spec;
}

// A small recurrent state (one page), and one spanning several 8 KiB pages.
engine::LayerSpec SmallState() { return RecurrentLayerSpec(3, 8, 2, 4, 4); }
engine::LayerSpec LargeState() { return RecurrentLayerSpec(3, 20, 4, 16, 32); }

// Two layers at least, so that steps can tear; the second layer's geometry
// differs from the first's.
const std::vector<E2eConfig>& Configs() {
  static const auto* configs = new std::vector<E2eConfig>{
      {"Standard", MakeSpec({StandardLayerSpec(2, 8), StandardLayerSpec(1, 8, 4)}), 3, false,
       true, true},
      {"RotatingNoSinks",
       MakeSpec({RotatingLayerSpec(1, 8, 0, 7, 0), RotatingLayerSpec(2, 4, 8, 7, 0)},
                DType::kFloat32, 3),
       5, false, true},
      {"RotatingWithSinks",
       MakeSpec({RotatingLayerSpec(2, 4, 0, 13, 4), RotatingLayerSpec(1, 8, 4, 13, 4)},
                DType::kBFloat16, 2),
       5, false, true, true},
      {"Mixed",
       MakeSpec({StandardLayerSpec(1, 8), RotatingLayerSpec(2, 4, 0, 10, 4),
                 RotatingLayerSpec(1, 4, 8, 7, 0)}),
       4, false, true},
      {"Quantized",
       MakeSpec({Quantized(2, 64, 32, 32, 4), Quantized(1, 64, 64, 64, 8)}, DType::kFloat16, 2),
       5},
      {"Chunked",
       MakeSpec({ChunkedLayerSpec(1, 8, 0, 7), ChunkedLayerSpec(2, 4, 8, 5)}, DType::kBFloat16),
       3},
      {"Recurrent", MakeSpec({LargeState(), SmallState()}, DType::kFloat32, 2), 16, false, false,
       true},
      {"Batched",
       Padded(MakeSpec({StandardLayerSpec(1, 4), RotatingLayerSpec(2, 4, 8, 7, 0)},
                       DType::kFloat16),
              {2, 0, 3}),
       3, true},
      {"BatchedHybrid",
       Padded(MakeSpec({SmallState(), Quantized(1, 32, 32, 32, 4), ChunkedLayerSpec(2, 4, 8, 5)},
                       DType::kBFloat16),
              {0, 2, 1}),
       3, true, false, true},
      {"Qwen3NextLike",
       MakeSpec({SmallState(), LargeState(), SmallState(), StandardLayerSpec(2, 8)},
                DType::kBFloat16),
       4},
      {"Gemma3Like",
       MakeSpec({RotatingLayerSpec(1, 8, 0, 13, 4), StandardLayerSpec(2, 8, 4),
                 Quantized(1, 32, 64, 32, 4)},
                DType::kFloat16),
       5, false, false, true},
  };
  return *configs;
}

uint64_t Seed(const std::string& name) {
  const char* env = std::getenv("KVCACHED_TEST_SEED");
  uint64_t hash = 14695981039346656037ull;  // FNV-1a: the same with every standard library
  for (char c : name) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return (env != nullptr ? std::strtoull(env, nullptr, 10) : 20240611) + hash % 100000;
}

void PrintStats(const WireConfig& config, const WireRunStats& s) {
  std::printf(
      "[ %-38s ] seed %llu: %llu ops (%llu steps, %llu failed streams, %llu torn, "
      "%llu+%llu fetches, %llu packed, %llu states, %llu wrong-kind streams, restores %llu ok / "
      "%llu refused, %llu merges, %llu splits, batch ops %llu ok / %llu refused, %llu other "
      "refusals)\n",
      config.name.c_str(), static_cast<unsigned long long>(config.seed),
      static_cast<unsigned long long>(s.operations), static_cast<unsigned long long>(s.steps),
      static_cast<unsigned long long>(s.failed_streams),
      static_cast<unsigned long long>(s.torn_steps), static_cast<unsigned long long>(s.fetches),
      static_cast<unsigned long long>(s.snapshot_fetches),
      static_cast<unsigned long long>(s.packed_fetches),
      static_cast<unsigned long long>(s.state_updates),
      static_cast<unsigned long long>(s.wrong_kind_streams),
      static_cast<unsigned long long>(s.restores_ok),
      static_cast<unsigned long long>(s.restores_refused),
      static_cast<unsigned long long>(s.merges_ok), static_cast<unsigned long long>(s.splits_ok),
      static_cast<unsigned long long>(s.batch_ops_ok),
      static_cast<unsigned long long>(s.batch_ops_refused),
      static_cast<unsigned long long>(s.refusals));
  PrintSpeculationStats(config, s);
}

// Every run reaches each path its cache allows (long runs only: a short one
// may miss a rare path by chance).
void ExpectEveryPathTaken(const E2eConfig& config, const WireRunStats& s) {
  if (s.operations < 1000) return;
  EXPECT_GT(s.failed_streams, 0u);
  EXPECT_GT(s.wrong_kind_streams, 0u);
  EXPECT_GT(s.torn_steps, 0u);
  EXPECT_GT(s.restores_ok, 0u);
  EXPECT_GT(s.restores_refused, 0u);
  EXPECT_GT(s.merges_ok, 0u);
  EXPECT_GT(s.splits_ok, 0u);
  EXPECT_GT(s.snapshot_fetches, 0u);
  const auto has = [&](auto kind) {
    return std::any_of(config.spec.layers.begin(), config.spec.layers.end(),
                       [&](const engine::LayerSpec& l) {
                         return std::holds_alternative<decltype(kind)>(l.kind);
                       });
  };
  if (has(engine::QuantizedKind{})) {
    EXPECT_GT(s.packed_fetches, 0u);
  }
  if (has(engine::RecurrentKind{})) {
    EXPECT_GT(s.state_updates, 0u);
  }
  if (config.batch_ops) {
    EXPECT_GT(s.batch_ops_ok, s.operations / 40);
    EXPECT_GT(s.batch_ops_refused, 0u);
  }
  // Speculation rounds: about 5% of the operations, every way of ending them.
  ExpectSpeculationCoverage(config.name, s);
  EXPECT_GT(s.speculations_committed, s.operations / 60);
  EXPECT_GT(s.page_checks, s.speculations_committed / 2);
}

// (transfer path, configuration, Update and Fetch on the data lane)
using RandomRun = std::tuple<TransferPath, size_t, bool>;

std::string RunName(const RandomRun& run) {
  return Configs()[std::get<1>(run)].name + "_" + TransferPathName(std::get<0>(run)) +
         (std::get<2>(run) ? "_DataLane" : "");
}

class E2eRandomTest : public ::testing::TestWithParam<RandomRun> {
 protected:
  void SetUp() override {
    server_ = TestServer::Start({.path = std::get<0>(GetParam()),
                                 .page_tokens = config().page_tokens,
                                 .client_on_lane = std::get<2>(GetParam())});
    ASSERT_NE(server_, nullptr);
    ASSERT_EQ(server_->client().uses_data_lane(), std::get<2>(GetParam()));
  }
  void TearDown() override {
    if (server_) server_->CleanUpAndCheck();
  }
  const E2eConfig& config() const { return Configs()[std::get<1>(GetParam())]; }

  std::unique_ptr<TestServer> server_;
};

TEST_P(E2eRandomTest, MatchesReference) {
  const std::string name = RunName(GetParam());
  const WireConfig wire{.name = name,
                        .spec = config().spec,
                        .operations = Operations(),
                        .seed = Seed(name),
                        .batch_ops = config().batch_ops};
  WireDriver driver(server_->client(), wire);
  ASSERT_FALSE(HasFailure());
  driver.Run();
  driver.Finish();
  PrintStats(wire, driver.stats());
  ASSERT_EQ(driver.stats().operations, wire.operations);
  ExpectEveryPathTaken(config(), driver.stats());
}

// Every configuration on the direct path over gRPC; those marked staging_too
// also on the staging path (the new kinds' transfers are the same copies,
// which the engine suites run on every path), those marked lane_too also with
// Update and Fetch on the data lane.
std::vector<RandomRun> Runs() {
  std::vector<RandomRun> runs;
  for (size_t i = 0; i < Configs().size(); ++i) {
    runs.emplace_back(TransferPath::kDirect, i, false);
    if (Configs()[i].staging_too) runs.emplace_back(TransferPath::kStagingRegions, i, false);
    if (Configs()[i].lane_too) runs.emplace_back(TransferPath::kDirect, i, true);
  }
  return runs;
}

INSTANTIATE_TEST_SUITE_P(PathsAndCaches, E2eRandomTest, ::testing::ValuesIn(Runs()),
                         [](const auto& info) { return RunName(info.param); });

using E2eConcurrencyTest = E2eTest;

// Two clients, each with its own connection, cache, sequence and reference,
// at the same time: neither sees the other's work. The second sends its
// Updates and Fetches over the data lane.
TEST_P(E2eConcurrencyTest, TwoClientsOnSeparateCaches) {
  const std::vector<WireConfig> configs = {{.name = "ClientA_Mixed",
                                            .spec = Configs()[3].spec,
                                            .operations = kConcurrentOperations,
                                            .seed = Seed("ClientA"),
                                            .shares_server = true},
                                           {.name = "ClientB_RotatingWithSinks",
                                            .spec = Configs()[2].spec,
                                            .operations = kConcurrentOperations,
                                            .seed = Seed("ClientB"),
                                            .shares_server = true}};
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::unique_ptr<WireDriver>> drivers;
  for (const WireConfig& config : configs) {
    clients.push_back(server_->Connect(/*dedicated=*/true, clients.empty() ? "" : "auto"));
    drivers.push_back(std::make_unique<WireDriver>(*clients.back(), config));
  }
  ASSERT_FALSE(HasFailure());
  std::vector<std::thread> threads;
  for (auto& driver : drivers) threads.emplace_back([&driver] { driver->Run(); });
  for (std::thread& thread : threads) thread.join();
  for (size_t i = 0; i < drivers.size(); ++i) {
    drivers[i]->Finish();
    PrintStats(configs[i], drivers[i]->stats());
    EXPECT_EQ(drivers[i]->stats().operations, kConcurrentOperations) << configs[i].name;
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, E2eConcurrencyTest, ::testing::ValuesIn(kE2ePaths), PathTestName);

}  // namespace
}  // namespace kvcache::testing
