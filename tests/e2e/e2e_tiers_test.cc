// Tiers through a whole server: a small device pool with host memory and a
// disk tier (--host_bytes, --data_dir) holds three times its size in
// snapshots; pages move down as new work needs the device, GetStats and
// SnapshotInfo say where they are, and every snapshot reads back over the
// wire byte for byte, from whichever tier. Saved files share --disk_bytes.
#include <unistd.h>

#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service_test_util.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kPageBytes = 8 << 10;
constexpr uint64_t kDevicePages = 32;

class E2eTiersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_dir_ = std::filesystem::path(::testing::TempDir()) /
                absl::StrCat("kvcached-e2e-tiers-", ::getpid());
    std::filesystem::remove_all(data_dir_);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->CleanUpAndCheck();
    server_.reset();
    std::filesystem::remove_all(data_dir_);
  }

  // A snapshot of `tokens` tokens whose cache is gone.
  std::string OrphanSnapshot(const v1::CacheSpec& spec, uint64_t tokens, std::mt19937_64& rng) {
    Client& client = server_->client();
    auto cache = client.CreateCache(spec);
    EXPECT_TRUE(cache.ok()) << cache.status();
    std::vector<v1::UpdateRequest> requests;
    for (int layer = 0; layer < spec.layers_size(); ++layer) {
      requests.push_back(RandomUpdate(cache->cache_id(), spec, layer, tokens, rng));
    }
    std::vector<LayerUpdate> updates;
    for (const v1::UpdateRequest& request : requests) updates.push_back(ToLayerUpdate(request));
    const absl::Status updated = client.Update(cache->cache_id(), updates).status();
    EXPECT_TRUE(updated.ok()) << updated;
    auto snapshot = client.Snapshot(cache->cache_id());
    EXPECT_TRUE(snapshot.ok()) << snapshot.status();
    EXPECT_TRUE(client.DeleteCache(cache->cache_id()).ok());
    return snapshot.ok() ? snapshot->snapshot_id() : "";
  }

  // Snapshot entries of the wire fingerprint, by id.
  std::map<std::string, EngineFingerprint::Entry> SnapshotsOnTheWire() {
    std::map<std::string, EngineFingerprint::Entry> entries;
    for (EngineFingerprint::Entry& entry : WireFingerprint(server_->client()).snapshots) {
      entries.emplace(entry.id, std::move(entry));
    }
    return entries;
  }

  std::filesystem::path data_dir_;
  std::unique_ptr<TestServer> server_;
};

TEST_F(E2eTiersTest, ThreeDevicesOfSnapshotsReadBackFromEveryTier) {
  server_ = TestServer::Start(ServerSetup{.page_bytes = kPageBytes,
                                          .budget_bytes = kDevicePages * kPageBytes,
                                          .host_bytes = 48 * kPageBytes,
                                          .data_dir = data_dir_.string(),
                                          .disk_bytes = 4 << 20});
  ASSERT_NE(server_, nullptr);
  Client& client = server_->client();
  const v1::CacheSpec spec = ProtoSpec(2, 1, 16);  // 2 layers of 16-token pages
  std::mt19937_64 rng(11);
  std::map<std::string, EngineFingerprint::Entry> expected;
  for (int i = 0; i < 12; ++i) {
    const std::string id = OrphanSnapshot(spec, 120, rng);  // 16 pages each
    ASSERT_FALSE(id.empty());
    expected[id] = SnapshotsOnTheWire().at(id);
  }
  auto stats = client.GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->host_pages_total(), 48u);
  EXPECT_GT(stats->disk_pages_total(), 0u);
  EXPECT_GT(stats->evictions(), 0u);
  EXPECT_EQ(stats->host_pages_used(), 48u);
  EXPECT_GT(stats->disk_pages_used(), 0u);
  EXPECT_EQ(stats->pages_used() + stats->host_pages_used() + stats->disk_pages_used(), 12u * 16);

  // Where each one is, and the totals agree with the tiers.
  auto listed = client.ListSnapshots();
  ASSERT_TRUE(listed.ok()) << listed.status();
  uint64_t device = 0, host = 0, disk = 0;
  for (const v1::SnapshotInfo& info : *listed) {
    EXPECT_EQ(info.device_bytes() + info.host_bytes() + info.disk_bytes(), 16 * kPageBytes);
    device += info.device_bytes();
    host += info.host_bytes();
    disk += info.disk_bytes();
  }
  EXPECT_EQ(device, stats->pages_used() * kPageBytes);
  EXPECT_EQ(host, stats->host_pages_used() * kPageBytes);
  EXPECT_EQ(disk, stats->disk_pages_used() * kPageBytes);

  // Every byte back over the wire, each read bringing its pages up.
  const std::map<std::string, EngineFingerprint::Entry> now = SnapshotsOnTheWire();
  ASSERT_EQ(now.size(), expected.size());
  for (const auto& [id, entry] : expected) EXPECT_TRUE(now.at(id) == entry) << id;
  auto after = client.GetStats();
  ASSERT_TRUE(after.ok());
  EXPECT_GT(after->promotions_from_host(), 0u);
  EXPECT_GT(after->promotions_from_disk(), 0u);
  EXPECT_GT(after->demotions(), 0u);
}

TEST_F(E2eTiersTest, SavedFilesAndEvictedPagesShareTheDiskBudget) {
  server_ = TestServer::Start(ServerSetup{.page_bytes = kPageBytes,
                                          .budget_bytes = 16 * kPageBytes,
                                          .data_dir = data_dir_.string(),
                                          .disk_bytes = 48 * kPageBytes});
  ASSERT_NE(server_, nullptr);
  Client& client = server_->client();
  const v1::CacheSpec spec = ProtoSpec(2, 1, 16);
  std::mt19937_64 rng(13);
  // 4 snapshots of 16 pages on a 16-page device: 48 pages go to disk, all of it.
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(OrphanSnapshot(spec, 120, rng));
  auto stats = client.GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->disk_pages_used(), 48u);
  // No room is left for a file: refused, naming the budget and who holds it.
  const auto saved = client.SaveSnapshot(ids.back(), "full", {});
  EXPECT_EQ(saved.status().code(), absl::StatusCode::kResourceExhausted) << saved.status();
  EXPECT_THAT(saved.status().message(), HasSubstr("disk_bytes"));
  EXPECT_THAT(saved.status().message(), HasSubstr("evicted pages"));
  // Released snapshots give their disk pages back; then the file fits.
  ASSERT_TRUE(client.ReleaseSnapshot(ids[0]).ok());
  ASSERT_TRUE(client.ReleaseSnapshot(ids[1]).ok());
  EXPECT_TRUE(client.SaveSnapshot(ids.back(), "fits", {}).ok());
  EXPECT_TRUE(client.DeleteSaved("fits").ok());
}

}  // namespace
}  // namespace kvcache::testing
