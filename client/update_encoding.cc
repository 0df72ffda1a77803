#include "update_encoding.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>

#include <cstring>
#include <vector>

namespace kvcache::internal {
namespace {

using google::protobuf::io::CodedOutputStream;
using google::protobuf::internal::WireFormatLite;

// Field numbers of kvcache.v1.UpdateRequest and kvcache.v1.Tensor.
constexpr int kUpdateKeys = 3, kUpdateValues = 4, kTensorData = 3;

// A length-delimited field's tag and length, appended to `out`.
void AppendPrefix(int field, uint64_t length, std::string& out) {
  uint8_t prefix[16];
  uint8_t* end = WireFormatLite::WriteTagToArray(
      field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, prefix);
  end = CodedOutputStream::WriteVarint64ToArray(length, end);
  out.append(reinterpret_cast<const char*>(prefix), end - prefix);
}

// Field `field` holding a Tensor of `dtype` and `shape`, up to and including
// its data's length prefix: the data's bytes follow it on the wire.
std::string TensorPrefix(int field, v1::DType dtype, const std::vector<uint64_t>& shape,
                         uint64_t data_bytes) {
  v1::Tensor header;
  header.set_dtype(dtype);
  for (uint64_t d : shape) header.add_shape(d);
  std::string tensor = header.SerializeAsString();
  AppendPrefix(kTensorData, data_bytes, tensor);
  std::string out;
  AppendPrefix(field, tensor.size() + data_bytes, out);
  return out + tensor;
}

// The message around the two data runs: [head][keys][middle][values].
struct Framing {
  std::string head;
  std::string middle;
};

Framing FrameUpdate(const std::string& cache_id, const LayerUpdate& update) {
  v1::UpdateRequest scalars;  // protobuf parsers accept fields in any order
  scalars.set_cache_id(cache_id);
  scalars.set_layer(update.layer);
  if (update.expected_offset.has_value()) scalars.set_expected_offset(*update.expected_offset);
  return Framing{
      .head = scalars.SerializeAsString() +
              TensorPrefix(kUpdateKeys, update.dtype, update.keys_shape, update.keys.size()),
      .middle = TensorPrefix(kUpdateValues, update.dtype, update.values_shape,
                             update.values.size())};
}

void ReleaseOwner(void* owner) { delete static_cast<std::shared_ptr<const void>*>(owner); }

grpc::Slice SharedSlice(absl::Span<const std::byte> data, const std::shared_ptr<const void>& owner) {
  return grpc::Slice(const_cast<std::byte*>(data.data()), data.size(), &ReleaseOwner,
                     new std::shared_ptr<const void>(owner));
}

}  // namespace

grpc::ByteBuffer EncodeUpdateCopy(const std::string& cache_id, const LayerUpdate& update) {
  const Framing framing = FrameUpdate(cache_id, update);
  grpc::Slice slice(framing.head.size() + update.keys.size() + framing.middle.size() +
                    update.values.size());
  auto* out = const_cast<uint8_t*>(slice.begin());
  for (auto [data, bytes] : {std::pair{framing.head.data(), framing.head.size()},
                             std::pair{reinterpret_cast<const char*>(update.keys.data()),
                                       update.keys.size()},
                             std::pair{framing.middle.data(), framing.middle.size()},
                             std::pair{reinterpret_cast<const char*>(update.values.data()),
                                       update.values.size()}}) {
    if (bytes > 0) std::memcpy(out, data, bytes);
    out += bytes;
  }
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer EncodeUpdateShared(const std::string& cache_id, const LayerUpdate& update,
                                    std::shared_ptr<const void> owner) {
  const Framing framing = FrameUpdate(cache_id, update);
  std::vector<grpc::Slice> slices;
  slices.emplace_back(framing.head);
  if (!update.keys.empty()) slices.push_back(SharedSlice(update.keys, owner));
  slices.emplace_back(framing.middle);
  if (!update.values.empty()) slices.push_back(SharedSlice(update.values, owner));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace kvcache::internal
