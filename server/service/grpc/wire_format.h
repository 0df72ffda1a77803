// kvcached's two streaming RPCs in gRPC's buffers, without copying K/V bytes
// more than needed. The bytes on the wire are protobuf's encoding of the
// messages (fetch_call.h and update_call.h make and read them).
//
// Fetch: protobuf would have the engine read into a zero-filled string, then
// copy it once more while serialising. Here a chunk is one gRPC slice, the
// engine reads pages straight into its data fields, and gRPC sends the slice
// as it is.
//
// Update: protobuf would gather each tensor's data into one string (a 1 MiB
// message arrives in about 17 slices). Here the request is parsed from the
// slices (update_parser.h) and the engine copies from them into pages.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvcache/v1/kvcache.pb.h"
#include "service/calls/fetch_call.h"
#include "service/calls/update_call.h"

namespace kvcache::service {

// The next keys-and-values chunk of `call` in one gRPC slice, read from
// pages straight into it; a failure ends the call (FetchCall::ReadNext).
absl::Status ReadNextChunk(FetchCall& call, grpc::ByteBuffer& out);

// An UpdateRequest as received: the slices it arrived in, as pieces that
// UpdateCall and ParsedUpdate read. Reused from message to message.
class ReceivedUpdate {
 public:
  // Takes the message out of `buffer`, leaving it empty. INVALID_ARGUMENT
  // when gRPC cannot hand over its bytes.
  absl::Status Receive(grpc::ByteBuffer& buffer);
  // Valid after a successful Receive, until Clear.
  MessagePieces pieces() const { return pieces_; }
  // Lets go of the message's slices.
  void Clear();

 private:
  std::vector<grpc::Slice> slices_;
  std::vector<absl::Span<const std::byte>> pieces_;
};

// An UpdateResponse as protobuf would encode it, in one inlined slice.
grpc::ByteBuffer EncodeUpdateResponse(const EncodedAck& ack);
grpc::ByteBuffer EncodeUpdateResponse(const v1::UpdateResponse& response);

}  // namespace kvcache::service
