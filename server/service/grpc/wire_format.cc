#include "service/grpc/wire_format.h"

namespace kvcache::service {

absl::Status ReadNextChunk(FetchCall& call, grpc::ByteBuffer& out) {
  grpc::Slice slice(call.NextFraming().size());  // uninitialised; ReadNext writes every byte
  auto* begin = reinterpret_cast<std::byte*>(const_cast<uint8_t*>(slice.begin()));
  absl::Status read = call.ReadNext({begin, slice.size()});
  if (read.ok()) out = grpc::ByteBuffer(&slice, 1);
  return read;
}

absl::Status ReceivedUpdate::Receive(grpc::ByteBuffer& buffer) {
  Clear();
  // An empty message may come as a buffer with nothing in it.
  if (buffer.Valid() && !buffer.Dump(&slices_).ok()) {
    return absl::InvalidArgumentError("UpdateRequest: the message cannot be read");
  }
  buffer.Clear();
  for (const grpc::Slice& slice : slices_) {
    pieces_.emplace_back(reinterpret_cast<const std::byte*>(slice.begin()), slice.size());
  }
  return absl::OkStatus();
}

void ReceivedUpdate::Clear() {
  pieces_.clear();
  slices_.clear();
}

grpc::ByteBuffer EncodeUpdateResponse(const EncodedAck& ack) {
  grpc::Slice slice(ack.bytes().data(), ack.bytes().size());
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer EncodeUpdateResponse(const v1::UpdateResponse& response) {
  return EncodeUpdateResponse(EncodedAck(response));
}

}  // namespace kvcache::service
