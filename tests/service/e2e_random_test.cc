// Random operation sequences through the client library, over a real
// loopback port, against the CPU reference (wire_driver.h): standard,
// rotating (keep 0 and 4, windows that page tokens do not divide) and mixed
// caches, on the direct and a staging transfer path; then two clients at once,
// each on its own cache with its own sequence and reference.
//
// KVCACHED_TEST_SEED=<n> in the environment changes every seed (to explore);
// a failure prints the configuration, the seed and the operation index.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "e2e_test_util.h"
#include "gtest/gtest.h"
#include "wire_driver.h"

namespace kvcache::testing {
namespace {

constexpr uint64_t kOperations = 4000;
constexpr uint64_t kConcurrentOperations = 1500;

struct E2eConfig {
  std::string name;
  engine::CacheSpec spec;
  uint32_t page_tokens;
};

// Two layers at least, so that steps can tear; the second layer's geometry
// differs from the first's.
const std::vector<E2eConfig>& Configs() {
  static const auto* configs = new std::vector<E2eConfig>{
      {"Standard", MakeSpec({StandardLayerSpec(2, 8), StandardLayerSpec(1, 8, 4)}), 3},
      {"RotatingNoSinks",
       MakeSpec({RotatingLayerSpec(1, 8, 0, 7, 0), RotatingLayerSpec(2, 4, 8, 7, 0)},
                DType::kFloat32, 3),
       5},
      {"RotatingWithSinks",
       MakeSpec({RotatingLayerSpec(2, 4, 0, 13, 4), RotatingLayerSpec(1, 8, 4, 13, 4)},
                DType::kBFloat16, 2),
       5},
      {"Mixed",
       MakeSpec({StandardLayerSpec(1, 8), RotatingLayerSpec(2, 4, 0, 10, 4),
                 RotatingLayerSpec(1, 4, 8, 7, 0)}),
       4},
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
      "[ %-30s ] seed %llu: %llu ops (%llu steps, %llu failed streams, %llu torn, "
      "%llu+%llu fetches, restores %llu ok / %llu refused, %llu merges, %llu splits, "
      "%llu other refusals)\n",
      config.name.c_str(), static_cast<unsigned long long>(config.seed),
      static_cast<unsigned long long>(s.operations), static_cast<unsigned long long>(s.steps),
      static_cast<unsigned long long>(s.failed_streams),
      static_cast<unsigned long long>(s.torn_steps), static_cast<unsigned long long>(s.fetches),
      static_cast<unsigned long long>(s.snapshot_fetches),
      static_cast<unsigned long long>(s.restores_ok),
      static_cast<unsigned long long>(s.restores_refused),
      static_cast<unsigned long long>(s.merges_ok), static_cast<unsigned long long>(s.splits_ok),
      static_cast<unsigned long long>(s.refusals));
}

void ExpectEveryPathTaken(const WireRunStats& s) {
  EXPECT_GT(s.failed_streams, 0u);
  EXPECT_GT(s.torn_steps, 0u);
  EXPECT_GT(s.restores_ok, 0u);
  EXPECT_GT(s.restores_refused, 0u);
  EXPECT_GT(s.merges_ok, 0u);
  EXPECT_GT(s.splits_ok, 0u);
  EXPECT_GT(s.snapshot_fetches, 0u);
}

class E2eRandomTest : public ::testing::TestWithParam<std::tuple<TransferPath, size_t>> {
 protected:
  void SetUp() override {
    server_ =
        TestServer::Start({.path = std::get<0>(GetParam()), .page_tokens = config().page_tokens});
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    if (server_) server_->CleanUpAndCheck();
  }
  const E2eConfig& config() const { return Configs()[std::get<1>(GetParam())]; }

  std::unique_ptr<TestServer> server_;
};

TEST_P(E2eRandomTest, MatchesReference) {
  const std::string name = config().name + "_" + TransferPathName(std::get<0>(GetParam()));
  const WireConfig wire{
      .name = name, .spec = config().spec, .operations = kOperations, .seed = Seed(name)};
  WireDriver driver(server_->client(), wire);
  ASSERT_FALSE(HasFailure());
  driver.Run();
  driver.Finish();
  PrintStats(wire, driver.stats());
  ASSERT_EQ(driver.stats().operations, kOperations);
  ExpectEveryPathTaken(driver.stats());
}

INSTANTIATE_TEST_SUITE_P(PathsAndCaches, E2eRandomTest,
                         ::testing::Combine(::testing::ValuesIn(kE2ePaths),
                                            ::testing::Values(0, 1, 2, 3)),
                         [](const auto& info) {
                           return Configs()[std::get<1>(info.param)].name + "_" +
                                  TransferPathName(std::get<0>(info.param));
                         });

using E2eConcurrencyTest = E2eTest;

// Two clients, each with its own connection, cache, sequence and reference,
// at the same time: neither sees the other's work.
TEST_P(E2eConcurrencyTest, TwoClientsOnSeparateCaches) {
  const std::vector<WireConfig> configs = {{.name = "ClientA_Mixed",
                                            .spec = Configs()[3].spec,
                                            .operations = kConcurrentOperations,
                                            .seed = Seed("ClientA")},
                                           {.name = "ClientB_RotatingWithSinks",
                                            .spec = Configs()[2].spec,
                                            .operations = kConcurrentOperations,
                                            .seed = Seed("ClientB")}};
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::unique_ptr<WireDriver>> drivers;
  for (const WireConfig& config : configs) {
    clients.push_back(server_->Connect(/*dedicated=*/true));
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
