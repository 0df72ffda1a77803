#include "update_encoding.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>

#include <cstring>
#include <vector>

namespace kvcache::internal {
namespace {

using google::protobuf::io::CodedOutputStream;
using google::protobuf::internal::WireFormatLite;

// The fields written by hand; the rest go through protobuf's serialiser.
constexpr int kUpdateKeys = v1::UpdateRequest::kKeysFieldNumber;
constexpr int kUpdateValues = v1::UpdateRequest::kValuesFieldNumber;
constexpr int kUpdateState = v1::UpdateRequest::kStateFieldNumber;
constexpr int kStateConv = v1::RecurrentState::kConvStateFieldNumber;
constexpr int kStateDelta = v1::RecurrentState::kDeltaStateFieldNumber;
constexpr int kTensorData = v1::Tensor::kDataFieldNumber;

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

// Protobuf parsers accept fields in any order, so the scalars go first and
// each tensor's data ends its run.
using Run = UpdateRun;

// Keys and values go on the wire unless the update carries a state and left
// them empty: a recurrent layer's update then holds the state alone.
bool SendsTokens(const LayerUpdate& update) {
  return !update.state.has_value() || !update.keys_shape.empty() || !update.keys.empty() ||
         !update.values_shape.empty() || !update.values.empty();
}

// The state field (RecurrentState): its advance, then conv_state and delta_state. The
// outer length covers both tensors' data, which follow their prefixes.
void AppendStateRuns(v1::DType dtype, const RecurrentStateUpdate& state, std::vector<Run>& runs) {
  v1::RecurrentState scalars;
  scalars.set_advance(state.advance);
  const std::string advance = scalars.SerializeAsString();
  std::string conv = TensorPrefix(kStateConv, dtype, state.conv_shape, state.conv.size());
  std::string delta = TensorPrefix(kStateDelta, dtype, state.delta_shape, state.delta.size());
  std::string head;
  AppendPrefix(kUpdateState,
               advance.size() + conv.size() + state.conv.size() + delta.size() + state.delta.size(),
               head);
  runs.push_back({head + advance + conv, state.conv});
  runs.push_back({std::move(delta), state.delta});
}

void ReleaseOwner(void* owner) { delete static_cast<std::shared_ptr<const void>*>(owner); }

grpc::Slice SharedSlice(absl::Span<const std::byte> data, const std::shared_ptr<const void>& owner) {
  return grpc::Slice(const_cast<std::byte*>(data.data()), data.size(), &ReleaseOwner,
                     new std::shared_ptr<const void>(owner));
}

}  // namespace

std::vector<Run> FrameUpdate(const std::string& cache_id, const LayerUpdate& update) {
  v1::UpdateRequest scalars;
  scalars.set_cache_id(cache_id);
  scalars.set_layer(update.layer);
  if (update.expected_offset.has_value()) scalars.set_expected_offset(*update.expected_offset);
  scalars.set_speculation_id(update.speculation_id);
  std::vector<Run> runs = {{scalars.SerializeAsString(), {}}};
  if (SendsTokens(update)) {
    runs.back().framing +=
        TensorPrefix(kUpdateKeys, update.dtype, update.keys_shape, update.keys.size());
    runs.back().data = update.keys;
    runs.push_back({TensorPrefix(kUpdateValues, update.dtype, update.values_shape,
                                 update.values.size()),
                    update.values});
  }
  if (update.state.has_value()) AppendStateRuns(update.dtype, *update.state, runs);
  return runs;
}

grpc::ByteBuffer EncodeUpdateCopy(const std::string& cache_id, const LayerUpdate& update) {
  const std::vector<Run> runs = FrameUpdate(cache_id, update);
  uint64_t bytes = 0;
  for (const Run& run : runs) bytes += run.framing.size() + run.data.size();
  grpc::Slice slice(bytes);
  auto* out = const_cast<uint8_t*>(slice.begin());
  for (const Run& run : runs) {
    std::memcpy(out, run.framing.data(), run.framing.size());
    out += run.framing.size();
    if (!run.data.empty()) std::memcpy(out, run.data.data(), run.data.size());
    out += run.data.size();
  }
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer EncodeUpdateShared(const std::string& cache_id, const LayerUpdate& update,
                                    std::shared_ptr<const void> owner) {
  const std::vector<Run> runs = FrameUpdate(cache_id, update);
  std::vector<grpc::Slice> slices;
  for (const Run& run : runs) {
    slices.emplace_back(run.framing);
    if (!run.data.empty()) slices.push_back(SharedSlice(run.data, owner));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace kvcache::internal
