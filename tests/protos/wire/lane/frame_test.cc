// The frame header's bytes and the LaneStatus payload's mapping to absl::Status.
#include "wire/lane/frame.h"

#include "gtest/gtest.h"

namespace kvcache::lane {
namespace {

TEST(LaneHeaderTest, RoundTripsAndRefusesReservedBytes) {
  std::byte header[kHeaderBytes];
  EncodeHeader({.length = 0x01020304, .kind = v1::LANE_FRAME_FETCH_CHUNK}, header);
  EXPECT_EQ(std::to_integer<int>(header[0]), 0x04);  // little-endian
  EXPECT_EQ(std::to_integer<int>(header[3]), 0x01);
  const FrameHeader decoded = DecodeHeader(header);
  EXPECT_EQ(decoded.length, 0x01020304u);
  EXPECT_EQ(decoded.kind, v1::LANE_FRAME_FETCH_CHUNK);
  header[6] = std::byte{1};
  EXPECT_EQ(DecodeHeader(header).kind, -1);
}

TEST(LaneStatusTest, CarriesCodeAndMessage) {
  const absl::Status status = absl::NotFoundError("cache_id: no cache");
  EXPECT_EQ(StatusFromLane(LaneStatusOf(status)), status);
  EXPECT_TRUE(StatusFromLane(LaneStatusOf(absl::OkStatus())).ok());
}

}  // namespace
}  // namespace kvcache::lane
