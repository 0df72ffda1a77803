#include "service/wire_format.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>

#include <algorithm>
#include <string>

namespace kvcache::service {
namespace {

using google::protobuf::io::CodedOutputStream;
using google::protobuf::internal::WireFormatLite;

constexpr auto kLengthDelimited = WireFormatLite::WIRETYPE_LENGTH_DELIMITED;
// Field numbers of kvcache.v1.FetchResponse and kvcache.v1.Tensor.
constexpr int kFetchKeys = 3, kFetchValues = 4, kTensorData = 3;

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

FetchChunkBuffer::FetchChunkBuffer(const v1::FetchResponse& header, uint64_t key_bytes,
                                   uint64_t value_bytes)
    : key_bytes_(key_bytes), value_bytes_(value_bytes) {
  v1::FetchResponse scalars = header;
  scalars.clear_keys();
  scalars.clear_values();
  const std::string head = scalars.SerializeAsString();
  const std::string keys = TensorHeader(header.keys(), key_bytes);
  const std::string values = TensorHeader(header.values(), value_bytes);
  const uint64_t keys_size = keys.size() + key_bytes;
  const uint64_t values_size = values.size() + value_bytes;
  const size_t total = head.size() + PrefixSize(kFetchKeys, keys_size) + keys_size +
                       PrefixSize(kFetchValues, values_size) + values_size;
  slice_ = grpc::Slice(total);  // uninitialised; every byte is written below or by the caller
  auto* out = const_cast<uint8_t*>(slice_.begin());
  out = std::copy(head.begin(), head.end(), out);
  out = WritePrefix(kFetchKeys, keys_size, out);
  out = std::copy(keys.begin(), keys.end(), out);
  keys_offset_ = out - slice_.begin();
  out = WritePrefix(kFetchValues, values_size, out + key_bytes);
  out = std::copy(values.begin(), values.end(), out);
  values_offset_ = out - slice_.begin();
}

absl::Span<std::byte> FetchChunkBuffer::At(size_t offset, uint64_t bytes) {
  return {reinterpret_cast<std::byte*>(const_cast<uint8_t*>(slice_.begin())) + offset, bytes};
}

grpc::ByteBuffer FetchChunkBuffer::Finish() { return grpc::ByteBuffer(&slice_, 1); }

}  // namespace kvcache::service
