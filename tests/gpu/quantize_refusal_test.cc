// Quantize / Dequantize refuse bad formats and runs with INVALID_ARGUMENT that
// names the job, run and field, and then write nothing at all: not even the
// valid job that came before the bad one.
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/quantizer.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {
namespace {

using gpu::DequantizeJob;
using gpu::PageId;
using gpu::QuantFormat;
using gpu::QuantizeJob;
using gpu::QuantRun;
using ::testing::HasSubstr;

constexpr uint64_t kPageBytes = 16 << 10;
constexpr QuantFormat kFormat{.dtype = DType::kFloat16, .dim = 64, .group_size = 32, .bits = 4};
constexpr uint32_t kRows = 4;

// kRows rows at the start of `page`: wq, then scales, then biases.
QuantRun GoodRun(PageId page) {
  return {.page = page,
          .wq_offset = 0,
          .scales_offset = kRows * kFormat.wq_row_bytes(),
          .biases_offset = kRows * (kFormat.wq_row_bytes() + kFormat.scale_row_bytes()),
          .first_row = 0,
          .rows = kRows};
}

struct BadCase {
  std::string name;
  std::function<void(QuantFormat&, QuantRun&, uint64_t& input_bytes)> spoil;
  std::string message;  // a part of the expected error
};

std::vector<BadCase> BadCases() {
  return {
      {"group size", [](QuantFormat& f, QuantRun&, uint64_t&) { f.group_size = 48; },
       "jobs[1].format.group_size: 48"},
      {"bits", [](QuantFormat& f, QuantRun&, uint64_t&) { f.bits = 3; }, "jobs[1].format.bits"},
      {"dim",
       [](QuantFormat& f, QuantRun&, uint64_t& bytes) {
         f.dim = 48;
         bytes = 0;
       },
       "jobs[1].format.dim: 48"},
      {"dtype", [](QuantFormat& f, QuantRun&, uint64_t&) { f.dtype = static_cast<DType>(9); },
       "jobs[1].format.dtype"},
      {"partial row", [](QuantFormat&, QuantRun&, uint64_t& bytes) { bytes += 2; },
       "jobs[1]: a 514-byte tensor"},
      {"rows past the tensor", [](QuantFormat&, QuantRun& run, uint64_t&) { run.first_row = 1; },
       "jobs[1].runs[0]: rows [1, 5)"},
      {"unbacked page", [](QuantFormat&, QuantRun& run, uint64_t&) { run.page = 1000; },
       "page 1000 is not a page of this pool"},
      {"wq past the page",
       [](QuantFormat&, QuantRun& run, uint64_t&) { run.wq_offset = kPageBytes - 64; }, "wq bytes"},
      {"biases past the page",
       [](QuantFormat&, QuantRun& run, uint64_t&) { run.biases_offset = kPageBytes - 2; },
       "biases bytes"},
      {"misaligned wq", [](QuantFormat&, QuantRun& run, uint64_t&) { run.wq_offset = 1000 + 2; },
       "wq at page byte 1002 is not 4-byte aligned"},
      {"misaligned scales", [](QuantFormat&, QuantRun& run, uint64_t&) { run.scales_offset += 1; },
       "2-byte aligned"},
  };
}

class QuantizeRefusalTest : public GpuTestBase {
 protected:
  void SetUp() override {
    GpuTestBase::SetUp();
    pool_ = MakePool(kPageBytes, 1 << 20);
    ASSERT_NE(pool_, nullptr);
    ASSERT_TRUE(pool_->Allocate(2, pages_).ok());
    const std::vector<std::byte> pattern(kPageBytes, std::byte{0x7B});
    for (PageId page : pages_) {
      const gpu::WriteRun write{page, 0, pattern.data(), pattern.size()};
      ASSERT_TRUE(pool_->Write({&write, 1}).ok());
    }
    snapshot_ = Pages();
  }
  void TearDown() override {
    for (PageId page : pages_) pool_->Release(page);
    GpuTestBase::TearDown();
  }

  std::vector<std::byte> Pages() {
    std::vector<std::byte> bytes(2 * kPageBytes);
    const gpu::ReadRun reads[] = {{pages_[0], 0, bytes.data(), kPageBytes},
                                  {pages_[1], 0, bytes.data() + kPageBytes, kPageBytes}};
    EXPECT_TRUE(pool_->Read(reads).ok());
    return bytes;
  }

  std::unique_ptr<gpu::PagePool> pool_;
  std::vector<PageId> pages_;
  std::vector<std::byte> snapshot_;
};

TEST_P(QuantizeRefusalTest, QuantizeRefusesAndWritesNothing) {
  const std::vector<std::byte> input(kRows * kFormat.row_bytes() + 64, std::byte{0x11});
  for (const BadCase& bad : BadCases()) {
    SCOPED_TRACE(bad.name);
    QuantFormat format = kFormat;
    QuantRun run = GoodRun(pages_[1]);
    uint64_t bytes = kRows * kFormat.row_bytes();
    bad.spoil(format, run, bytes);
    const QuantRun good = GoodRun(pages_[0]);
    const absl::Span<const std::byte> good_piece(input.data(), kRows * kFormat.row_bytes());
    const absl::Span<const std::byte> bad_piece(input.data(), bytes);
    const QuantizeJob jobs[] = {{kFormat, {&good_piece, 1}, {&good, 1}},
                                {format, {&bad_piece, 1}, {&run, 1}}};
    const absl::Status status = pool_->Quantize(jobs);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(bad.message));
    EXPECT_THAT(std::string(status.message()), HasSubstr("Quantize"));
    EXPECT_TRUE(Pages() == snapshot_) << "a refused call changed a page";
  }
}

TEST_P(QuantizeRefusalTest, DequantizeRefusesAndWritesNothing) {
  for (const BadCase& bad : BadCases()) {
    SCOPED_TRACE(bad.name);
    QuantFormat format = kFormat;
    QuantRun run = GoodRun(pages_[1]);
    uint64_t bytes = kRows * kFormat.row_bytes();
    bad.spoil(format, run, bytes);
    const QuantRun good = GoodRun(pages_[0]);
    std::vector<std::byte> good_out(kRows * kFormat.row_bytes(), std::byte{0x22});
    std::vector<std::byte> bad_out(bytes, std::byte{0x22});
    const DequantizeJob jobs[] = {{kFormat, {&good, 1}, absl::MakeSpan(good_out)},
                                  {format, {&run, 1}, absl::MakeSpan(bad_out)}};
    const absl::Status status = pool_->Dequantize(jobs);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(bad.message));
    EXPECT_THAT(std::string(status.message()), HasSubstr("Dequantize"));
    EXPECT_EQ(good_out, std::vector<std::byte>(good_out.size(), std::byte{0x22}));
  }
}

TEST_P(QuantizeRefusalTest, NothingToDoIsNotAnError) {
  const QuantRun empty{.page = pages_[0],
                       .wq_offset = 0,
                       .scales_offset = 0,
                       .biases_offset = 0,
                       .first_row = 0,
                       .rows = 0};
  const QuantizeJob quantize{kFormat, {}, {&empty, 1}};
  EXPECT_TRUE(pool_->Quantize({}).ok());
  EXPECT_TRUE(pool_->Quantize({&quantize, 1}).ok());
  const DequantizeJob dequantize{kFormat, {&empty, 1}, {}};
  EXPECT_TRUE(pool_->Dequantize({&dequantize, 1}).ok());
  EXPECT_TRUE(Pages() == snapshot_);
}

// The CPU kernels write pages through their host mapping: a pool without one
// (the staging path) refuses them by name, and the auto choice falls back to
// the shaders there.
TEST_P(QuantizeRefusalTest, HostKernelsNeedHostMappedPages) {
  gpu::PoolOptions options{.page_bytes = 64 << 10, .budget_bytes = 1 << 20,
                           .quantize_kernel = gpu::QuantKernel::kHost};
  auto pool = gpu::PagePool::Create(device(), options);
  if (device().direct_host_access()) {
    ASSERT_TRUE(pool.ok()) << pool.status();
    EXPECT_TRUE((*pool)->quantizes_on_host());
    return;
  }
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(pool.status().message().find("quantize_kernel"), std::string::npos) << pool.status();
  options.quantize_kernel = gpu::QuantKernel::kAuto;
  auto fallback = gpu::PagePool::Create(device(), options);
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_FALSE((*fallback)->quantizes_on_host());
}

INSTANTIATE_TEST_SUITE_P(AllPaths, QuantizeRefusalTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
