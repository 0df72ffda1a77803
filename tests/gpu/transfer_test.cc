// Write / Read / Copy through each transfer path, checked byte for byte against
// a host mirror of what the pages should hold.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <map>
#include <random>
#include <thread>
#include <utility>
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

Bytes RandomBytes(size_t count, std::mt19937_64& rng) {
  Bytes bytes(count);
  for (size_t i = 0; i < count; i += 8) {
    const uint64_t word = rng();
    std::memcpy(bytes.data() + i, &word, std::min<size_t>(8, count - i));
  }
  return bytes;
}

// [offset, offset + bytes) pieces covering [0, total) in order, each a multiple
// of `granule` bytes (the last takes the remainder) and at most max_piece long.
std::vector<std::pair<uint64_t, uint64_t>> Pieces(uint64_t total, uint64_t granule,
                                                  uint64_t max_piece, std::mt19937_64& rng) {
  std::uniform_int_distribution<uint64_t> granules(1, max_piece / granule);
  std::vector<std::pair<uint64_t, uint64_t>> pieces;
  for (uint64_t offset = 0; offset < total;) {
    const uint64_t bytes = std::min(total - offset, granules(rng) * granule);
    pieces.emplace_back(offset, bytes);
    offset += bytes;
  }
  return pieces;
}

class TransferTest : public GpuTestBase {
 protected:
  // Allocates `count` pages of `pool` and fills each with random bytes, mirrored.
  std::vector<PageId> AllocateFilled(PagePool& pool, uint32_t count) {
    std::vector<PageId> pages;
    EXPECT_TRUE(pool.Allocate(count, pages).ok());
    std::vector<WriteRun> runs;
    for (PageId page : pages) {
      mirror_[page] = RandomBytes(pool.page_bytes(), rng_);
      runs.push_back({page, 0, mirror_[page].data(), pool.page_bytes()});
    }
    EXPECT_TRUE(pool.Write(runs).ok());
    return pages;
  }

  // Reads every page in `pages` (in one call, each in `granule`-sized random
  // pieces) and compares with the mirror.
  void ExpectPagesMatchMirror(PagePool& pool, const std::vector<PageId>& pages,
                              uint64_t granule = 2) {
    std::map<PageId, Bytes> actual;
    std::vector<ReadRun> runs;
    for (PageId page : pages) {
      Bytes& bytes = actual[page] = Bytes(pool.page_bytes());
      for (auto [offset, size] : Pieces(pool.page_bytes(), granule, 4096, rng_)) {
        runs.push_back({page, offset, bytes.data() + offset, size});
      }
    }
    std::shuffle(runs.begin(), runs.end(), rng_);
    ASSERT_TRUE(pool.Read(runs).ok());
    for (PageId page : pages) {
      ASSERT_TRUE(actual[page] == mirror_[page]) << "page " << page << " differs";
    }
  }

  void ReleaseAll(PagePool& pool, const std::vector<PageId>& pages) {
    for (PageId page : pages) pool.Release(page);
    EXPECT_EQ(pool.stats().used_pages, 0u);
  }

  // Random non-overlapping writes covering about half of each page.
  void WriteRandomPieces(PagePool& pool, const std::vector<PageId>& pages, uint64_t granule) {
    std::vector<WriteRun> runs;
    // A moved Bytes keeps its buffer: the runs' pointers stay good as it grows.
    std::vector<Bytes> sources;
    for (PageId page : pages) {
      for (auto [offset, size] : Pieces(pool.page_bytes(), granule, 600, rng_)) {
        if (rng_() % 2 == 0) continue;
        sources.push_back(RandomBytes(size, rng_));
        std::memcpy(mirror_[page].data() + offset, sources.back().data(), size);
        runs.push_back({page, offset, sources.back().data(), size});
      }
    }
    std::shuffle(runs.begin(), runs.end(), rng_);
    ASSERT_TRUE(pool.Write(runs).ok());
  }

  std::mt19937_64 rng_{20240601};
  std::map<PageId, Bytes> mirror_;
};

TEST_P(TransferTest, WholePagesRoundTrip) {
  auto pool = MakePool(64 << 10, 1 << 20);
  ASSERT_NE(pool, nullptr);
  const std::vector<PageId> pages = AllocateFilled(*pool, 16);
  ExpectPagesMatchMirror(*pool, pages);
  ReleaseAll(*pool, pages);
}

// Pages of 4098 bytes put every other page at 2 mod 4 in its slab, so runs
// meet both alignments on every side of the copy.
TEST_P(TransferTest, EvenOffsetsAndSizesRoundTrip) {
  for (uint64_t page_bytes : {uint64_t{4096}, uint64_t{4098}, uint64_t{258}}) {
    SCOPED_TRACE(page_bytes);
    auto pool = MakePool(page_bytes, 64 * page_bytes);
    ASSERT_NE(pool, nullptr);
    const std::vector<PageId> pages = AllocateFilled(*pool, 12);
    WriteRandomPieces(*pool, pages, 2);
    ExpectPagesMatchMirror(*pool, pages, 2);
    ReleaseAll(*pool, pages);
  }
}

TEST_P(TransferTest, AnyByteOffsetsAndSizesRoundTrip) {
  auto pool = MakePool(4099, 32 * 4099);
  ASSERT_NE(pool, nullptr);
  const std::vector<PageId> pages = AllocateFilled(*pool, 8);
  WriteRandomPieces(*pool, pages, 1);
  ExpectPagesMatchMirror(*pool, pages, 1);
  ReleaseAll(*pool, pages);
}

TEST_P(TransferTest, CopiesRangesBetweenPages) {
  auto pool = MakePool(4098, 64 * 4098);
  ASSERT_NE(pool, nullptr);
  const std::vector<PageId> pages = AllocateFilled(*pool, 16);
  std::vector<PageCopy> copies;
  for (size_t i = 0; i < 8; ++i) {  // Pages 0..7 are sources, 8..15 destinations.
    for (auto [offset, size] : Pieces(pool->page_bytes(), 2, 1000, rng_)) {
      if (rng_() % 3 == 0) continue;
      copies.push_back({pages[i], pages[8 + (i * 3) % 8], offset, size});
    }
  }
  std::shuffle(copies.begin(), copies.end(), rng_);
  for (const PageCopy& copy : copies) {
    std::memcpy(mirror_[copy.dst].data() + copy.offset, mirror_[copy.src].data() + copy.offset,
                copy.bytes);
  }
  ASSERT_TRUE(pool->Copy(copies).ok());
  ExpectPagesMatchMirror(*pool, pages);
  ReleaseAll(*pool, pages);
}

// A copy that reads a page an earlier copy of the same call wrote sees the new bytes.
TEST_P(TransferTest, CopiesTakeEffectInOrder) {
  auto pool = MakePool(1024, 16 * 1024);
  ASSERT_NE(pool, nullptr);
  const std::vector<PageId> pages = AllocateFilled(*pool, 4);
  const std::vector<PageCopy> chain = {{pages[0], pages[1], 0, 1024},
                                       {pages[1], pages[2], 2, 500},
                                       {pages[3], pages[0], 0, 1024},
                                       {pages[2], pages[2], 0, 1024}};
  for (const PageCopy& copy : chain) {
    std::memcpy(mirror_[copy.dst].data() + copy.offset, mirror_[copy.src].data() + copy.offset,
                copy.bytes);
  }
  ASSERT_TRUE(pool->Copy(chain).ok());
  ExpectPagesMatchMirror(*pool, pages);
  ReleaseAll(*pool, pages);
}

// 48 MiB in one call: more than a lane's staging ring (8 MiB, a quarter of
// 32 MiB), so several submissions.
TEST_P(TransferTest, BatchesLargerThanTheStagingRing) {
  constexpr uint64_t kPageBytes = 256 << 10;
  auto pool = MakePool(kPageBytes, 48 << 20);
  ASSERT_NE(pool, nullptr);
  const std::vector<PageId> pages = AllocateFilled(*pool, 192);
  std::vector<Bytes> actual(pages.size(), Bytes(kPageBytes));
  std::vector<ReadRun> runs;
  for (size_t i = 0; i < pages.size(); ++i)
    runs.push_back({pages[i], 0, actual[i].data(), kPageBytes});
  ASSERT_TRUE(pool->Read(runs).ok());
  for (size_t i = 0; i < pages.size(); ++i) {
    ASSERT_TRUE(actual[i] == mirror_[pages[i]]) << "page " << pages[i];
  }
  ReleaseAll(*pool, pages);
}

// Calls of megabytes are shared out among the host workers on the direct path
// (gpu/shared_copies.h): whole pages (streamed) and short pieces, in one call.
TEST_P(TransferTest, LargeCallsOfMixedRunsRoundTrip) {
  auto pool = MakePool(64 << 10, 8 << 20);
  ASSERT_NE(pool, nullptr);
  const std::vector<PageId> pages = AllocateFilled(*pool, 96);
  WriteRandomPieces(*pool, pages, 1);
  ExpectPagesMatchMirror(*pool, pages, 1);
  ReleaseAll(*pool, pages);
}

// More runs in one call than one submission's run table holds (16384).
TEST_P(TransferTest, ManySmallRunsInOneCall) {
  auto pool = MakePool(4096, 64 * 4096);
  ASSERT_NE(pool, nullptr);
  const std::vector<PageId> pages = AllocateFilled(*pool, 48);
  std::vector<WriteRun> runs;
  const Bytes source = RandomBytes(6, rng_);
  for (PageId page : pages) {
    for (uint64_t offset = 2; offset + 6 <= 4096; offset += 8) {  // 511 runs per page
      runs.push_back({page, offset, source.data(), 6});
      std::memcpy(mirror_[page].data() + offset, source.data(), 6);
    }
  }
  ASSERT_GT(runs.size(), 16384u);
  ASSERT_TRUE(pool->Write(runs).ok());
  ExpectPagesMatchMirror(*pool, pages);
  ReleaseAll(*pool, pages);
}

TEST_P(TransferTest, ConcurrentWritersOnDistinctPages) {
  auto pool = MakePool(16 << 10, 8 << 20);
  ASSERT_NE(pool, nullptr);
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<int> mismatches(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int round = 0; round < 10; ++round) {
        std::vector<PageId> pages;
        if (!pool->Allocate(8, pages).ok()) {
          ++mismatches[t];
          return;
        }
        const Bytes data = RandomBytes(8 * pool->page_bytes(), rng);
        Bytes back(data.size());
        std::vector<WriteRun> writes;
        std::vector<ReadRun> reads;
        for (size_t i = 0; i < pages.size(); ++i) {
          const uint64_t at = i * pool->page_bytes();
          writes.push_back({pages[i], 0, data.data() + at, pool->page_bytes()});
          reads.push_back({pages[i], 0, back.data() + at, pool->page_bytes()});
        }
        if (!pool->Write(writes).ok() || !pool->Read(reads).ok() || back != data) ++mismatches[t];
        for (PageId page : pages) pool->Release(page);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches, std::vector<int>(kThreads, 0));
  EXPECT_EQ(pool->stats().used_pages, 0u);
}

// A pool large enough for every staging lane: eight threads write, copy
// between and read back pages of their own at once, each byte checked.
TEST_P(TransferTest, ConcurrentCallsOnEveryLane) {
  constexpr uint64_t kPageBytes = 64 << 10;
  auto pool = MakePool(kPageBytes, 64 << 20);
  ASSERT_NE(pool, nullptr);
  constexpr int kThreads = 8;
  std::vector<std::thread> threads;
  std::vector<int> mismatches(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      for (int round = 0; round < 20; ++round) {
        std::vector<PageId> pages;
        if (!pool->Allocate(16, pages).ok()) {
          ++mismatches[t];
          return;
        }
        const Bytes data = RandomBytes(8 * kPageBytes, rng);
        Bytes back(2 * data.size());
        std::vector<WriteRun> writes;
        std::vector<PageCopy> copies;
        std::vector<ReadRun> reads;
        for (size_t i = 0; i < 8; ++i) {
          writes.push_back({pages[i], 0, data.data() + i * kPageBytes, kPageBytes});
          copies.push_back({pages[i], pages[8 + i], 0, kPageBytes});
        }
        for (size_t i = 0; i < 16; ++i) {
          reads.push_back({pages[i], 0, back.data() + i * kPageBytes, kPageBytes});
        }
        const bool done =
            pool->Write(writes).ok() && pool->Copy(copies).ok() && pool->Read(reads).ok();
        if (!done || !std::equal(data.begin(), data.end(), back.begin()) ||
            !std::equal(data.begin(), data.end(), back.begin() + data.size())) {
          ++mismatches[t];
        }
        for (PageId page : pages) pool->Release(page);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches, std::vector<int>(kThreads, 0));
  EXPECT_EQ(pool->stats().used_pages, 0u);
}

TEST_P(TransferTest, RejectsRunsOutsideAPageAndWritesNothing) {
  auto pool = MakePool(1024, 8 * 1024);
  ASSERT_NE(pool, nullptr);
  const std::vector<PageId> pages = AllocateFilled(*pool, 2);
  const Bytes junk(2048, std::byte{0x5a});
  const std::vector<WriteRun> crossing = {{pages[0], 0, junk.data(), 512},
                                          {pages[1], 1000, junk.data(), 26}};
  EXPECT_EQ(pool->Write(crossing).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<WriteRun> unbacked = {{pages[0], 0, junk.data(), 16},
                                          {1000, 0, junk.data(), 16}};
  EXPECT_EQ(pool->Write(unbacked).code(), absl::StatusCode::kInvalidArgument);
  Bytes out(16);
  EXPECT_EQ(pool->Read({{kNoPage, 0, out.data(), 16}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->Copy({{pages[0], pages[1], 1000, 100}}).code(),
            absl::StatusCode::kInvalidArgument);
  ExpectPagesMatchMirror(*pool, pages);
  ReleaseAll(*pool, pages);
}

TEST_P(TransferTest, EmptyCallsAndZeroByteRunsDoNothing) {
  auto pool = MakePool(1024, 8 * 1024);
  ASSERT_NE(pool, nullptr);
  const std::vector<PageId> pages = AllocateFilled(*pool, 2);
  EXPECT_TRUE(pool->Write({}).ok());
  EXPECT_TRUE(pool->Read({}).ok());
  EXPECT_TRUE(pool->Copy({}).ok());
  EXPECT_TRUE(pool->Write({{pages[0], 1024, nullptr, 0}}).ok());
  EXPECT_TRUE(pool->Read({{pages[0], 10, nullptr, 0}}).ok());
  EXPECT_TRUE(pool->Copy({{pages[0], pages[1], 8, 0}}).ok());
  ExpectPagesMatchMirror(*pool, pages);
  ReleaseAll(*pool, pages);
}

INSTANTIATE_TEST_SUITE_P(AllPaths, TransferTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::gpu
