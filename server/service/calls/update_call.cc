#include "service/calls/update_call.h"

#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>

#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "service/calls/update_parser.h"

namespace kvcache::service {
namespace {

using google::protobuf::io::ArrayInputStream;
using google::protobuf::io::ConcatenatingInputStream;
using google::protobuf::io::ZeroCopyInputStream;

// protobuf's own parse of a message in pieces, without gathering them.
bool ParseWithProtobuf(MessagePieces pieces, v1::UpdateRequest& out) {
  if (pieces.size() == 1) {
    return out.ParseFromArray(pieces[0].data(), static_cast<int>(pieces[0].size()));
  }
  std::vector<std::unique_ptr<ArrayInputStream>> owned;
  std::vector<ZeroCopyInputStream*> streams;
  for (absl::Span<const std::byte> piece : pieces) {
    owned.push_back(
        std::make_unique<ArrayInputStream>(piece.data(), static_cast<int>(piece.size())));
    streams.push_back(owned.back().get());
  }
  ConcatenatingInputStream input(streams.data(), static_cast<int>(streams.size()));
  return out.ParseFromZeroCopyStream(&input);
}

}  // namespace

absl::Status ParsedUpdate::Parse(MessagePieces pieces) {
  Clear();
  if (ParseUpdateRequest(pieces, view_)) return absl::OkStatus();
  view_ = UpdateView();
  parsed_by_protobuf_ = true;
  if (!ParseWithProtobuf(pieces, parsed_)) {
    return absl::InvalidArgumentError(
        "UpdateRequest: malformed (not the wire format of kvcache.v1.UpdateRequest)");
  }
  view_ = ViewOf(parsed_);
  return absl::OkStatus();
}

// The ids' strings keep their buffers for the next message (a stream
// names the same cache in each): no allocation per message.
void ParsedUpdate::Clear() {
  std::string cache_id = std::move(view_.cache_id);
  std::string speculation_id = std::move(view_.speculation_id);
  view_ = UpdateView();
  cache_id.clear();
  speculation_id.clear();
  view_.cache_id = std::move(cache_id);
  view_.speculation_id = std::move(speculation_id);
  if (parsed_by_protobuf_) parsed_.Clear();
  parsed_by_protobuf_ = false;
}

EncodedAck::EncodedAck(const v1::UpdateResponse& response) {
  using google::protobuf::internal::WireFormatLite;
  auto* begin = reinterpret_cast<uint8_t*>(bytes_);
  uint8_t* out = begin;
  static_assert(std::size(kEncodedUpdateResponseFields) == 2, "bytes_ and the writes hold two");
  if (response.layer() != 0) {
    out = WireFormatLite::WriteUInt32ToArray(v1::UpdateResponse::kLayerFieldNumber,
                                             response.layer(), out);
  }
  if (response.offset() != 0) {
    out = WireFormatLite::WriteUInt64ToArray(v1::UpdateResponse::kOffsetFieldNumber,
                                             response.offset(), out);
  }
  size_ = out - begin;
}

absl::StatusOr<EncodedAck> UpdateCall::Apply(MessagePieces pieces) {
  if (!status_.ok()) return status_;
  if (caller_ != nullptr) {
    if (absl::Status admitted = caller_->StillAdmitted(); !admitted.ok()) {
      status_ = admitted;
      return admitted;
    }
  }
  absl::Status status = message_.Parse(pieces);
  if (status.ok()) status = handlers_.Update(message_.view(), &known_spec_, &response_);
  message_.Clear();  // the engine has copied the tensors: nothing points into the pieces
  if (!status.ok()) {
    status_ = status;
    return status;
  }
  return EncodedAck(response_);
}

absl::Status UpdateCall::Finish() {
  absl::Status status = std::move(status_);
  status_ = absl::OkStatus();
  return status;
}

}  // namespace kvcache::service
