#include "fetch_view.h"

#include <cstdint>

namespace kvcache::internal {
namespace {

constexpr int kVarint = 0, kLengthDelimited = 2;
// The longest encodings protobuf reads: tags and lengths in 5 bytes, values
// in 10 (whose 10th byte may hold only bit 63). Longer ones it refuses, so
// must this.
constexpr int kTagBytes = 5, kValueBytes = 10;
using Chunk = v1::FetchResponse;
using Tensor = v1::Tensor;

// Protobuf's wire format over one contiguous span. Every read returns false
// when the input ends too soon or a varint is longer than protobuf allows.
class WireReader {
 public:
  explicit WireReader(absl::Span<const std::byte> bytes) : bytes_(bytes) {}

  bool done() const { return at_ == bytes_.size(); }
  // A field's number and wire type.
  bool Tag(uint64_t& field, int& wire) {
    uint64_t tag = 0;
    if (!Varint(tag, kTagBytes)) return false;
    field = tag >> 3;
    wire = static_cast<int>(tag & 7);
    return true;
  }
  bool Varint(uint64_t& value, int max_bytes = kValueBytes) {
    value = 0;
    for (int i = 0; i < max_bytes; ++i) {
      if (at_ == bytes_.size()) return false;
      const uint8_t byte = std::to_integer<uint8_t>(bytes_[at_++]);
      if (i == 9 && byte > 1) return false;  // bits past 63
      value |= uint64_t{byte & 0x7fu} << (7 * i);
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }
  bool Bytes(absl::Span<const std::byte>& out) {
    uint64_t length = 0;
    if (!Varint(length, kTagBytes) || length > bytes_.size() - at_) return false;
    out = bytes_.subspan(at_, length);
    at_ += length;
    return true;
  }

 private:
  absl::Span<const std::byte> bytes_;
  size_t at_ = 0;
};

// A Tensor: dtype and shape into `tensor`, the data as a view.
bool ParseTensor(absl::Span<const std::byte> bytes, v1::Tensor& tensor,
                 absl::Span<const std::byte>& data) {
  WireReader reader(bytes);
  data = {};
  while (!reader.done()) {
    uint64_t field = 0, value = 0;
    int wire = 0;
    if (!reader.Tag(field, wire)) return false;
    absl::Span<const std::byte> body;
    if (field == Tensor::kDtypeFieldNumber && wire == kVarint) {
      if (!reader.Varint(value)) return false;
      tensor.set_dtype(static_cast<v1::DType>(static_cast<int32_t>(value)));
    } else if (field == Tensor::kShapeFieldNumber && wire == kVarint) {
      if (!reader.Varint(value)) return false;
      tensor.add_shape(value);
    } else if (field == Tensor::kShapeFieldNumber && wire == kLengthDelimited) {  // packed
      if (!reader.Bytes(body)) return false;
      WireReader packed(body);
      while (!packed.done()) {
        if (!packed.Varint(value)) return false;
        tensor.add_shape(value);
      }
    } else if (field == Tensor::kDataFieldNumber && wire == kLengthDelimited) {
      // A repeat replaces it, as in protobuf.
      if (!reader.Bytes(data)) return false;
    } else {
      return false;  // anything else: protobuf's parser decides
    }
  }
  return true;
}

}  // namespace

bool ParseTokenChunk(absl::Span<const std::byte> payload, v1::FetchResponse& header,
                     absl::Span<const std::byte>& keys, absl::Span<const std::byte>& values) {
  header.Clear();
  keys = values = {};
  bool has_keys = false, has_values = false;
  WireReader reader(payload);
  while (!reader.done()) {
    uint64_t field = 0, value = 0;
    int wire = 0;
    if (!reader.Tag(field, wire)) return false;
    absl::Span<const std::byte> body;
    if (field == Chunk::kLayerFieldNumber && wire == kVarint) {
      if (!reader.Varint(value)) return false;
      header.set_layer(static_cast<uint32_t>(value));
    } else if (field == Chunk::kStartFieldNumber && wire == kVarint) {
      if (!reader.Varint(value)) return false;
      header.set_start(value);
    } else if (field == Chunk::kKeysFieldNumber && wire == kLengthDelimited && !has_keys) {
      has_keys = true;
      if (!reader.Bytes(body) || !ParseTensor(body, *header.mutable_keys(), keys)) return false;
    } else if (field == Chunk::kValuesFieldNumber && wire == kLengthDelimited && !has_values) {
      has_values = true;
      if (!reader.Bytes(body) || !ParseTensor(body, *header.mutable_values(), values)) {
        return false;
      }
    } else {
      return false;  // a packed or state chunk, or a field not read here: protobuf's
    }
  }
  return has_keys && has_values;
}

}  // namespace kvcache::internal
