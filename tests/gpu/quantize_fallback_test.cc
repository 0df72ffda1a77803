// The atomic fallback of the quantize shader (quantize_atomic.comp), which
// devices without subgroup shuffles run: a Quantizer forced onto it over a
// host-mapped PageAllocator (lavapipe has shuffles, so the pool never picks it).
#include <cstring>
#include <random>
#include <vector>

#include "gpu/page_allocator.h"
#include "gpu/quantizer.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"
#include "support/ref_quantizer.h"

namespace kvcache::testing {
namespace {

using gpu::PageId;
using gpu::QuantFormat;
using gpu::QuantRun;

constexpr uint64_t kPageBytes = 32 << 10;
constexpr uint32_t kSlots = 33;  // odd: biases out of phase with scales at dim == group

class QuantizeFallbackTest : public GpuTestBase {};

// Rows [first, first + rows) of `f` at `slot` of planes of kSlots rows.
QuantRun RunAt(const QuantFormat& f, PageId page, uint32_t slot, uint64_t first, uint32_t rows) {
  const uint64_t scales = kSlots * f.wq_row_bytes();
  const uint64_t biases = scales + kSlots * f.scale_row_bytes();
  return {page,
          slot * f.wq_row_bytes(),
          scales + slot * f.scale_row_bytes(),
          biases + slot * f.scale_row_bytes(),
          first,
          rows};
}

TEST_P(QuantizeFallbackTest, AtomicScalesMatchTheReferenceAndSpareNeighbours) {
  if (!device().direct_host_access()) {
    GTEST_SKIP() << device().description().name << " does not map pages into host memory";
  }
  gpu::PageAllocator pages(device(),
                           {.page_bytes = kPageBytes, .max_pages = 4, .pages_per_slab = 4},
                           /*host_mapped=*/true);
  gpu::Quantizer quantizer(device(), pages, {.subgroup_shuffle = false});
  std::vector<PageId> ids;
  ASSERT_TRUE(pages.Allocate(1, ids, gpu::kPoolAccount).ok());
  std::byte* page = pages.Locate(ids[0]).host;
  std::mt19937_64 rng(21);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (uint32_t dim : {64u, 256u}) {
      const QuantFormat f{.dtype = dtype, .dim = dim, .group_size = 64, .bits = 4};
      SCOPED_TRACE(::testing::Message() << DTypeName(dtype).data() << " dim " << dim);
      std::memset(page, 0x5C, kPageBytes);
      std::vector<std::byte> expected(page, page + kPageBytes);
      const std::vector<std::byte> input = RandomQuantizableValues(dtype, 12ull * dim, 64, rng);
      const QuantRun runs[] = {RunAt(f, ids[0], 1, 0, 5), RunAt(f, ids[0], 8, 5, 7)};
      const absl::Span<const std::byte> piece(input);
      const gpu::QuantizeJob job{f, {&piece, 1}, runs};
      ASSERT_TRUE(quantizer.Quantize({&job, 1}).ok());
      for (const QuantRun& run : runs) {
        const RefPacked ref = RefQuantize(
            {dtype, 64, 4}, absl::MakeConstSpan(input).subspan(run.first_row * f.row_bytes(),
                                                               run.rows * f.row_bytes()));
        std::memcpy(expected.data() + run.wq_offset, ref.wq.data(), ref.wq.size());
        std::memcpy(expected.data() + run.scales_offset, ref.scales.data(), ref.scales.size());
        std::memcpy(expected.data() + run.biases_offset, ref.biases.data(), ref.biases.size());
      }
      EXPECT_TRUE(std::vector<std::byte>(page, page + kPageBytes) == expected)
          << "the page differs from the reference (or a neighbour changed)";
    }
  }
  pages.Release(ids[0]);
}

INSTANTIATE_TEST_SUITE_P(DirectPath, QuantizeFallbackTest, ::testing::Values(TransferPath::kDirect),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
