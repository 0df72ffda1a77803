// Page bookkeeping: allocation, reference counts, the free list, the budget and
// lazy slabs, under each transfer path.
#include "gpu/page_pool.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gpu/device.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"

namespace kvcache::gpu {
namespace {

using ::testing::ElementsAre;
using testing::GpuTestBase;
using ::testing::HasSubstr;
using testing::kAllTransferPaths;
using testing::TransferPathName;

constexpr uint64_t kPage = 4096;

class PagePoolTest : public GpuTestBase {
 protected:
  // A pool with an explicit slab size, to watch slabs appear.
  std::unique_ptr<PagePool> MakePoolWithSlabs(uint64_t page_bytes, uint64_t budget_bytes,
                                              uint64_t slab_bytes) {
    PoolOptions options{
        .page_bytes = page_bytes, .budget_bytes = budget_bytes, .slab_bytes = slab_bytes};
    auto pool = PagePool::Create(device(), options);
    EXPECT_TRUE(pool.ok()) << pool.status();
    return pool.ok() ? *std::move(pool) : nullptr;
  }
};

TEST_P(PagePoolTest, AllocatesFreshPagesWithCountOne) {
  auto pool = MakePool(kPage, 16 * kPage);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages = {kNoPage};  // Allocate appends.
  ASSERT_TRUE(pool->Allocate(3, pages).ok());
  ASSERT_EQ(pages.size(), 4u);
  EXPECT_EQ(pages[0], kNoPage);
  EXPECT_EQ(std::set<PageId>(pages.begin() + 1, pages.end()).size(), 3u);
  for (size_t i = 1; i < pages.size(); ++i) EXPECT_EQ(pool->RefCount(pages[i]), 1u);
  EXPECT_EQ(pool->stats().used_pages, 3u);
  EXPECT_EQ(pool->available_pages(), 13u);
  EXPECT_EQ(pool->page_bytes(), kPage);
  for (size_t i = 1; i < pages.size(); ++i) pool->Release(pages[i]);
}

TEST_P(PagePoolTest, RetainAndReleaseCountReferences) {
  auto pool = MakePool(kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(1, pages).ok());
  const PageId page = pages[0];
  pool->Retain(page);
  pool->Retain(page);
  EXPECT_EQ(pool->RefCount(page), 3u);
  pool->Release(page);
  pool->Release(page);
  EXPECT_EQ(pool->RefCount(page), 1u);
  EXPECT_EQ(pool->stats().used_pages, 1u);
  pool->Release(page);
  EXPECT_EQ(pool->RefCount(page), 0u);
  EXPECT_EQ(pool->stats().used_pages, 0u);
}

TEST_P(PagePoolTest, FreeListReturnsEveryPageAndReusesLastFreedFirst) {
  auto pool = MakePool(kPage, 8 * kPage);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(8, pages).ok());
  std::vector<PageId> sorted = pages;
  std::sort(sorted.begin(), sorted.end());
  std::vector<PageId> expected(8);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(sorted, expected);
  EXPECT_EQ(pool->available_pages(), 0u);
  for (PageId page : pages) pool->Release(page);
  EXPECT_EQ(pool->available_pages(), 8u);
  EXPECT_EQ(pool->stats().used_pages, 0u);
}

TEST_P(PagePoolTest, ReleasedPagesComeBackLastInFirstOut) {
  auto pool = MakePool(kPage, 8 * kPage);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(4, pages).ok());
  pool->Release(pages[1]);
  pool->Release(pages[3]);
  std::vector<PageId> again;
  ASSERT_TRUE(pool->Allocate(2, again).ok());
  EXPECT_THAT(again, ElementsAre(pages[3], pages[1]));
  for (PageId page : {pages[0], pages[2], again[0], again[1]}) pool->Release(page);
  EXPECT_EQ(pool->stats().used_pages, 0u);
}

TEST_P(PagePoolTest, AllocationPastTheBudgetFailsWholeAndChangesNothing) {
  auto pool = MakePool(kPage, 10 * kPage + kPage / 2);  // Rounded down to 10 pages.
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->stats().max_pages, 10u);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(7, pages).ok());
  const PoolStats before = pool->stats();
  std::vector<PageId> more = {42};
  const absl::Status status = pool->Allocate(4, more);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("4 pages requested"));
  EXPECT_THAT(more, ElementsAre(42u));
  const PoolStats after = pool->stats();
  EXPECT_EQ(after.used_pages, before.used_pages);
  EXPECT_EQ(after.backed_pages, before.backed_pages);
  EXPECT_EQ(pool->available_pages(), 3u);
  ASSERT_TRUE(pool->Allocate(3, pages).ok());
  EXPECT_EQ(pool->Allocate(1, more).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(pool->Allocate(0, more).ok());
  for (PageId page : pages) pool->Release(page);
  EXPECT_EQ(pool->available_pages(), 10u);
}

TEST_P(PagePoolTest, SlabsAreAllocatedLazilyUpToTheBudget) {
  // 4 pages per slab, 10 pages of budget: slabs of 4, 4 and 2 pages.
  auto pool = MakePoolWithSlabs(kPage, 10 * kPage, 4 * kPage + 100);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->stats().slabs, 0u);
  EXPECT_EQ(pool->stats().backed_pages, 0u);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(1, pages).ok());
  EXPECT_EQ(pool->stats().slabs, 1u);
  EXPECT_EQ(pool->stats().backed_pages, 4u);
  ASSERT_TRUE(pool->Allocate(3, pages).ok());
  EXPECT_EQ(pool->stats().slabs, 1u);
  ASSERT_TRUE(pool->Allocate(5, pages).ok());
  EXPECT_EQ(pool->stats().slabs, 3u);
  EXPECT_EQ(pool->stats().backed_pages, 10u);
  EXPECT_EQ(pool->available_pages(), 1u);
  for (PageId page : pages) pool->Release(page);
  EXPECT_EQ(pool->stats().slabs, 3u);  // Slabs stay once backed.
}

TEST_P(PagePoolTest, SlabSizeIsClampedToTheStorageBufferRange) {
  const uint64_t range = device().max_storage_buffer_range();
  auto pool = MakePoolWithSlabs(1 << 20, 2 * range, 4 * range);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(1, pages).ok());
  EXPECT_EQ(pool->stats().backed_pages, range / (1 << 20));
  pool->Release(pages[0]);
}

TEST_P(PagePoolTest, RejectsUnusableOptions) {
  EXPECT_EQ(PagePool::Create(device(), {.page_bytes = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      PagePool::Create(device(), {.page_bytes = kPage, .budget_bytes = kPage - 1}).status().code(),
      absl::StatusCode::kInvalidArgument);
  const uint64_t too_big = device().max_storage_buffer_range() + 1;
  EXPECT_EQ(PagePool::Create(device(), {.page_bytes = too_big, .budget_bytes = 2 * too_big})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// Reference-count calls on pages that are not allocated are caller bugs: they
// assert in debug builds and are logged and ignored in release builds.
TEST_P(PagePoolTest, ReleasingAFreePageIsIgnored) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // Vulkan drivers run threads.
  auto pool = MakePool(kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(2, pages).ok());
  pool->Release(pages[0]);
  EXPECT_DEBUG_DEATH(pool->Release(pages[0]), "not allocated");
  EXPECT_DEBUG_DEATH(pool->Retain(pages[0]), "not allocated");
  EXPECT_DEBUG_DEATH(pool->Release(12345), "not allocated");
  EXPECT_EQ(pool->RefCount(pages[0]), 0u);
  EXPECT_EQ(pool->available_pages(), 3u);  // No double push onto the free list.
  pool->Release(pages[1]);
}

// Mapped hands out where bytes lie, for sending without a copy: the same bytes
// Read copies, on the direct path; the staging paths cannot, and say so.
TEST_P(PagePoolTest, MappedShowsWhatReadCopiesWhereTheHostSeesPages) {
  auto pool = MakePool(kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate(2, pages).ok());
  std::vector<std::byte> pattern(2 * kPage);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = std::byte(i * 7 + 3);
  ASSERT_TRUE(pool->Write(std::vector<WriteRun>{{pages[0], 0, pattern.data(), kPage},
                                                {pages[1], 0, pattern.data() + kPage, kPage}})
                  .ok());
  const std::vector<ReadRun> runs = {{pages[1], 100, nullptr, 900}, {pages[0], 0, nullptr, 5}};
  std::vector<absl::Span<const std::byte>> pieces = {{}};  // Mapped appends
  const absl::Status status = pool->Mapped(runs, pieces);
  // The direct path maps pages only where the device offers cached
  // host-visible device memory (lavapipe, integrated GPUs; not a discrete GPU).
  if (!device().direct_host_access()) {
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_EQ(pieces.size(), 1u);
  } else {
    ASSERT_TRUE(status.ok()) << status;
    ASSERT_EQ(pieces.size(), 3u);
    EXPECT_TRUE(std::equal(pieces[1].begin(), pieces[1].end(), pattern.begin() + kPage + 100));
    EXPECT_EQ(pieces[1].size(), 900u);
    EXPECT_TRUE(std::equal(pieces[2].begin(), pieces[2].end(), pattern.begin()));
    EXPECT_EQ(pieces[2].size(), 5u);
    // A run past its page is refused, naming the call and the run.
    const std::vector<ReadRun> past = {{pages[0], kPage - 4, nullptr, 8}};
    const absl::Status refused = pool->Mapped(past, pieces);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.message(), HasSubstr("Mapped"));
    EXPECT_EQ(pieces.size(), 3u);
  }
  for (PageId page : pages) pool->Release(page);
}

INSTANTIATE_TEST_SUITE_P(AllPaths, PagePoolTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::gpu
