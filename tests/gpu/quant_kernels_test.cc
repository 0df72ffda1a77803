// The native CPU quantization kernels (gpu/quant_kernels.h), every instruction
// set this CPU runs, against the CPU reference (support/ref_quantizer.h): packed
// words, scales, biases and dequantized values byte for byte, from and to
// unaligned addresses, over group counts that end mid-block.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/quant_kernels.h"
#include "gtest/gtest.h"
#include "support/ref_quantizer.h"

namespace kvcache::testing {
namespace {

using gpu::QuantFormat;
using gpu::QuantIsa;

constexpr QuantIsa kIsas[] = {QuantIsa::kPortable, QuantIsa::kAvx2, QuantIsa::kAvx512};

// The first byte that differs, or success.
::testing::AssertionResult SameBytes(const char* what, const std::byte* expected,
                                     const std::byte* actual, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) {
    if (expected[i] != actual[i]) {
      return ::testing::AssertionFailure()
             << what << " byte " << i << " is 0x" << std::hex << static_cast<int>(actual[i])
             << ", expected 0x" << static_cast<int>(expected[i]);
    }
  }
  return ::testing::AssertionSuccess();
}

// Buffers whose data starts `skew` bytes past an aligned address.
struct Skewed {
  Skewed(size_t bytes, size_t skew) : storage(bytes + 64), data(storage.data() + skew) {}
  std::vector<std::byte> storage;
  std::byte* data;
};

class QuantKernelsTest : public ::testing::TestWithParam<QuantIsa> {
 protected:
  void SetUp() override {
    if (!gpu::CpuRuns(GetParam())) {
      GTEST_SKIP() << "this CPU does not run " << gpu::QuantIsaName(GetParam());
    }
  }

  // Quantizes `groups` random groups with the kernel and the reference and
  // compares every plane, then dequantizes the kernel's planes and compares.
  void Check(const QuantFormat& f, uint64_t groups, size_t skew, std::mt19937_64& rng) {
    SCOPED_TRACE(absl::StrCat(std::string(DTypeName(f.dtype)), " group ", f.group_size, " bits ",
                              f.bits, " groups ", groups, " skew ", skew));
    const uint32_t elem = DTypeSize(f.dtype);
    const std::vector<std::byte> input =
        RandomQuantizableValues(f.dtype, groups * f.group_size, f.group_size, rng);
    const RefQuantFormat rf{f.dtype, f.group_size, f.bits};
    const RefPacked expected = RefQuantize(rf, input);

    Skewed values(input.size(), skew), wq(expected.wq.size(), 3 - skew % 4),
        scales(groups * elem, skew + 1), biases(groups * elem, skew);
    std::memcpy(values.data, input.data(), input.size());
    gpu::QuantizeGroups(GetParam(), f, values.data, groups, {wq.data, scales.data, biases.data});
    ASSERT_TRUE(SameBytes("wq", expected.wq.data(), wq.data, expected.wq.size()));
    ASSERT_TRUE(SameBytes("scales", expected.scales.data(), scales.data, groups * elem));
    ASSERT_TRUE(SameBytes("biases", expected.biases.data(), biases.data, groups * elem));

    const std::vector<std::byte> back = RefDequantize(rf, expected);
    Skewed out(back.size(), skew + 2);
    gpu::DequantizeGroups(GetParam(), f, {wq.data, scales.data, biases.data}, groups, out.data);
    ASSERT_TRUE(SameBytes("dequantized", back.data(), out.data, back.size()));
  }
};

TEST_P(QuantKernelsTest, EveryFormatMatchesTheReference) {
  std::mt19937_64 rng(31);
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (uint32_t group : {32u, 64u, 128u}) {
      for (uint32_t bits : {4u, 8u}) {
        // 16 groups make a block of fits; 37 and 1 end mid-block.
        for (uint64_t groups : {uint64_t{1}, uint64_t{37}, uint64_t{512}}) {
          Check({.dtype = dtype, .dim = group, .group_size = group, .bits = bits}, groups,
                groups % 4, rng);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST_P(QuantKernelsTest, ManyRandomGroups) {
  // 200k groups of the common formats: the edge cases of the generator
  // (constant, signed zeros, subnormals, one outlier, the dtype's extremes)
  // come up thousands of times each.
  std::mt19937_64 rng(32);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (uint32_t bits : {4u, 8u}) {
      Check({.dtype = dtype, .dim = 64, .group_size = 64, .bits = bits}, 200000, 1, rng);
      if (HasFailure()) return;
    }
  }
}

TEST(QuantKernelsDispatchTest, TheBestIsaRunsHere) {
  EXPECT_TRUE(gpu::CpuRuns(gpu::BestQuantIsa())) << gpu::QuantIsaName(gpu::BestQuantIsa());
  EXPECT_TRUE(gpu::CpuRuns(QuantIsa::kPortable));
}

INSTANTIATE_TEST_SUITE_P(Isas, QuantKernelsTest, ::testing::ValuesIn(kIsas),
                         [](const auto& info) { return std::string(gpu::QuantIsaName(info.param)); });

}  // namespace
}  // namespace kvcache::testing
