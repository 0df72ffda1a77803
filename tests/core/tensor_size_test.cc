// A tensor's byte size: the element size times every dimension, and the one
// answer for sizes that reach 2^64.
#include "core/tensor_size.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace kvcache {
namespace {

TEST(TensorByteSizeTest, IsTheElementSizeTimesEveryDimension) {
  EXPECT_EQ(TensorByteSize(DType::kFloat16, {2, 8, 3, 128}), 2u * 8 * 3 * 128 * 2);
  EXPECT_EQ(TensorByteSize(DType::kBFloat16, {1, 1}), 2u);
  EXPECT_EQ(TensorByteSize(DType::kFloat32, {5, 7}), 5u * 7 * 4);
  EXPECT_EQ(TensorByteSize(DType::kFloat32, {}), 4u);  // a scalar
  EXPECT_EQ(TensorByteSize(DType::kFloat16, {3, 0, 9}), 0u);
}

TEST(TensorByteSizeTest, SizesOf2To64OrMoreAreUnaddressable) {
  const uint64_t half = uint64_t{1} << 63;
  EXPECT_EQ(TensorByteSize(DType::kFloat16, {half}), kUnaddressableBytes);  // exactly 2^64
  EXPECT_EQ(TensorByteSize(DType::kFloat16, {half - 1}), UINT64_MAX - 1);   // just below
  EXPECT_EQ(TensorByteSize(DType::kFloat32, {1 << 22, 1 << 20, 1 << 20}), kUnaddressableBytes);
  EXPECT_EQ(TensorByteSize(DType::kFloat32, {1 << 21, 1 << 20, 1 << 20}), uint64_t{1} << 63);
  // A product that wraps around to 0 is still refused; a zero dimension
  // empties the tensor however large the others are.
  EXPECT_EQ(TensorByteSize(DType::kFloat16, {uint64_t{1} << 33, uint64_t{1} << 31}),
            kUnaddressableBytes);
  EXPECT_EQ(TensorByteSize(DType::kFloat16, {half, 2, 0}), 0u);
  const std::vector<uint64_t> shape = {UINT64_MAX, 1};
  EXPECT_EQ(TensorByteSize(DType::kBFloat16, shape), kUnaddressableBytes);
}

}  // namespace
}  // namespace kvcache
