// The quantize / dequantize shaders (gpu/quantizer.h) against the CPU
// reference (support/ref_quantizer.h), on every transfer path: packed words,
// scales and biases byte for byte, dequantized values byte for byte, partial
// writes that leave neighbouring rows alone, and bad runs refused whole.
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/quantizer.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"
#include "support/ref_quantizer.h"

namespace kvcache::testing {
namespace {

using gpu::DequantizeJob;
using gpu::PageId;
using gpu::QuantFormat;
using gpu::QuantizeJob;
using gpu::QuantRun;

constexpr uint64_t kPageBytes = 64 << 10;
// Rows each page plane holds in these tests: odd, so that with one 16-bit
// scale a row the biases plane is out of phase with the scales plane.
constexpr uint32_t kSlots = 33;
constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
constexpr uint32_t kGroupSizes[] = {32, 64, 128};
constexpr uint32_t kBits[] = {4, 8};

RefQuantFormat RefFormat(const QuantFormat& f) { return {f.dtype, f.group_size, f.bits}; }

std::string FormatName(const QuantFormat& f) {
  return absl::StrCat(std::string(DTypeName(f.dtype)), " dim ", f.dim, " group ", f.group_size,
                      " bits ", f.bits);
}

// Planes of kSlots rows each, back to back from `base`: wq, scales, biases.
QuantRun RunAt(const QuantFormat& f, PageId page, uint32_t slot, uint64_t first_row, uint32_t rows,
               uint64_t base = 0) {
  const uint64_t scales = base + kSlots * f.wq_row_bytes();
  const uint64_t biases = scales + kSlots * f.scale_row_bytes();
  return QuantRun{.page = page,
                  .wq_offset = base + slot * f.wq_row_bytes(),
                  .scales_offset = scales + slot * f.scale_row_bytes(),
                  .biases_offset = biases + slot * f.scale_row_bytes(),
                  .first_row = first_row,
                  .rows = rows};
}

// The three planes of `run` read back from the pool, as RefPacked.
RefPacked ReadPlanes(gpu::PagePool& pool, const QuantFormat& f, const QuantRun& run) {
  RefPacked packed;
  packed.wq.resize(run.rows * f.wq_row_bytes());
  packed.scales.resize(run.rows * f.scale_row_bytes());
  packed.biases.resize(run.rows * f.scale_row_bytes());
  const gpu::ReadRun reads[] = {
      {run.page, run.wq_offset, packed.wq.data(), packed.wq.size()},
      {run.page, run.scales_offset, packed.scales.data(), packed.scales.size()},
      {run.page, run.biases_offset, packed.biases.data(), packed.biases.size()}};
  EXPECT_TRUE(pool.Read(reads).ok());
  return packed;
}

// The reference's packed form of rows [first, first + rows) of `input`.
RefPacked ReferenceRows(const QuantFormat& f, const std::vector<std::byte>& input, uint64_t first,
                        uint64_t rows) {
  return RefQuantize(RefFormat(f), absl::MakeConstSpan(input).subspan(first * f.row_bytes(),
                                                                      rows * f.row_bytes()));
}

// Byte-for-byte equality, naming the first difference (gtest would print
// every byte of both).
::testing::AssertionResult SameBytes(const std::vector<std::byte>& expected,
                                     const std::vector<std::byte>& actual) {
  if (expected.size() != actual.size()) {
    return ::testing::AssertionFailure() << actual.size() << " bytes, expected " << expected.size();
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i] != actual[i]) {
      return ::testing::AssertionFailure()
             << "byte " << i << " is 0x" << std::hex << static_cast<int>(actual[i])
             << ", expected 0x" << static_cast<int>(expected[i]);
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult SamePlanes(const RefPacked& expected, const RefPacked& actual) {
  if (auto same = SameBytes(expected.wq, actual.wq); !same) return same << " (wq)";
  if (auto same = SameBytes(expected.scales, actual.scales); !same) return same << " (scales)";
  if (auto same = SameBytes(expected.biases, actual.biases); !same) return same << " (biases)";
  return ::testing::AssertionSuccess();
}

// `bytes` cut into three pieces at unaligned points, as gRPC slices arrive.
std::vector<absl::Span<const std::byte>> Pieces(const std::vector<std::byte>& bytes) {
  const absl::Span<const std::byte> all(bytes);
  const size_t a = bytes.size() / 3 + 1;
  const size_t b = bytes.size() / 2 + 3;
  return {all.subspan(0, a), all.subspan(a, b - a), all.subspan(b)};
}

std::vector<std::byte> PageBytes(gpu::PagePool& pool, PageId page) {
  std::vector<std::byte> bytes(kPageBytes);
  const gpu::ReadRun read{page, 0, bytes.data(), bytes.size()};
  EXPECT_TRUE(pool.Read({&read, 1}).ok());
  return bytes;
}

void FillPage(gpu::PagePool& pool, PageId page, std::byte value) {
  const std::vector<std::byte> bytes(kPageBytes, value);
  const gpu::WriteRun write{page, 0, bytes.data(), bytes.size()};
  ASSERT_TRUE(pool.Write({&write, 1}).ok());
}

// |dequantized - input| within one quantization step (RefErrorBound).
void ExpectWithinOneStep(const QuantFormat& f, const std::vector<std::byte>& input,
                         const RefPacked& packed, const std::vector<std::byte>& dequantized) {
  const uint32_t elem = DTypeSize(f.dtype);
  for (uint64_t i = 0; i < input.size() / elem; ++i) {
    const uint64_t g = i / f.group_size;
    const float scale = RefLoad(f.dtype, packed.scales.data() + g * elem);
    const float bias = RefLoad(f.dtype, packed.biases.data() + g * elem);
    const float x = RefLoad(f.dtype, input.data() + i * elem);
    const float y = RefLoad(f.dtype, dequantized.data() + i * elem);
    ASSERT_LE(std::abs(double{x} - y), RefErrorBound(RefFormat(f), scale, bias, x))
        << "value " << i << ": " << x << " came back as " << y;
  }
}

// Every test runs once per kernel the path can run (QuantKernels): the
// shaders, and on host-mapped pages the native CPU kernels too.
class QuantizeTest : public GpuTestBase {
 protected:
  void TearDown() override {
    DropPool();
    GpuTestBase::TearDown();
  }
  // A fresh pool quantizing with `kernel`, with three pages in pages_.
  ::testing::AssertionResult UsePool(gpu::QuantKernel kernel) {
    DropPool();
    pool_ = MakePool(kPageBytes, 4 << 20, kernel);
    if (pool_ == nullptr) return ::testing::AssertionFailure() << "no pool";
    if (pool_->quantizes_on_host() != (kernel == gpu::QuantKernel::kHost)) {
      return ::testing::AssertionFailure() << "the pool did not take the kernel";
    }
    if (!pool_->Allocate(3, pages_).ok()) return ::testing::AssertionFailure() << "no pages";
    return ::testing::AssertionSuccess();
  }
  void DropPool() {
    for (PageId page : pages_) pool_->Release(page);
    pages_.clear();
    if (pool_ != nullptr) {
      EXPECT_EQ(pool_->stats().used_pages, 0u);
    }
    pool_.reset();
  }

  // Quantizes 24 rows into two runs (page 0 slots [0, 10), page 1 slots
  // [3, 17)) from three pieces; checks the planes, then dequantizes them back.
  void CheckFormat(const QuantFormat& f, std::mt19937_64& rng) {
    SCOPED_TRACE(FormatName(f));
    const std::vector<std::byte> input =
        RandomQuantizableValues(f.dtype, 24ull * f.dim, f.group_size, rng);
    const std::vector<absl::Span<const std::byte>> pieces = Pieces(input);
    const QuantRun runs[] = {RunAt(f, pages_[0], 0, 0, 10), RunAt(f, pages_[1], 3, 10, 14)};
    const QuantizeJob job{f, pieces, runs};
    ASSERT_TRUE(pool_->Quantize({&job, 1}).ok());
    for (const QuantRun& run : runs) {
      ASSERT_TRUE(
          SamePlanes(ReferenceRows(f, input, run.first_row, run.rows), ReadPlanes(*pool_, f, run)))
          << "rows from " << run.first_row;
    }
    std::vector<std::byte> output(input.size(), std::byte{0xEE});
    const DequantizeJob back{f, runs, absl::MakeSpan(output)};
    ASSERT_TRUE(pool_->Dequantize({&back, 1}).ok());
    const RefPacked all = ReferenceRows(f, input, 0, 24);
    ASSERT_TRUE(SameBytes(RefDequantize(RefFormat(f), all), output)) << "dequantized";
    ExpectWithinOneStep(f, input, all, output);
  }

  void CheckLargeCall(gpu::QuantKernel kernel);

  std::unique_ptr<gpu::PagePool> pool_;
  std::vector<PageId> pages_;
};

TEST_P(QuantizeTest, EveryFormatMatchesTheCpuReference) {
  for (gpu::QuantKernel kernel : QuantKernels()) {
    SCOPED_TRACE(QuantKernelName(kernel));
    ASSERT_TRUE(UsePool(kernel));
    std::mt19937_64 rng(11);
    for (DType dtype : kDTypes) {
      for (uint32_t group : kGroupSizes) {
        for (uint32_t bits : kBits) {
          CheckFormat({.dtype = dtype, .dim = 256, .group_size = group, .bits = bits}, rng);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST_P(QuantizeTest, DimEqualToTheGroupAndUnalignedPlanes) {
  for (gpu::QuantKernel kernel : QuantKernels()) {
    SCOPED_TRACE(QuantKernelName(kernel));
    ASSERT_TRUE(UsePool(kernel));
    // One group per row (16-bit scales of neighbouring rows share words), and
    // wq at a 4-byte but not 16-byte boundary.
    std::mt19937_64 rng(12);
    for (DType dtype : kDTypes) {
      const QuantFormat f{.dtype = dtype, .dim = 32, .group_size = 32, .bits = 4};
      SCOPED_TRACE(FormatName(f));
      const std::vector<std::byte> input = RandomQuantizableValues(dtype, 9ull * 32, 32, rng);
      const QuantRun run = RunAt(f, pages_[2], 5, 0, 9, /*base=*/4);
      const std::vector<absl::Span<const std::byte>> pieces = Pieces(input);
      const QuantizeJob job{f, pieces, {&run, 1}};
      ASSERT_TRUE(pool_->Quantize({&job, 1}).ok());
      EXPECT_TRUE(SamePlanes(ReferenceRows(f, input, 0, 9), ReadPlanes(*pool_, f, run)));
    }
  }
}

// Rows written at odd slots change their own bytes only: the 16-bit scales of
// the rows before and after share 32-bit words with them.
TEST_P(QuantizeTest, PartialPageWritesLeaveNeighboursAlone) {
  for (gpu::QuantKernel kernel : QuantKernels()) {
    SCOPED_TRACE(QuantKernelName(kernel));
    ASSERT_TRUE(UsePool(kernel));
    std::mt19937_64 rng(13);
    for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
      const QuantFormat f{.dtype = dtype, .dim = 64, .group_size = 64, .bits = 8};
      SCOPED_TRACE(FormatName(f));
      FillPage(*pool_, pages_[0], std::byte{0x3C});
      const std::vector<std::byte> before = PageBytes(*pool_, pages_[0]);
      const std::vector<std::byte> input = RandomQuantizableValues(dtype, 5ull * 64, 64, rng);
      const QuantRun runs[] = {RunAt(f, pages_[0], 3, 0, 1), RunAt(f, pages_[0], 7, 1, 3),
                               RunAt(f, pages_[0], 13, 4, 1)};
      const std::vector<absl::Span<const std::byte>> pieces = Pieces(input);
      const QuantizeJob job{f, pieces, runs};
      ASSERT_TRUE(pool_->Quantize({&job, 1}).ok());
      std::vector<std::byte> expected = before;
      for (const QuantRun& run : runs) {
        const RefPacked ref = ReferenceRows(f, input, run.first_row, run.rows);
        std::memcpy(expected.data() + run.wq_offset, ref.wq.data(), ref.wq.size());
        std::memcpy(expected.data() + run.scales_offset, ref.scales.data(), ref.scales.size());
        std::memcpy(expected.data() + run.biases_offset, ref.biases.data(), ref.biases.size());
      }
      EXPECT_TRUE(SameBytes(expected, PageBytes(*pool_, pages_[0])));
    }
  }
}

// Larger than the scratch buffer (32 MiB) and than the run table (16384 runs):
// several submissions, the same bytes.
TEST_P(QuantizeTest, CallsLargerThanOneSubmission) {
  for (gpu::QuantKernel kernel : QuantKernels()) {
    SCOPED_TRACE(QuantKernelName(kernel));
    CheckLargeCall(kernel);
    if (HasFailure()) return;
  }
}

void QuantizeTest::CheckLargeCall(gpu::QuantKernel kernel) {
  auto pool = MakePool(kPageBytes, 24 << 20, kernel);
  ASSERT_NE(pool, nullptr);
  const QuantFormat f{.dtype = DType::kFloat32, .dim = 512, .group_size = 128, .bits = 4};
  const uint32_t rows_per_page = kPageBytes / (f.wq_row_bytes() + 2 * f.scale_row_bytes());
  const uint64_t rows = (36ull << 20) / f.row_bytes();  // 36 MiB of input
  std::vector<PageId> pages;
  ASSERT_TRUE(pool->Allocate((rows + rows_per_page - 1) / rows_per_page, pages).ok());
  std::mt19937_64 rng(14);
  const std::vector<std::byte> input = RandomQuantizableValues(f.dtype, rows * f.dim, 128, rng);
  // One run per row: 18432 runs.
  std::vector<QuantRun> runs;
  for (uint64_t row = 0; row < rows; ++row) {
    const uint32_t slot = row % rows_per_page;
    const uint64_t scales = rows_per_page * f.wq_row_bytes();
    runs.push_back({pages[row / rows_per_page], slot * f.wq_row_bytes(),
                    scales + slot * f.scale_row_bytes(),
                    scales + (rows_per_page + slot) * f.scale_row_bytes(), row, 1});
  }
  const std::vector<absl::Span<const std::byte>> one_piece = {input};
  const QuantizeJob whole{f, one_piece, runs};
  ASSERT_TRUE(pool->Quantize({&whole, 1}).ok());
  std::vector<std::byte> output(input.size());
  const DequantizeJob back{f, runs, absl::MakeSpan(output)};
  ASSERT_TRUE(pool->Dequantize({&back, 1}).ok());
  const RefPacked expected = RefQuantize(RefFormat(f), input);
  EXPECT_TRUE(SameBytes(RefDequantize(RefFormat(f), expected), output));
  for (size_t i : {size_t{0}, runs.size() / 2, runs.size() - 1}) {
    EXPECT_TRUE(SamePlanes(ReferenceRows(f, input, i, 1), ReadPlanes(*pool, f, runs[i])))
        << "row " << i;
  }
  for (PageId page : pages) pool->Release(page);
}

INSTANTIATE_TEST_SUITE_P(AllPaths, QuantizeTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
