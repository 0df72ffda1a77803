// Lower tiers: pages evicted to host memory and on to disk, and promoted back,
// keep their ids, counts and bytes; every slot comes back when pages are freed.
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gpu/page_pool.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"

namespace kvcache::gpu {
namespace {

using testing::GpuTestBase;
using testing::kAllTransferPaths;
using testing::TransferPathName;

constexpr uint64_t kPage = 4096;

class PageTiersTest : public GpuTestBase {
 protected:
  std::string DiskPath() {
    return absl::StrCat(::testing::TempDir(), "/tier-", ::getpid(), "-",
                        TransferPathName(GetParam()), ".pages");
  }
  std::unique_ptr<PagePool> MakeTieredPool(uint32_t device_pages, uint32_t host_pages,
                                           uint32_t disk_pages) {
    PoolOptions options{.page_bytes = kPage,
                        .budget_bytes = device_pages * kPage,
                        .host_bytes = host_pages * kPage,
                        .disk_path = disk_pages > 0 ? DiskPath() : "",
                        .disk_bytes = disk_pages * kPage};
    auto pool = PagePool::Create(device(), options);
    EXPECT_TRUE(pool.ok()) << pool.status();
    return pool.ok() ? *std::move(pool) : nullptr;
  }
  // Fills each page with bytes derived from its index in `pages`.
  static std::vector<std::vector<uint8_t>> Fill(PagePool& pool, const std::vector<PageId>& pages) {
    std::vector<std::vector<uint8_t>> contents;
    std::vector<WriteRun> runs;
    for (size_t i = 0; i < pages.size(); ++i) {
      contents.emplace_back(kPage);
      for (uint64_t b = 0; b < kPage; ++b)
        contents.back()[b] = static_cast<uint8_t>(b * 7 + i * 31);
    }
    for (size_t i = 0; i < pages.size(); ++i) {
      runs.push_back({pages[i], 0, contents[i].data(), kPage});
    }
    EXPECT_TRUE(pool.Write(runs).ok());
    return contents;
  }
  static std::vector<uint8_t> ReadPage(PagePool& pool, PageId page) {
    std::vector<uint8_t> bytes(kPage);
    const std::vector<ReadRun> run = {{page, 0, bytes.data(), kPage}};
    EXPECT_TRUE(pool.Read(run).ok());
    return bytes;
  }
  static void ExpectAllFree(const PagePool& pool) {
    const PoolStats stats = pool.stats();
    EXPECT_EQ(stats.used_pages, 0u);
    EXPECT_EQ(stats.host_pages, 0u);
    EXPECT_EQ(stats.disk_pages, 0u);
  }
};

TEST_P(PageTiersTest, EvictedPagesComeBackWithTheirIdsAndBytes) {
  auto pool = MakeTieredPool(4, 4, 0);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(4, pages).ok());
  const auto contents = Fill(*pool, pages);
  const std::vector<PageId> evicted = {pages[1], pages[2]};
  ASSERT_EQ(pool->Evict(evicted).value_or(0), 2u);
  EXPECT_EQ(pool->Where(pages[0]), Tier::kDevice);
  EXPECT_EQ(pool->Where(pages[1]), Tier::kHost);
  EXPECT_EQ(pool->Where(pages[2]), Tier::kHost);
  EXPECT_EQ(pool->stats().used_pages, 2u);
  EXPECT_EQ(pool->stats().host_pages, 2u);
  EXPECT_EQ(pool->stats().evictions, 2u);
  // An evicted page is not readable until it is promoted: a caller's bug.
  std::vector<uint8_t> out(kPage);
  const std::vector<ReadRun> run = {{pages[1], 0, out.data(), kPage}};
  EXPECT_EQ(pool->Read(run).code(), absl::StatusCode::kInvalidArgument);

  // The device's freed room is anyone's; promotion needs it back, all or none.
  std::vector<PageId> others;
  ASSERT_TRUE(pool->Allocate(1, others).ok());
  ASSERT_TRUE(pool->Evict({}).ok());
  const std::vector<PageId> both = {pages[1], pages[2]};
  EXPECT_EQ(pool->Promote(both).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->Where(pages[1]), Tier::kHost);
  EXPECT_EQ(pool->Where(pages[2]), Tier::kHost);
  pool->Release(others[0]);
  ASSERT_TRUE(pool->Promote(both).ok());
  EXPECT_EQ(pool->stats().promotions_from_host, 2u);
  EXPECT_EQ(pool->stats().host_pages, 0u);
  for (size_t i = 0; i < pages.size(); ++i) EXPECT_EQ(ReadPage(*pool, pages[i]), contents[i]) << i;
  for (PageId page : pages) pool->Release(page);
  ExpectAllFree(*pool);
}

TEST_P(PageTiersTest, AFullHostTierMovesItsOldestPageToDisk) {
  auto pool = MakeTieredPool(4, 2, 4);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(4, pages).ok());
  const auto contents = Fill(*pool, pages);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(pool->Evict({pages[i]}).value_or(0), 1u) << i;
  EXPECT_EQ(pool->Where(pages[0]), Tier::kDisk);  // first in, first down
  EXPECT_EQ(pool->Where(pages[1]), Tier::kHost);
  EXPECT_EQ(pool->Where(pages[2]), Tier::kHost);
  PoolStats stats = pool->stats();
  EXPECT_EQ(stats.demotions, 1u);
  EXPECT_EQ(stats.disk_pages, 1u);
  EXPECT_EQ(stats.max_disk_pages, 4u);
  // Shared pages move once: a second holder sees the same page wherever it is.
  pool->Retain(pages[0]);
  ASSERT_TRUE(pool->Promote(pages).ok());
  stats = pool->stats();
  EXPECT_EQ(stats.promotions_from_disk, 1u);
  EXPECT_EQ(stats.promotions_from_host, 2u);
  for (size_t i = 0; i < pages.size(); ++i) EXPECT_EQ(ReadPage(*pool, pages[i]), contents[i]) << i;
  pool->Release(pages[0]);
  for (PageId page : pages) pool->Release(page);
  ExpectAllFree(*pool);
}

TEST_P(PageTiersTest, EvictionStopsWhereNoTierHasRoom) {
  auto pool = MakeTieredPool(4, 1, 1);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(4, pages).ok());
  const auto contents = Fill(*pool, pages);
  EXPECT_EQ(pool->Evict(pages).value_or(99), 2u);
  EXPECT_EQ(pool->Where(pages[2]), Tier::kDevice);
  EXPECT_EQ(pool->Where(pages[3]), Tier::kDevice);
  ASSERT_TRUE(pool->Promote(pages).ok());
  for (size_t i = 0; i < pages.size(); ++i) EXPECT_EQ(ReadPage(*pool, pages[i]), contents[i]) << i;
  for (PageId page : pages) pool->Release(page);
  ExpectAllFree(*pool);
}

TEST_P(PageTiersTest, WithoutAHostTierPagesGoStraightToDisk) {
  auto pool = MakeTieredPool(2, 0, 2);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(2, pages).ok());
  const auto contents = Fill(*pool, pages);
  EXPECT_EQ(pool->Evict(pages).value_or(0), 2u);
  EXPECT_EQ(pool->Where(pages[0]), Tier::kDisk);
  EXPECT_EQ(pool->stats().evictions, 2u);
  // The device's room serves new pages meanwhile; ids never run short.
  std::vector<PageId> fresh;
  ASSERT_TRUE(pool->Allocate(2, fresh).ok());
  for (PageId page : fresh) pool->Release(page);
  ASSERT_TRUE(pool->Promote(pages).ok());
  for (size_t i = 0; i < pages.size(); ++i) EXPECT_EQ(ReadPage(*pool, pages[i]), contents[i]) << i;
  for (PageId page : pages) pool->Release(page);
  ExpectAllFree(*pool);
}

TEST_P(PageTiersTest, FreeingEvictedPagesReturnsTheirSlots) {
  auto pool = MakeTieredPool(3, 1, 1);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->max_page_ids(), 5u);
  for (int round = 0; round < 3; ++round) {
    std::vector<PageId> pages;
    ASSERT_TRUE(pool->Allocate(3, pages).ok());
    Fill(*pool, pages);
    ASSERT_EQ(pool->Evict(pages).value_or(0), 2u);
    for (PageId page : pages) pool->Release(page);
    ExpectAllFree(*pool);
    EXPECT_FALSE(pool->TryRetain(pages[0]));  // freed: no reference to take
  }
}

TEST_P(PageTiersTest, RefusedAllocationsSayHowManyPagesWereMissing) {
  auto pool = MakeTieredPool(2, 2, 0);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  EXPECT_EQ(pool->refused_allocations(), 0u);
  EXPECT_EQ(pool->Allocate(5, pages).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->refused_allocations(), 1u);
  EXPECT_EQ(pool->last_shortfall(), 3u);
  EXPECT_TRUE(pages.empty());
}

TEST_P(PageTiersTest, TheDiskTierFileGoesWithThePool) {
  const std::string path = DiskPath();
  {
    auto pool = MakeTieredPool(2, 0, 2);
    ASSERT_NE(pool, nullptr);
    EXPECT_EQ(::access(path.c_str(), F_OK), 0);
  }
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
}

TEST_P(PageTiersTest, ASecondPoolCannotTakeTheSameDiskTierFile) {
  auto first = MakeTieredPool(2, 0, 2);
  ASSERT_NE(first, nullptr);
  PoolOptions options{.page_bytes = kPage,
                      .budget_bytes = 2 * kPage,
                      .disk_path = DiskPath(),
                      .disk_bytes = 2 * kPage};
  auto second = PagePool::Create(device(), options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
}

INSTANTIATE_TEST_SUITE_P(AllPaths, PageTiersTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::gpu
