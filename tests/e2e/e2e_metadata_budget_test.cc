// The metadata budget through a whole server: caches and snapshots past
// --metadata_bytes are RESOURCE_EXHAUSTED naming it and change nothing;
// GetStats reports what is charged and the budget; deleting gives room back.
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service_test_util.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;

TEST(E2eMetadataBudgetTest, HandlesPastTheBudgetAreRefusedNamingIt) {
  constexpr uint64_t kMetadataBytes = 1 << 20;
  auto server = TestServer::Start(ServerSetup{.metadata_bytes = kMetadataBytes});
  ASSERT_NE(server, nullptr);
  Client& client = server->client();
  auto before = client.GetStats();
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->max_metadata_bytes(), kMetadataBytes);
  EXPECT_GT(before->metadata_bytes(), 0u) << "the pool's page tables are reserved";

  const v1::CacheSpec spec = ProtoSpec(256, 1, 8);
  std::vector<std::string> caches;
  absl::Status refused;
  while (refused.ok() && caches.size() < 64) {
    auto cache = client.CreateCache(spec);
    if (cache.ok()) caches.push_back(cache->cache_id());
    refused = cache.status();
  }
  ASSERT_FALSE(caches.empty());
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("metadata_bytes"));
  EXPECT_THAT(refused.message(), HasSubstr("raise --metadata_bytes"));
  auto full = client.GetStats();
  ASSERT_TRUE(full.ok());
  EXPECT_EQ(full->caches(), caches.size()) << "a refused cache was created";
  EXPECT_LE(full->metadata_bytes(), kMetadataBytes);

  // Snapshots are charged too: of a cache holding a token, in what room is
  // left, some fit, then one is refused.
  std::vector<v1::UpdateRequest> requests;
  std::vector<LayerUpdate> updates;
  std::mt19937_64 rng(5);
  for (int layer = 0; layer < spec.layers_size(); ++layer) {
    requests.push_back(RandomUpdate(caches[0], spec, layer, 1, rng));
  }
  for (const v1::UpdateRequest& request : requests) updates.push_back(ToLayerUpdate(request));
  ASSERT_TRUE(client.Update(caches[0], updates).ok());
  std::vector<std::string> snapshots;
  absl::Status snapshot_refused;
  while (snapshot_refused.ok() && snapshots.size() < 1000) {
    auto snapshot = client.Snapshot(caches[0]);
    if (snapshot.ok()) snapshots.push_back(snapshot->snapshot_id());
    snapshot_refused = snapshot.status();
  }
  EXPECT_EQ(snapshot_refused.code(), absl::StatusCode::kResourceExhausted) << snapshot_refused;
  EXPECT_THAT(snapshot_refused.message(), HasSubstr("metadata_bytes"));
  for (const std::string& id : snapshots) ASSERT_TRUE(client.ReleaseSnapshot(id).ok());

  for (const std::string& id : caches) ASSERT_TRUE(client.DeleteCache(id).ok());
  auto after = client.GetStats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->metadata_bytes(), before->metadata_bytes()) << "charges not returned";
  EXPECT_TRUE(client.CreateCache(spec).ok()) << "deleting gave no room back";
  server->CleanUpAndCheck();
}

// A tenant held by its own max_metadata_bytes is told so: raising the
// server's flag would not help it.
TEST(E2eMetadataBudgetTest, ATenantsOwnQuotaIsNamedInItsRefusals) {
  const std::string dir = ::testing::TempDir() + "/kvcached-metadata-" +
                          std::to_string(std::random_device()());
  std::filesystem::create_directories(dir);
  constexpr char kToken[] = "alice-token-0123456789abcdef";
  std::ofstream(dir + "/tokens") << "tenant=alice token=" << kToken
                                 << " max_metadata_bytes=60000\n";
  // A small pool, so that its page tables (reserved in every tenant's
  // budget) leave room for caches.
  auto server = TestServer::Start(
      {.budget_bytes = 1 << 20, .tokens_file = dir + "/tokens", .token = kToken});
  ASSERT_NE(server, nullptr);
  std::vector<std::string> caches;
  absl::Status refused;
  while (refused.ok() && caches.size() < 256) {
    auto cache = server->client().CreateCache(ProtoSpec(2, 1, 8));
    if (cache.ok()) caches.push_back(cache->cache_id());
    refused = cache.status();
  }
  EXPECT_FALSE(caches.empty()) << refused;
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("max_metadata_bytes: tenant alice's quota"));
  EXPECT_THAT(refused.message(), HasSubstr("of 60000 are in use"));
  EXPECT_THAT(refused.message(), ::testing::Not(HasSubstr("--metadata_bytes")));
  server->CleanUpAndCheck();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvcache::testing
