// kvcached's two streaming RPCs on the wire, encoded and parsed by hand
// rather than through generated messages, so K/V bytes are copied as little as
// possible. The bytes on the wire are protobuf's encoding of the messages.
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
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvcache/v1/kvcache.pb.h"
#include "service/update_view.h"

namespace kvcache::service {

// A FetchResponse of keys and values as protobuf encodes it, every byte but
// the tensors' data, which go where protobuf would put them: `header` (every
// field but the data) in protobuf's field order, with room for the data.
class FetchChunkFraming {
 public:
  FetchChunkFraming(const v1::FetchResponse& header, uint64_t key_bytes, uint64_t value_bytes);

  size_t size() const { return size_; }
  size_t keys_offset() const { return keys_offset_; }
  size_t values_offset() const { return values_offset_; }
  uint64_t key_bytes() const { return key_bytes_; }
  uint64_t value_bytes() const { return value_bytes_; }
  // Writes the framing into out[0, size()), leaving the data's bytes as they are.
  void Write(uint8_t* out) const;
  // The framing before the keys' data, and between the keys' and the values'.
  absl::Span<const std::byte> head() const { return AsBytes(head_); }
  absl::Span<const std::byte> middle() const { return AsBytes(middle_); }

 private:
  static absl::Span<const std::byte> AsBytes(const std::string& s) {
    return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
  }

  uint64_t key_bytes_;
  uint64_t value_bytes_;
  std::string head_;    // the scalars, then the keys' field prefix and Tensor header
  std::string middle_;  // the values' field prefix and Tensor header
  size_t keys_offset_ = 0;
  size_t values_offset_ = 0;
  size_t size_ = 0;
};

// A FetchChunkFraming in one uninitialised gRPC slice. Fill keys() and
// values(), then Finish() hands the slice over without a copy.
class FetchChunkBuffer {
 public:
  FetchChunkBuffer(const v1::FetchResponse& header, uint64_t key_bytes, uint64_t value_bytes);

  absl::Span<std::byte> keys() { return At(framing_.keys_offset(), framing_.key_bytes()); }
  absl::Span<std::byte> values() { return At(framing_.values_offset(), framing_.value_bytes()); }
  grpc::ByteBuffer Finish();

 private:
  absl::Span<std::byte> At(size_t offset, uint64_t bytes);

  FetchChunkFraming framing_;
  grpc::Slice slice_;
};

// An UpdateRequest as received: the slices it arrived in, and a view of it
// whose tensors point into them. Reused from message to message.
class ReceivedUpdate {
 public:
  // Takes the message out of `buffer` (leaving it empty) and parses it: from
  // the slices, or, for what update_parser.h leaves to protobuf, with
  // protobuf's parser. INVALID_ARGUMENT unless it is a well-formed UpdateRequest.
  absl::Status Parse(grpc::ByteBuffer& buffer);
  // Valid after a successful Parse, until Clear.
  const UpdateView& view() const { return view_; }
  // Whether the last Parse went through protobuf (for tests).
  bool parsed_by_protobuf() const { return parsed_by_protobuf_; }
  // Lets go of the message's slices.
  void Clear();

 private:
  std::vector<grpc::Slice> slices_;
  std::vector<absl::Span<const std::byte>> pieces_;
  v1::UpdateRequest parsed_;  // protobuf's parse, when it was needed
  UpdateView view_;
  bool parsed_by_protobuf_ = false;
};

// An UpdateResponse as protobuf would encode it, in one inlined slice. It
// writes the fields listed here; tests hold the list against the schema, so
// a field added to UpdateResponse is written here or the tests fail.
inline constexpr int kEncodedUpdateResponseFields[] = {v1::UpdateResponse::kLayerFieldNumber,
                                                       v1::UpdateResponse::kOffsetFieldNumber};
grpc::ByteBuffer EncodeUpdateResponse(const v1::UpdateResponse& response);

}  // namespace kvcache::service
