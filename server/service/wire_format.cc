#include "service/wire_format.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/impl/codegen/proto_utils.h>

#include <algorithm>
#include <iterator>
#include <string>

#include "service/update_parser.h"

namespace kvcache::service {
namespace {

using google::protobuf::io::CodedOutputStream;
using google::protobuf::internal::WireFormatLite;

constexpr auto kLengthDelimited = WireFormatLite::WIRETYPE_LENGTH_DELIMITED;
// The fields written by hand; the rest go through protobuf's serialiser.
constexpr int kFetchKeys = v1::FetchResponse::kKeysFieldNumber;
constexpr int kFetchValues = v1::FetchResponse::kValuesFieldNumber;
constexpr int kTensorData = v1::Tensor::kDataFieldNumber;

// Bytes of a length-delimited field's tag and length prefix.
size_t PrefixSize(int field, uint64_t length) {
  return CodedOutputStream::VarintSize32(WireFormatLite::MakeTag(field, kLengthDelimited)) +
         CodedOutputStream::VarintSize64(length);
}

uint8_t* WritePrefix(int field, uint64_t length, uint8_t* out) {
  out = WireFormatLite::WriteTagToArray(field, kLengthDelimited, out);
  return CodedOutputStream::WriteVarint64ToArray(length, out);
}

// A Tensor's encoding: its dtype and shape, then its data's prefix; the data
// itself follows.
std::string TensorHeader(const v1::Tensor& tensor, uint64_t data_bytes) {
  std::string header = tensor.SerializeAsString();
  const size_t at = header.size();
  header.resize(at + PrefixSize(kTensorData, data_bytes));
  WritePrefix(kTensorData, data_bytes, reinterpret_cast<uint8_t*>(header.data() + at));
  return header;
}

}  // namespace

FetchChunkFraming::FetchChunkFraming(const v1::FetchResponse& header, uint64_t key_bytes,
                                     uint64_t value_bytes)
    : key_bytes_(key_bytes), value_bytes_(value_bytes) {
  v1::FetchResponse scalars = header;
  scalars.clear_keys();
  scalars.clear_values();
  const std::string keys = TensorHeader(header.keys(), key_bytes);
  const std::string values = TensorHeader(header.values(), value_bytes);
  const uint64_t keys_size = keys.size() + key_bytes;
  const uint64_t values_size = values.size() + value_bytes;
  head_ = scalars.SerializeAsString();
  size_t at = head_.size();
  head_.resize(at + PrefixSize(kFetchKeys, keys_size));
  WritePrefix(kFetchKeys, keys_size, reinterpret_cast<uint8_t*>(head_.data() + at));
  head_ += keys;
  middle_.resize(PrefixSize(kFetchValues, values_size));
  WritePrefix(kFetchValues, values_size, reinterpret_cast<uint8_t*>(middle_.data()));
  middle_ += values;
  keys_offset_ = head_.size();
  values_offset_ = keys_offset_ + key_bytes + middle_.size();
  size_ = values_offset_ + value_bytes;
}

void FetchChunkFraming::Write(uint8_t* out) const {
  std::copy(head_.begin(), head_.end(), out);
  std::copy(middle_.begin(), middle_.end(), out + keys_offset_ + key_bytes_);
}

FetchChunkBuffer::FetchChunkBuffer(const v1::FetchResponse& header, uint64_t key_bytes,
                                   uint64_t value_bytes)
    : framing_(header, key_bytes, value_bytes),
      slice_(framing_.size()) {  // uninitialised; the framing and the caller write every byte
  framing_.Write(const_cast<uint8_t*>(slice_.begin()));
}

absl::Span<std::byte> FetchChunkBuffer::At(size_t offset, uint64_t bytes) {
  return {reinterpret_cast<std::byte*>(const_cast<uint8_t*>(slice_.begin())) + offset, bytes};
}

grpc::ByteBuffer FetchChunkBuffer::Finish() { return grpc::ByteBuffer(&slice_, 1); }

absl::Status ReceivedUpdate::Parse(grpc::ByteBuffer& buffer) {
  Clear();
  // An empty message may come as a buffer with nothing in it.
  if (buffer.Valid() && !buffer.Dump(&slices_).ok()) {
    return absl::InvalidArgumentError("UpdateRequest: the message cannot be read");
  }
  buffer.Clear();
  for (const grpc::Slice& slice : slices_) {
    pieces_.emplace_back(reinterpret_cast<const std::byte*>(slice.begin()), slice.size());
  }
  if (ParseUpdateRequest(pieces_, view_)) return absl::OkStatus();
  view_ = UpdateView();
  parsed_by_protobuf_ = true;
  grpc::ByteBuffer message(slices_.data(), slices_.size());  // shares the slices
  if (!grpc::SerializationTraits<v1::UpdateRequest>::Deserialize(&message, &parsed_).ok()) {
    return absl::InvalidArgumentError(
        "UpdateRequest: malformed (not the wire format of kvcache.v1.UpdateRequest)");
  }
  view_ = ViewOf(parsed_);
  return absl::OkStatus();
}

void ReceivedUpdate::Clear() {
  view_ = UpdateView();
  if (parsed_by_protobuf_) parsed_.Clear();
  parsed_by_protobuf_ = false;
  pieces_.clear();
  slices_.clear();
}

grpc::ByteBuffer EncodeUpdateResponse(const v1::UpdateResponse& response) {
  uint8_t bytes[2 * (1 + 10)];  // two tags and varints
  uint8_t* out = bytes;
  static_assert(std::size(kEncodedUpdateResponseFields) == 2, "bytes[] and the writes hold two");
  if (response.layer() != 0) {
    out = WireFormatLite::WriteUInt32ToArray(v1::UpdateResponse::kLayerFieldNumber,
                                             response.layer(), out);
  }
  if (response.offset() != 0) {
    out = WireFormatLite::WriteUInt64ToArray(v1::UpdateResponse::kOffsetFieldNumber,
                                             response.offset(), out);
  }
  grpc::Slice slice(bytes, out - bytes);
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace kvcache::service
