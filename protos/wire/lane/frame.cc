#include "wire/lane/frame.h"

#include <string>

namespace kvcache::lane {

void EncodeHeader(const FrameHeader& header, std::byte out[kHeaderBytes]) {
  for (int i = 0; i < 4; ++i) out[i] = std::byte((header.length >> (8 * i)) & 0xff);
  out[4] = std::byte(header.kind & 0xff);
  out[5] = out[6] = out[7] = std::byte{0};
}

FrameHeader DecodeHeader(const std::byte in[kHeaderBytes]) {
  FrameHeader header;
  for (int i = 0; i < 4; ++i) header.length |= std::to_integer<uint32_t>(in[i]) << (8 * i);
  header.kind = std::to_integer<int>(in[4]);
  // Reserved bytes set make the kind unknown, so they are refused, not ignored.
  if (in[5] != std::byte{0} || in[6] != std::byte{0} || in[7] != std::byte{0}) header.kind = -1;
  return header;
}

absl::Status StatusFromLane(const v1::LaneStatus& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.code()), status.message());
}

v1::LaneStatus LaneStatusOf(const absl::Status& status) {
  v1::LaneStatus lane;
  lane.set_code(static_cast<int>(status.code()));
  lane.set_message(std::string(status.message()));
  return lane;
}

}  // namespace kvcache::lane
