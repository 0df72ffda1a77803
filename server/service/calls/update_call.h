// One Update call, whichever transport carries it: each message parsed from
// the pieces it arrived in (gRPC's receive slices, or one data-lane frame),
// checked against the spec the call keeps of its cache, applied, and
// acknowledged. The first message that fails ends the call with its status;
// those before it stay applied. The gRPC reactor and the data lane only move
// the bytes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvcache/v1/kvcache.pb.h"
#include "service/handlers.h"
#include "service/tenants.h"
#include "service/update_view.h"

namespace kvcache::service {

// The bytes of a message as it arrived: pieces that read as their concatenation.
using MessagePieces = absl::Span<const absl::Span<const std::byte>>;

// An UpdateRequest parsed from its pieces: by update_parser.h where it can
// (the tensors' data left in the pieces), else by protobuf. Reused from
// message to message.
class ParsedUpdate {
 public:
  // INVALID_ARGUMENT unless `pieces` hold a well-formed UpdateRequest.
  absl::Status Parse(MessagePieces pieces);
  // Valid after a successful Parse, while the pieces live, until Clear.
  const UpdateView& view() const { return view_; }
  // Whether the last Parse went through protobuf (for tests).
  bool parsed_by_protobuf() const { return parsed_by_protobuf_; }
  void Clear();

 private:
  v1::UpdateRequest parsed_;  // protobuf's parse, when it was needed
  UpdateView view_;
  bool parsed_by_protobuf_ = false;
};

// An UpdateResponse as protobuf encodes it: an acknowledgement's bytes.
// The UpdateResponse fields EncodedAck writes; tests hold the list against
// the schema, so a field added to UpdateResponse is written there or the
// tests fail.
inline constexpr int kEncodedUpdateResponseFields[] = {v1::UpdateResponse::kLayerFieldNumber,
                                                       v1::UpdateResponse::kOffsetFieldNumber};

class EncodedAck {
 public:
  explicit EncodedAck(const v1::UpdateResponse& response);
  absl::Span<const std::byte> bytes() const { return {bytes_, size_}; }

 private:
  std::byte bytes_[2 * (1 + 10)];  // two tags and varints at most
  size_t size_ = 0;
};

class UpdateCall {
 public:
  // `caller`: the admission the call runs under, asked before each message
  // whether its token still holds (null: nothing to ask); it must outlive
  // the call.
  explicit UpdateCall(Handlers& handlers, const Admitted* caller = nullptr)
      : handlers_(handlers), caller_(caller) {}

  // Parses and applies one UpdateRequest (`pieces` need live only until it
  // returns); its acknowledgement, or the failure that ends the call. Once a
  // message failed, the call reads no more: each later Apply returns that
  // failure again. A caller whose token was revoked (tenants.h) fails the
  // message UNAUTHENTICATED before anything of it is read.
  absl::StatusOr<EncodedAck> Apply(MessagePieces pieces);
  bool failed() const { return !status_.ok(); }
  // The call's status, once its messages end: its first failure, else OK.
  // The call is then ready for the next one on the same connection; the spec
  // it knows is kept (a stream usually feeds one cache).
  absl::Status Finish();

 private:
  Handlers& handlers_;
  const Admitted* caller_;
  ParsedUpdate message_;
  KnownSpec known_spec_;  // of the cache last written to
  v1::UpdateResponse response_;  // reused: every message sets both fields
  absl::Status status_;
};

}  // namespace kvcache::service
