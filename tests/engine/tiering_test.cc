// Tiers through the engine: when the device pool is full, pages only
// snapshots hold move to host memory (then disk), least recently used first;
// reading such a snapshot brings them back. Live caches' pages, pinned
// snapshots' pages and pages a call is reading never move; shared pages move
// once. Every check compares bytes with the CPU reference, and every page of
// every tier is free at the end.
#include <unistd.h>

#include <memory>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {
namespace {

using engine::Engine;
using ::testing::HasSubstr;

constexpr uint64_t kPage = 4096;
constexpr uint32_t kPageTokens = 16;
constexpr uint64_t kTokensPerPage = 16;  // one layer, 1 head of 64 dims, float16: 4 KiB a page

class TieringTest : public GpuTestBase {
 protected:
  void StartEngine(uint32_t device_pages, uint32_t host_pages, uint32_t disk_pages = 0,
                   uint64_t max_pinned_bytes = 0) {
    gpu::PoolOptions options{.page_bytes = kPage,
                             .budget_bytes = device_pages * kPage,
                             .host_bytes = host_pages * kPage};
    if (disk_pages > 0) {
      options.disk_path = absl::StrCat(::testing::TempDir(), "/tiering-", ::getpid(), ".pages");
      options.disk_bytes = disk_pages * kPage;
    }
    auto pool = gpu::PagePool::Create(device(), options);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = *std::move(pool);
    engine_ = std::make_unique<Engine>(
        *pool_, engine::EngineOptions{.page_tokens = kPageTokens,
                                      .max_pinned_bytes = max_pinned_bytes});
  }
  void TearDown() override {
    if (engine_ != nullptr) {
      ReleaseEverything(*engine_);
      const gpu::PoolStats stats = pool_->stats();
      EXPECT_EQ(stats.used_pages, 0u);
      EXPECT_EQ(stats.host_pages, 0u);
      EXPECT_EQ(stats.disk_pages, 0u);
    }
    engine_.reset();
    pool_.reset();
    GpuTestBase::TearDown();
  }
  static engine::CacheSpec Spec() { return MakeSpec({StandardLayerSpec(1, 64)}); }

  // A snapshot of `pages` pages of tokens whose cache is gone: only the
  // snapshot holds its pages.
  std::string OrphanSnapshot(uint32_t pages, RefCacheSnapshotPtr* reference, bool pinned = false,
                             uint64_t seed = 7) {
    MirroredCache cache(*engine_, Spec(), seed);
    EXPECT_TRUE(cache.Append(pages * kTokensPerPage));
    std::string id = cache.Snapshot(0, reference);
    if (pinned) EXPECT_TRUE(engine_->SetPinned(id, true).ok());
    EXPECT_TRUE(engine_->DeleteCache(cache.id()).ok());
    return id;
  }
  engine::SnapshotInfo Info(const std::string& snapshot_id) {
    for (const engine::SnapshotInfo& info : engine_->ListSnapshots()) {
      if (info.snapshot_id == snapshot_id) return info;
    }
    ADD_FAILURE() << "no snapshot " << snapshot_id;
    return {};
  }

  std::unique_ptr<gpu::PagePool> pool_;
  std::unique_ptr<Engine> engine_;
};

TEST_P(TieringTest, AFullPoolEvictsSnapshotPagesAndRestoreBringsThemBack) {
  StartEngine(8, 16);
  RefCacheSnapshotPtr reference;
  const std::string snapshot = OrphanSnapshot(6, &reference);
  EXPECT_EQ(pool_->stats().used_pages, 6u);
  EXPECT_EQ(Info(snapshot).tiers.device, 6 * kPage);

  // A cache needing 6 pages: 4 come from the snapshot, moved to host memory.
  MirroredCache other(*engine_, Spec(), 11);
  ASSERT_TRUE(other.Append(6 * kTokensPerPage));
  EXPECT_GE(pool_->stats().evictions, 4u);
  const engine::SnapshotInfo evicted = Info(snapshot);
  EXPECT_GE(evicted.tiers.host, 4 * kPage);
  EXPECT_EQ(evicted.tiers.device + evicted.tiers.host, 6 * kPage);
  EXPECT_EQ(engine_->Stats().pool.host_pages * kPage, evicted.tiers.host);

  // Restoring needs the device again: the other cache's pages cannot move,
  // so it goes first; then a fresh cache restores every byte.
  ASSERT_TRUE(engine_->DeleteCache(other.id()).ok());
  MirroredCache restored(*engine_, Spec(), 13);
  ASSERT_TRUE(restored.Restore(snapshot, reference.get(), reference->to));
  EXPECT_TRUE(restored.Matches());
  EXPECT_EQ(Info(snapshot).tiers.device, 6 * kPage);
  EXPECT_GE(pool_->stats().promotions_from_host, 4u);
}

TEST_P(TieringTest, PagesALiveCacheHoldsNeverLeaveTheDevice) {
  StartEngine(8, 16);
  MirroredCache cache(*engine_, Spec(), 7);
  ASSERT_TRUE(cache.Append(6 * kTokensPerPage));
  RefCacheSnapshotPtr reference;
  const std::string snapshot = cache.Snapshot(0, &reference);  // shares every page with the cache
  MirroredCache other(*engine_, Spec(), 11);
  std::mt19937_64 rng(3);
  const absl::Status refused =
      engine_->Update(other.id(), 0, RandomKv(Spec(), 0, 6 * kTokensPerPage, rng).input()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("pool_bytes"));
  EXPECT_EQ(pool_->stats().evictions, 0u);
  EXPECT_TRUE(cache.Matches());
  EXPECT_TRUE(SnapshotMatches(*engine_, snapshot, *reference));
}

TEST_P(TieringTest, PinnedSnapshotsStayOnTheDevice) {
  StartEngine(8, 16);
  RefCacheSnapshotPtr pinned_reference;
  const std::string pinned = OrphanSnapshot(6, &pinned_reference, /*pinned=*/true);
  MirroredCache other(*engine_, Spec(), 11);
  EXPECT_FALSE(other.Append(6 * kTokensPerPage));
  EXPECT_EQ(pool_->stats().evictions, 0u);
  EXPECT_EQ(Info(pinned).tiers.device, 6 * kPage);
  EXPECT_TRUE(SnapshotMatches(*engine_, pinned, *pinned_reference));

  // Unpinned, it may go; pinned again, it comes back first.
  ASSERT_TRUE(engine_->SetPinned(pinned, false).ok());
  ASSERT_TRUE(other.Append(6 * kTokensPerPage));
  EXPECT_GT(Info(pinned).tiers.host, 0u);
  ASSERT_TRUE(engine_->DeleteCache(other.id()).ok());
  ASSERT_TRUE(engine_->SetPinned(pinned, true).ok());
  EXPECT_EQ(Info(pinned).tiers.device, 6 * kPage);
  EXPECT_TRUE(SnapshotMatches(*engine_, pinned, *pinned_reference));
}

TEST_P(TieringTest, APinPastTheBudgetLeavesEveryTierAsItWas) {
  StartEngine(8, 16, 0, /*max_pinned_bytes=*/2 * kPage);
  RefCacheSnapshotPtr reference;
  const std::string snapshot = OrphanSnapshot(6, &reference);
  MirroredCache other(*engine_, Spec(), 11);
  ASSERT_TRUE(other.Append(6 * kTokensPerPage));
  ASSERT_TRUE(engine_->DeleteCache(other.id()).ok());
  const engine::SnapshotInfo evicted = Info(snapshot);
  ASSERT_GT(evicted.tiers.host, 0u);
  const gpu::PoolStats before = pool_->stats();

  const auto refused = engine_->SetPinned(snapshot, true);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("max_pinned_bytes"));
  const engine::SnapshotInfo after = Info(snapshot);
  EXPECT_FALSE(after.pinned);
  EXPECT_EQ(after.tiers.host, evicted.tiers.host);
  EXPECT_EQ(after.tiers.device, evicted.tiers.device);
  EXPECT_EQ(pool_->stats().promotions_from_host, before.promotions_from_host);
  EXPECT_EQ(engine_->Stats().pinned_bytes, 0u);
  EXPECT_TRUE(SnapshotMatches(*engine_, snapshot, *reference));
}

TEST_P(TieringTest, ASharedPageMovesOnceAndStaysShared) {
  StartEngine(8, 16);
  MirroredCache cache(*engine_, Spec(), 7);
  ASSERT_TRUE(cache.Append(6 * kTokensPerPage));
  RefCacheSnapshotPtr first_reference, second_reference;
  const std::string first = cache.Snapshot(0, &first_reference);
  const std::string second = cache.Snapshot(0, &second_reference);
  ASSERT_TRUE(engine_->DeleteCache(cache.id()).ok());
  EXPECT_EQ(pool_->stats().used_pages, 6u);  // one copy, two holders

  MirroredCache other(*engine_, Spec(), 11);
  ASSERT_TRUE(other.Append(8 * kTokensPerPage));  // the whole device
  EXPECT_EQ(pool_->stats().evictions, 6u);        // each page once
  EXPECT_EQ(pool_->stats().host_pages, 6u);
  EXPECT_EQ(Info(first).tiers.host, 6 * kPage);
  EXPECT_EQ(Info(second).tiers.host, 6 * kPage);

  ASSERT_TRUE(engine_->DeleteCache(other.id()).ok());
  EXPECT_TRUE(SnapshotMatches(*engine_, second, *second_reference));  // a Fetch's read
  EXPECT_EQ(Info(first).tiers.device, 6 * kPage);  // came back with the other holder
  EXPECT_EQ(pool_->stats().used_pages, 6u);
  EXPECT_TRUE(SnapshotMatches(*engine_, first, *first_reference));
}

TEST_P(TieringTest, TheLeastRecentlyUsedSnapshotGoesFirst) {
  StartEngine(8, 16);
  RefCacheSnapshotPtr older_reference, newer_reference;
  const std::string older = OrphanSnapshot(3, &older_reference, false, 7);
  const std::string newer = OrphanSnapshot(3, &newer_reference, false, 9);
  // Naming the older one makes it the more recently used.
  const std::string ids[] = {older};
  ASSERT_TRUE(engine_->RenewLease({}, ids).ok());
  MirroredCache other(*engine_, Spec(), 11);
  ASSERT_TRUE(other.Append(4 * kTokensPerPage));  // 2 free, 2 to evict
  EXPECT_EQ(Info(older).tiers.device, 3 * kPage);
  EXPECT_EQ(Info(newer).tiers.host, 2 * kPage);
  ASSERT_TRUE(engine_->DeleteCache(other.id()).ok());
  EXPECT_TRUE(SnapshotMatches(*engine_, newer, *newer_reference));
  EXPECT_TRUE(SnapshotMatches(*engine_, older, *older_reference));
}

TEST_P(TieringTest, AFullHostTierSpillsToDisk) {
  StartEngine(8, 2, 16);
  RefCacheSnapshotPtr reference;
  const std::string snapshot = OrphanSnapshot(6, &reference);
  MirroredCache other(*engine_, Spec(), 11);
  ASSERT_TRUE(other.Append(8 * kTokensPerPage));
  const engine::SnapshotInfo info = Info(snapshot);
  // Host memory holds two; the four it could never hold go straight down.
  EXPECT_EQ(info.tiers.host, 2 * kPage);
  EXPECT_EQ(info.tiers.disk, 4 * kPage);
  EXPECT_EQ(pool_->stats().evictions, 6u);
  ASSERT_TRUE(engine_->DeleteCache(other.id()).ok());
  MirroredCache restored(*engine_, Spec(), 13);
  ASSERT_TRUE(restored.Restore(snapshot, reference.get(), reference->to));
  EXPECT_TRUE(restored.Matches());
  EXPECT_EQ(pool_->stats().promotions_from_disk, 4u);
  EXPECT_EQ(pool_->stats().promotions_from_host, 2u);
}

TEST_P(TieringTest, WhenNoTierHasRoomTheCallIsRefusedAndNothingIsLost) {
  StartEngine(8, 2);
  RefCacheSnapshotPtr reference;
  const std::string snapshot = OrphanSnapshot(6, &reference);
  MirroredCache other(*engine_, Spec(), 11);
  // 2 free + 2 evictable: 4 pages of room, not 6.
  std::mt19937_64 rng(5);
  const absl::Status refused =
      engine_->Update(other.id(), 0, RandomKv(Spec(), 0, 6 * kTokensPerPage, rng).input()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("pool_bytes"));
  EXPECT_TRUE(other.Matches());  // unchanged: still empty
  ASSERT_TRUE(other.Append(4 * kTokensPerPage));
  // Restore needs 2 pages back, and none can leave: refused, nothing lost.
  MirroredCache restored(*engine_, Spec(), 13);
  const absl::Status no_room = engine_->Restore(restored.id(), snapshot, reference->to).status();
  EXPECT_EQ(no_room.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(no_room.message(), HasSubstr("pool_bytes"));
  ASSERT_TRUE(engine_->DeleteCache(other.id()).ok());
  ASSERT_TRUE(restored.Restore(snapshot, reference.get(), reference->to));
  EXPECT_TRUE(restored.Matches());
}

INSTANTIATE_TEST_SUITE_P(AllPaths, TieringTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
