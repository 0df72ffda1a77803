// Lower tiers: pages evicted to host memory and on to disk, and promoted back,
// keep their ids, counts and bytes; every slot comes back when pages are freed.
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <string>
#include <thread>
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

// Accounts (one per tenant): each holds its pages within its own limits per
// tier, whatever the pool as a whole still has.
TEST_P(PageTiersTest, AnAccountAllocatesWithinItsDeviceLimitOnly) {
  auto pool = MakeTieredPool(8, 0, 0);
  ASSERT_NE(pool, nullptr);
  std::unique_ptr<PagePool> limited = pool->ForAccount(1, {.device_pages = 3});
  std::unique_ptr<PagePool> free = pool->ForAccount(2, {});
  std::vector<PageId> held;
  ASSERT_TRUE(limited->Allocate(2, held).ok());
  EXPECT_EQ(limited->available_pages(), 1u);
  const uint64_t refused = limited->refused_allocations();
  const absl::Status past = limited->Allocate(2, held);
  EXPECT_EQ(past.code(), absl::StatusCode::kResourceExhausted) << past;
  EXPECT_THAT(std::string(past.message()), ::testing::StartsWith("max_device_bytes: "));
  EXPECT_THAT(std::string(past.message()), ::testing::HasSubstr(kAccountExhausted));
  EXPECT_EQ(held.size(), 2u) << "a refused allocation added pages";
  EXPECT_EQ(limited->refused_allocations(), refused + 1);
  EXPECT_EQ(limited->last_shortfall(), 1u);
  // The pool's other 6 pages are the other account's to take.
  std::vector<PageId> others;
  ASSERT_TRUE(free->Allocate(6, others).ok());
  EXPECT_EQ(limited->available_pages(), 0u);
  EXPECT_EQ(limited->account_usage().device_pages, 2u);
  EXPECT_EQ(free->account_usage().device_pages, 6u);
  EXPECT_EQ(limited->account_usage().limits.device_pages, 3u);
  // Pages freed go back to the account that held them, wherever released.
  pool->Release(others.back());
  others.pop_back();
  ASSERT_TRUE(limited->Allocate(1, held).ok());
  EXPECT_EQ(limited->Allocate(1, held).code(), absl::StatusCode::kResourceExhausted);
  for (PageId page : held) pool->Release(page);
  for (PageId page : others) pool->Release(page);
  EXPECT_EQ(limited->account_usage().device_pages, 0u);
  EXPECT_EQ(free->account_usage().device_pages, 0u);
  ExpectAllFree(*pool);
}

// A tenant refused by the full pool learns what it asked for, not how many
// pages the pool still has (that would show how much the others hold); the
// pool's own account, with nobody else to hide, is told.
TEST_P(PageTiersTest, AFullPoolTellsItsFreePagesOnlyToItsOwnAccount) {
  auto pool = MakeTieredPool(8, 0, 0);
  ASSERT_NE(pool, nullptr);
  std::unique_ptr<PagePool> tenant = pool->ForAccount(1, {});
  std::vector<PageId> held;
  ASSERT_TRUE(tenant->Allocate(5, held).ok());
  const absl::Status tenant_refused = tenant->Allocate(4, held);
  EXPECT_EQ(tenant_refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(tenant_refused.message()), ::testing::HasSubstr(kPoolExhausted));
  EXPECT_THAT(std::string(tenant_refused.message()), ::testing::HasSubstr("4 pages requested"));
  EXPECT_THAT(std::string(tenant_refused.message()), ::testing::Not(::testing::HasSubstr("3")));
  const absl::Status pool_refused = pool->Allocate(4, held);
  EXPECT_THAT(std::string(pool_refused.message()), ::testing::HasSubstr("3 of 8 available"));
  EXPECT_EQ(held.size(), 5u);
  for (PageId page : held) pool->Release(page);
  ExpectAllFree(*pool);
}

TEST_P(PageTiersTest, EvictionAndPromotionKeepEachAccountWithinItsLimits) {
  auto pool = MakeTieredPool(8, 4, 4);
  ASSERT_NE(pool, nullptr);
  std::unique_ptr<PagePool> limited =
      pool->ForAccount(1, {.device_pages = 4, .host_pages = 1, .disk_pages = 1});
  std::unique_ptr<PagePool> free = pool->ForAccount(2, {});
  std::vector<PageId> pages;
  ASSERT_TRUE(limited->Allocate(4, pages).ok());
  const auto contents = Fill(*pool, pages);
  // One page fits its host share, one its disk share; the rest stay. The
  // older of the two goes lower.
  EXPECT_EQ(pool->Evict(pages).value_or(0), 2u);
  EXPECT_EQ(pool->Where(pages[0]), Tier::kDisk);
  EXPECT_EQ(pool->Where(pages[1]), Tier::kHost);
  EXPECT_EQ(pool->Where(pages[2]), Tier::kDevice);
  AccountUsage usage = limited->account_usage();
  EXPECT_EQ(usage.device_pages, 2u);
  EXPECT_EQ(usage.host_pages, 1u);
  EXPECT_EQ(usage.disk_pages, 1u);
  // The other account's pages take the host memory left, unbounded.
  std::vector<PageId> others;
  ASSERT_TRUE(free->Allocate(3, others).ok());
  Fill(*pool, others);
  EXPECT_EQ(pool->Evict(others).value_or(0), 3u);
  EXPECT_EQ(free->account_usage().host_pages, 3u);
  // Back to the device only within its device share: two new pages fill it.
  std::vector<PageId> fresh;
  ASSERT_TRUE(limited->Allocate(2, fresh).ok());
  const absl::Status promoted = pool->Promote(pages);
  EXPECT_EQ(promoted.code(), absl::StatusCode::kResourceExhausted) << promoted;
  EXPECT_THAT(std::string(promoted.message()), ::testing::StartsWith("max_device_bytes: "));
  EXPECT_EQ(pool->Where(pages[0]), Tier::kDisk) << "a refused promotion moved a page";
  EXPECT_EQ(pool->Where(pages[1]), Tier::kHost) << "a refused promotion moved a page";
  for (PageId page : fresh) pool->Release(page);
  ASSERT_TRUE(pool->Promote(pages).ok());
  for (size_t i = 0; i < pages.size(); ++i) EXPECT_EQ(ReadPage(*pool, pages[i]), contents[i]) << i;
  usage = limited->account_usage();
  EXPECT_EQ(usage.device_pages, 4u);
  EXPECT_EQ(usage.host_pages + usage.disk_pages, 0u);
  for (PageId page : pages) pool->Release(page);
  for (PageId page : others) pool->Release(page);
  EXPECT_EQ(free->account_usage().host_pages, 0u);
  ExpectAllFree(*pool);
}

// Host memory full: its oldest page moves to disk only where that page's own
// account has room there; otherwise the newcomer goes to disk instead.
TEST_P(PageTiersTest, ADemotionNeedsRoomOnDiskInTheDemotedPagesAccount) {
  auto pool = MakeTieredPool(8, 1, 4);
  ASSERT_NE(pool, nullptr);
  std::unique_ptr<PagePool> limited = pool->ForAccount(1, {.disk_pages = 1});
  std::unique_ptr<PagePool> free = pool->ForAccount(2, {});
  std::vector<PageId> pages;
  ASSERT_TRUE(limited->Allocate(3, pages).ok());
  const auto contents = Fill(*pool, pages);
  ASSERT_EQ(pool->Evict({pages[0]}).value_or(0), 1u);
  ASSERT_EQ(pool->Evict({pages[1]}).value_or(0), 1u);
  EXPECT_EQ(pool->Where(pages[0]), Tier::kDisk);  // moved down for pages[1]
  EXPECT_EQ(pool->Where(pages[1]), Tier::kHost);
  // Its disk share is used up: pages[1] cannot move down, so pages[2] stays.
  EXPECT_EQ(pool->Evict({pages[2]}).value_or(9), 0u);
  EXPECT_EQ(pool->Where(pages[2]), Tier::kDevice);
  // Another account's page passes it and goes to disk itself.
  std::vector<PageId> other;
  ASSERT_TRUE(free->Allocate(1, other).ok());
  ASSERT_EQ(pool->Evict(other).value_or(0), 1u);
  EXPECT_EQ(pool->Where(other[0]), Tier::kDisk);
  EXPECT_EQ(pool->Where(pages[1]), Tier::kHost);
  ASSERT_TRUE(pool->Promote(pages).ok());
  for (size_t i = 0; i < pages.size(); ++i) EXPECT_EQ(ReadPage(*pool, pages[i]), contents[i]) << i;
  for (PageId page : pages) pool->Release(page);
  pool->Release(other[0]);
  ExpectAllFree(*pool);
}

// The oldest host page cannot move down (its account's disk share is used
// up): the next oldest goes instead, so one tenant's full share does not
// send every other tenant's evictions straight to disk.
TEST_P(PageTiersTest, APageThatCannotMoveDownDoesNotHoldUpTheOthers) {
  auto pool = MakeTieredPool(8, 2, 4);
  ASSERT_NE(pool, nullptr);
  std::unique_ptr<PagePool> limited = pool->ForAccount(1, {.disk_pages = 1});
  std::unique_ptr<PagePool> free = pool->ForAccount(2, {});
  std::vector<PageId> mine;
  std::vector<PageId> others;
  ASSERT_TRUE(limited->Allocate(2, mine).ok());
  ASSERT_TRUE(free->Allocate(3, others).ok());
  Fill(*pool, mine);
  const auto contents = Fill(*pool, others);
  for (PageId page : {mine[0], others[0], mine[1], others[1]}) {
    ASSERT_EQ(pool->Evict({page}).value_or(0), 1u);
  }
  // mine[0] and others[0] moved down in turn; mine[1] is now the oldest host
  // page, and its account's one disk page is taken.
  EXPECT_EQ(pool->Where(mine[0]), Tier::kDisk);
  EXPECT_EQ(pool->Where(others[0]), Tier::kDisk);
  EXPECT_EQ(pool->Where(mine[1]), Tier::kHost);
  EXPECT_EQ(pool->Where(others[1]), Tier::kHost);
  ASSERT_EQ(pool->Evict({others[2]}).value_or(0), 1u);
  EXPECT_EQ(pool->Where(mine[1]), Tier::kHost) << "passed over: its account has no disk room";
  EXPECT_EQ(pool->Where(others[1]), Tier::kDisk) << "the next oldest moved down instead";
  EXPECT_EQ(pool->Where(others[2]), Tier::kHost);
  ASSERT_TRUE(pool->Promote(others).ok());
  for (size_t i = 0; i < others.size(); ++i) EXPECT_EQ(ReadPage(*pool, others[i]), contents[i]);
  for (PageId page : mine) pool->Release(page);
  for (PageId page : others) pool->Release(page);
  ExpectAllFree(*pool);
}

// An account's host share is full: its own oldest host page moves down for
// the newcomer (which was used more recently), and no other account's page
// does, however old.
TEST_P(PageTiersTest, AFullHostShareMovesTheAccountsOwnOldestPageDown) {
  auto pool = MakeTieredPool(8, 4, 8);
  ASSERT_NE(pool, nullptr);
  std::unique_ptr<PagePool> limited = pool->ForAccount(1, {.host_pages = 2});
  std::unique_ptr<PagePool> free = pool->ForAccount(2, {});
  std::vector<PageId> mine;
  std::vector<PageId> other;
  ASSERT_TRUE(limited->Allocate(3, mine).ok());
  ASSERT_TRUE(free->Allocate(1, other).ok());
  const auto contents = Fill(*pool, mine);
  ASSERT_EQ(pool->Evict(other).value_or(0), 1u);
  for (PageId page : mine) ASSERT_EQ(pool->Evict({page}).value_or(0), 1u);
  EXPECT_EQ(pool->Where(mine[0]), Tier::kDisk);
  EXPECT_EQ(pool->Where(mine[1]), Tier::kHost);
  EXPECT_EQ(pool->Where(mine[2]), Tier::kHost);
  EXPECT_EQ(pool->Where(other[0]), Tier::kHost) << "another account's page moved for this one";
  EXPECT_EQ(pool->stats().demotions, 1u);
  EXPECT_EQ(limited->account_usage().host_pages, 2u);
  ASSERT_TRUE(pool->Promote(mine).ok());
  for (size_t i = 0; i < mine.size(); ++i) EXPECT_EQ(ReadPage(*pool, mine[i]), contents[i]) << i;
  for (PageId page : mine) pool->Release(page);
  pool->Release(other[0]);
  ExpectAllFree(*pool);
}

// A host page freed, its id and host slot taken by another account's page
// (both are reused last in, first out): the old arrival is not that page's,
// so the first account's full share moves its own page down, not the other's.
TEST_P(PageTiersTest, AReusedIdAndSlotAreNotTheOldArrival) {
  auto pool = MakeTieredPool(8, 4, 8);
  ASSERT_NE(pool, nullptr);
  std::unique_ptr<PagePool> limited = pool->ForAccount(1, {.host_pages = 2});
  std::unique_ptr<PagePool> free = pool->ForAccount(2, {});
  std::vector<PageId> mine;
  ASSERT_TRUE(limited->Allocate(2, mine).ok());
  for (PageId page : mine) ASSERT_EQ(pool->Evict({page}).value_or(0), 1u);
  pool->Release(mine[0]);
  std::vector<PageId> other;
  ASSERT_TRUE(free->Allocate(1, other).ok());
  ASSERT_EQ(pool->Evict(other).value_or(0), 1u);
  ASSERT_EQ(other[0], mine[0]) << "the test needs the id reused";
  std::vector<PageId> more;
  ASSERT_TRUE(limited->Allocate(2, more).ok());
  for (PageId page : more) ASSERT_EQ(pool->Evict({page}).value_or(0), 1u);
  EXPECT_EQ(pool->Where(other[0]), Tier::kHost) << "another account's page moved down";
  EXPECT_EQ(pool->Where(mine[1]), Tier::kDisk);
  EXPECT_EQ(pool->Where(more[0]), Tier::kHost);
  EXPECT_EQ(pool->Where(more[1]), Tier::kHost);
  EXPECT_EQ(limited->account_usage().host_pages, 2u);
  EXPECT_EQ(limited->account_usage().disk_pages, 1u);
  EXPECT_EQ(free->account_usage().host_pages, 1u);
  EXPECT_EQ(free->account_usage().disk_pages, 0u);
  pool->Release(mine[1]);
  pool->Release(other[0]);
  for (PageId page : more) pool->Release(page);
  EXPECT_EQ(limited->account_usage().disk_pages, 0u);
  ExpectAllFree(*pool);
}

// Files this process writes may not grow past `bytes` while it lives (pwrite
// then fails with EFBIG instead of raising SIGXFSZ): a disk that refuses.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    ::getrlimit(RLIMIT_FSIZE, &old_);
    const rlimit limited{.rlim_cur = bytes, .rlim_max = old_.rlim_max};
    ::setrlimit(RLIMIT_FSIZE, &limited);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit old_{};
  void (*old_handler_)(int) = nullptr;
};

// A page whose move down to disk fails stays in host memory and first in line:
// once the disk takes writes again, it is the one that moves down.
TEST_P(PageTiersTest, APageThatCouldNotMoveDownStaysFirstInLine) {
  auto pool = MakeTieredPool(4, 1, 4);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(3, pages).ok());
  const auto contents = Fill(*pool, pages);
  ASSERT_EQ(pool->Evict({pages[0]}).value_or(0), 1u);
  absl::Status refused;
  {
    // Nothing is printed while no file may grow (a test log could be one).
    FileSizeLimit no_disk_writes(0);
    refused = pool->Evict({pages[1]}).status();
  }
  EXPECT_FALSE(refused.ok());
  EXPECT_EQ(pool->Where(pages[0]), Tier::kHost);
  EXPECT_EQ(pool->Where(pages[1]), Tier::kDevice);
  EXPECT_EQ(pool->stats().disk_pages, 0u) << "the failed write's disk slot is still taken";
  ASSERT_EQ(pool->Evict({pages[1]}).value_or(0), 1u);
  EXPECT_EQ(pool->Where(pages[0]), Tier::kDisk) << "the oldest host page lost its place";
  EXPECT_EQ(pool->Where(pages[1]), Tier::kHost);
  ASSERT_TRUE(pool->Promote({pages[0], pages[1]}).ok());
  for (int i = 0; i < 2; ++i) EXPECT_EQ(ReadPage(*pool, pages[i]), contents[i]) << i;
  for (PageId page : pages) pool->Release(page);
  ExpectAllFree(*pool);
}

// One eviction of more pages than the account's host share holds: the oldest
// go straight to disk, the newest to host memory, each page moved once.
TEST_P(PageTiersTest, WhatAHostShareCannotHoldGoesStraightToDisk) {
  auto pool = MakeTieredPool(8, 4, 8);
  ASSERT_NE(pool, nullptr);
  std::unique_ptr<PagePool> limited = pool->ForAccount(1, {.host_pages = 2});
  std::vector<PageId> pages;
  ASSERT_TRUE(limited->Allocate(4, pages).ok());
  const auto contents = Fill(*pool, pages);
  ASSERT_EQ(pool->Evict(pages).value_or(0), 4u);
  EXPECT_EQ(pool->Where(pages[0]), Tier::kDisk);
  EXPECT_EQ(pool->Where(pages[1]), Tier::kDisk);
  EXPECT_EQ(pool->Where(pages[2]), Tier::kHost);
  EXPECT_EQ(pool->Where(pages[3]), Tier::kHost);
  EXPECT_EQ(pool->stats().demotions, 0u) << "a page went down twice";
  ASSERT_TRUE(pool->Promote(pages).ok());
  for (size_t i = 0; i < pages.size(); ++i) EXPECT_EQ(ReadPage(*pool, pages[i]), contents[i]) << i;
  for (PageId page : pages) pool->Release(page);
  ExpectAllFree(*pool);
}

// A caller that evicts when refused learns from its own thread's count that
// the refusal is its call's: another thread's refusal does not count.
TEST_P(PageTiersTest, RefusalsAreCountedForTheThreadRefused) {
  auto pool = MakeTieredPool(2, 0, 0);
  ASSERT_NE(pool, nullptr);
  const PagePool::Refusals before = PagePool::RefusalsOnThisThread();
  std::thread other([&] {
    std::vector<PageId> pages;
    EXPECT_EQ(pool->Allocate(3, pages).code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(PagePool::RefusalsOnThisThread().last_shortfall, 1u);
  });
  other.join();
  EXPECT_EQ(PagePool::RefusalsOnThisThread().count, before.count);
  EXPECT_EQ(pool->refused_allocations(), 1u);  // the pool's own count sees both
  std::vector<PageId> pages;
  EXPECT_EQ(pool->Allocate(5, pages).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(PagePool::RefusalsOnThisThread().count, before.count + 1);
  EXPECT_EQ(PagePool::RefusalsOnThisThread().last_shortfall, 3u);
  ExpectAllFree(*pool);
}

INSTANTIATE_TEST_SUITE_P(AllPaths, PageTiersTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::gpu
