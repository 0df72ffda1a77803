// engine/layers/row_assembly.h on its own: rows of a quantized page layout (six
// planes) moved between tables of different batch sizes and page sizes, with
// shifts, several held ranges and zero fill, checked plane row by plane row
// against a host mirror; and its all-or-nothing failures.
#include "engine/layers/row_assembly.h"

#include <cstring>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "engine/layers/token_store.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {
namespace {

using engine::PageGeometry;
using engine::PageTable;
using engine::RowCopy;
using engine::TokenRange;
using Bytes = std::vector<std::byte>;

constexpr uint64_t kPageBytes = 4096;

// mlx affine 4-bit, group 32: planes K wq (32 B), scales (4 B), biases (4 B), then V's.
PageGeometry Quantized(uint32_t batch, uint32_t page_tokens) {
  return PageGeometry{.batch = batch,
                      .heads = 2,
                      .k_dim = 64,
                      .v_dim = 64,
                      .elem_bytes = 2,
                      .page_tokens = page_tokens,
                      .group_size = 32,
                      .bits = 4};
}

TEST(LandingRangesTest, ClipsToFirstAndToTheTargetRanges) {
  using engine::LandingRanges;
  const std::vector<TokenRange> source = {{0, 4}, {10, 20}};
  // Shift +2, copied from 3 on, target {[0,5), [14,30)}: [3,4)->[5,6) is outside,
  // [10,20)->[12,22) keeps [14,22), i.e. source [12,20).
  EXPECT_EQ(LandingRanges(source, 3, 2, {{0, 5}, {14, 30}}), (std::vector<TokenRange>{{12, 20}}));
  // Shift -11: [0,4) lands below 0; [10,20) -> [-1,9), clipped to [0,9) = source [11,20).
  EXPECT_EQ(LandingRanges(source, 0, -11, {{0, 100}}), (std::vector<TokenRange>{{11, 20}}));
  EXPECT_TRUE(LandingRanges(source, 20, 0, {{0, 100}}).empty());
}

class RowAssemblyTest : public GpuTestBase {
 protected:
  void SetUp() override {
    GpuTestBase::SetUp();
    pool_ = MakePool(kPageBytes, 64 * kPageBytes);
    ASSERT_NE(pool_, nullptr);
  }
  void TearDown() override {
    source_.reset();
    if (pool_ != nullptr) {
      EXPECT_EQ(pool_->stats().used_pages, 0u) << "pages leaked";
    }
    pool_.reset();
    GpuTestBase::TearDown();
  }

  // A source table of `geometry` holding random bytes at positions [0, end).
  void FillSource(const PageGeometry& geometry, uint64_t end) {
    source_geometry_ = geometry;
    source_ = std::make_unique<PageTable>(pool_.get());
    const uint64_t pages = engine::PagesFor(end, geometry.page_tokens);
    std::vector<gpu::PageId> ids;
    ASSERT_TRUE(pool_->Allocate(pages, ids).ok());
    std::vector<gpu::WriteRun> runs;
    for (uint64_t i = 0; i < pages; ++i) {
      Bytes& bytes = source_bytes_[ids[i]];
      bytes.resize(kPageBytes);
      for (std::byte& b : bytes) b = static_cast<std::byte>(rng_());
      runs.push_back({ids[i], 0, bytes.data(), kPageBytes});
      source_->Set(i, ids[i]);
    }
    ASSERT_TRUE(pool_->Write(runs).ok());
  }

  // The bytes plane row (plane, row, head) of position p holds in `table`.
  Bytes ReadPlaneRow(const PageTable& table, const PageGeometry& g, uint32_t plane, uint32_t row,
                     uint32_t head, uint64_t p) {
    Bytes out(g.PlaneRowBytes(plane));
    gpu::ReadRun run{table.Get(p / g.page_tokens),
                     g.PlaneOffset(plane, row * g.heads + head, p % g.page_tokens), out.data(),
                     out.size()};
    EXPECT_TRUE(pool_->Read({&run, 1}).ok());
    return out;
  }

  // What the source mirror holds there.
  Bytes SourcePlaneRow(uint32_t plane, uint32_t row, uint32_t head, uint64_t p) {
    const PageGeometry& g = source_geometry_;
    const Bytes& page = source_bytes_[source_->Get(p / g.page_tokens)];
    const uint64_t at = g.PlaneOffset(plane, row * g.heads + head, p % g.page_tokens);
    return Bytes(page.begin() + at, page.begin() + at + g.PlaneRowBytes(plane));
  }

  std::unique_ptr<gpu::PagePool> pool_;
  std::unique_ptr<PageTable> source_;
  PageGeometry source_geometry_;
  std::map<gpu::PageId, Bytes> source_bytes_;
  std::mt19937_64 rng_{5};
};

TEST_P(RowAssemblyTest, MovesQuantizedRowsBetweenLayoutsAndZeroFillsTheRest) {
  FillSource(Quantized(3, 5), 12);
  const PageGeometry target = Quantized(2, 3);
  const std::vector<TokenRange> held = {{0, 2}, {4, 11}};  // like sinks, then a window
  std::vector<RowCopy> rows(2);
  rows[0] = {.table = source_.get(),
             .geometry = &source_geometry_,
             .row = 2,
             .ranges = {{2, 9}},
             .shift = 1};  // lands [3, 10)
  rows[1] = {.table = source_.get(),
             .geometry = &source_geometry_,
             .row = 0,
             .ranges = {{0, 4}, {6, 12}},
             .shift = -2};  // lands [-2, 2) and [4, 10)
  PageTable table(pool_.get());
  ASSERT_TRUE(engine::AssembleRowsInto(table, target, held, rows).ok());
  EXPECT_EQ(table.CountPages(), 4u);  // pages 0 (positions 0-1) and 1-3 (4-10)
  for (const TokenRange& range : held) {
    for (uint64_t p = range.begin; p < range.end; ++p) {
      for (uint32_t r = 0; r < 2; ++r) {
        const int64_t src = static_cast<int64_t>(p) - rows[r].shift;
        bool from_source = false;
        for (const TokenRange& s : rows[r].ranges)
          from_source |= src >= int64_t(s.begin) && src < int64_t(s.end);
        for (uint32_t plane = 0; plane < 6; ++plane) {
          for (uint32_t h = 0; h < 2; ++h) {
            const Bytes expected = from_source ? SourcePlaneRow(plane, rows[r].row, h, src)
                                               : Bytes(target.PlaneRowBytes(plane));
            ASSERT_EQ(ReadPlaneRow(table, target, plane, r, h, p), expected)
                << "position " << p << " row " << r << " plane " << plane << " head " << h;
          }
        }
      }
    }
  }
}

TEST_P(RowAssemblyTest, RunsOutOfPagesWithoutChangingOrLeaking) {
  FillSource(Quantized(1, 8), 16);  // 2 pages
  std::vector<gpu::PageId> hog;
  ASSERT_TRUE(pool_->Allocate(pool_->available_pages() - 2, hog).ok());
  const uint32_t used = pool_->stats().used_pages;
  PageTable table(pool_.get());
  const PageGeometry target = Quantized(1, 2);
  const RowCopy row{.table = source_.get(), .geometry = &source_geometry_, .ranges = {{0, 16}}};
  const absl::Status status = engine::AssembleRowsInto(table, target, {{0, 16}}, {&row, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_EQ(table.CountPages(), 0u);
  EXPECT_EQ(pool_->stats().used_pages, used);
  for (gpu::PageId page : hog) pool_->Release(page);
}

TEST_P(RowAssemblyTest, RefusesOtherDimsAndMissingPagesWithoutLeaking) {
  FillSource(Quantized(1, 4), 4);
  PageTable table(pool_.get());
  PageGeometry other = Quantized(1, 4);
  other.bits = 8;
  const RowCopy row{.table = source_.get(), .geometry = &source_geometry_, .ranges = {{0, 4}}};
  EXPECT_EQ(engine::AssembleRowsInto(table, other, {{0, 4}}, {&row, 1}).code(),
            absl::StatusCode::kFailedPrecondition);
  const RowCopy beyond{.table = source_.get(), .geometry = &source_geometry_, .ranges = {{0, 8}}};
  EXPECT_EQ(engine::AssembleRowsInto(table, Quantized(1, 4), {{0, 8}}, {&beyond, 1}).code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(table.CountPages(), 0u);
  EXPECT_EQ(pool_->stats().used_pages, 1u);  // the source's page only
}

INSTANTIATE_TEST_SUITE_P(AllPaths, RowAssemblyTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
