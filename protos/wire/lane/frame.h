// The data lane's frames (kvcache.proto, LaneFrameKind): the preamble a
// connection opens with, the 8-byte header before every payload, and the
// LaneStatus frame's payload as an absl::Status. The server (service/lane/data_lane.h)
// and the client library each build their calls on these.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcache::lane {

// What a client sends first on a connection, and the server answers with
// the same 8 bytes: the lane's version, whose Fetch calls announce their
// length (FETCH_LENGTH). The server closes any other opening unanswered.
inline constexpr char kMagic[8] = {'K', 'V', 'L', 'A', 'N', 'E', '0', '2'};
inline constexpr size_t kHeaderBytes = 8;
// The longest AUTH frame a server reads: a LaneAuth holds one bearer token,
// a few KiB at most (gRPC's metadata, where the same token travels, is
// limited to 8 KiB in all). Before a connection has authenticated nothing
// longer is read, so strangers cannot make the server hold large frames.
inline constexpr uint32_t kMaxAuthFrameBytes = 8 << 10;

struct FrameHeader {
  uint32_t length = 0;  // payload bytes
  int kind = 0;         // a v1::LaneFrameKind, as received
};

void EncodeHeader(const FrameHeader& header, std::byte out[kHeaderBytes]);
FrameHeader DecodeHeader(const std::byte in[kHeaderBytes]);

// A frame as read: its header and payload, valid until the next read.
struct Frame {
  FrameHeader header;
  absl::Span<const std::byte> payload;
};

// A v1::LaneStatus frame's payload as an absl::Status, and back.
absl::Status StatusFromLane(const v1::LaneStatus& status);
v1::LaneStatus LaneStatusOf(const absl::Status& status);

}  // namespace kvcache::lane
