// PagePool::Move (page to page at independent offsets) through each transfer
// path, checked byte for byte against a host mirror; and its refusals.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gpu/page_pool.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"

namespace kvcache::gpu {
namespace {

using testing::GpuTestBase;
using testing::kAllTransferPaths;
using testing::TransferPathName;
using Bytes = std::vector<std::byte>;

constexpr uint64_t kPage = 4096;

class PageMoveTest : public GpuTestBase {
 protected:
  void SetUp() override {
    GpuTestBase::SetUp();
    pool_ = MakePool(kPage, 64 * kPage);
    ASSERT_NE(pool_, nullptr);
  }
  void TearDown() override {
    for (PageId page : pages_) pool_->Release(page);
    if (pool_ != nullptr) {
      EXPECT_EQ(pool_->stats().used_pages, 0u);
    }
    pool_.reset();
    GpuTestBase::TearDown();
  }

  // `count` pages filled with random bytes, mirrored in mirror_.
  std::vector<PageId> Filled(uint32_t count) {
    std::vector<PageId> pages;
    EXPECT_TRUE(pool_->Allocate(count, pages).ok());
    std::vector<WriteRun> runs;
    for (PageId page : pages) {
      Bytes& bytes = mirror_[page];
      bytes.resize(kPage);
      for (std::byte& b : bytes) b = static_cast<std::byte>(rng_());
      runs.push_back({page, 0, bytes.data(), kPage});
      pages_.push_back(page);
    }
    EXPECT_TRUE(pool_->Write(runs).ok());
    return pages;
  }

  void ExpectPagesMatchMirror() {
    for (PageId page : pages_) {
      Bytes back(kPage);
      ReadRun run{page, 0, back.data(), kPage};
      ASSERT_TRUE(pool_->Read({&run, 1}).ok());
      ASSERT_TRUE(back == mirror_[page]) << "page " << page;
    }
  }

  std::unique_ptr<PagePool> pool_;
  std::vector<PageId> pages_;
  std::map<PageId, Bytes> mirror_;
  std::mt19937_64 rng_{99};
};

// Sources in one set of pages, destinations in another, at unrelated (and
// unaligned) offsets; each destination byte written at most once.
TEST_P(PageMoveTest, MovesBytesBetweenUnrelatedOffsets) {
  const std::vector<PageId> sources = Filled(4);
  const std::vector<PageId> targets = Filled(4);
  std::vector<PageMove> moves;
  for (size_t t = 0; t < targets.size(); ++t) {
    for (uint64_t dst = 0; dst < kPage;) {
      const uint64_t bytes = std::min<uint64_t>(kPage - dst, 1 + rng_() % 700);
      const PageId src = sources[rng_() % sources.size()];
      const uint64_t src_offset = rng_() % (kPage - bytes + 1);
      if (rng_() % 4 != 0) {  // leave some destination bytes untouched
        moves.push_back({src, src_offset, targets[t], dst, bytes});
        std::memcpy(mirror_[targets[t]].data() + dst, mirror_[src].data() + src_offset, bytes);
      }
      dst += bytes;
    }
  }
  ASSERT_TRUE(pool_->Move(moves).ok());
  ExpectPagesMatchMirror();
}

// More moves than one staged submission holds (CopyPipeline::kMaxCopies).
TEST_P(PageMoveTest, ManySmallMovesSpanSeveralSubmissions) {
  const std::vector<PageId> sources = Filled(2);
  const std::vector<PageId> targets = Filled(10);
  std::vector<PageMove> moves;
  for (PageId target : targets) {
    for (uint64_t dst = 0; dst + 2 <= kPage; dst += 2) {
      const PageId src = sources[(dst / 2) % 2];
      const uint64_t src_offset = (dst * 7 + 3) % (kPage - 2);
      moves.push_back({src, src_offset, target, dst, 2});
      std::memcpy(mirror_[target].data() + dst, mirror_[src].data() + src_offset, 2);
    }
  }
  ASSERT_GT(moves.size(), 16384u);
  ASSERT_TRUE(pool_->Move(moves).ok());
  ExpectPagesMatchMirror();
}

TEST_P(PageMoveTest, RefusesRangesOutsideAPageAndMovesNothing) {
  const std::vector<PageId> pages = Filled(2);
  const PageMove good{pages[0], 0, pages[1], 0, 16};
  for (const PageMove& bad :
       {PageMove{pages[0], kPage - 8, pages[1], 0, 16},
        PageMove{pages[0], 0, pages[1], kPage - 8, 16}, PageMove{kNoPage, 0, pages[1], 0, 16},
        PageMove{pages[0], 0, 60 * 1000, 0, 16}}) {
    const absl::Status status = pool_->Move({good, bad});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(std::string(status.message()).find("Move[1]"), std::string::npos) << status;
  }
  ExpectPagesMatchMirror();
  EXPECT_TRUE(pool_->Move({}).ok());
}

INSTANTIATE_TEST_SUITE_P(AllPaths, PageMoveTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::gpu
