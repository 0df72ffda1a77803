// The server's own UpdateRequest parser against protobuf's: whatever it
// accepts, from the message cut into any pieces, protobuf must accept too and
// read as the same message. The first bytes of the input choose the cuts.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "google/protobuf/util/message_differencer.h"
#include "kvcache/v1/kvcache.pb.h"
#include "service/calls/update_parser.h"

namespace {

using kvcache::service::TensorView;

void CopyTensor(const TensorView& view, kvcache::v1::Tensor& tensor) {
  tensor.set_dtype(static_cast<kvcache::v1::DType>(view.dtype));
  for (uint64_t dim : view.shape) tensor.add_shape(dim);
  std::string data(view.data.size(), '\0');
  view.data.CopyTo(0, {reinterpret_cast<std::byte*>(data.data()), data.size()});
  tensor.set_data(std::move(data));
}

kvcache::v1::UpdateRequest Rebuild(const kvcache::service::UpdateView& view) {
  kvcache::v1::UpdateRequest request;
  request.set_cache_id(view.cache_id);
  request.set_layer(view.layer);
  if (view.keys) CopyTensor(*view.keys, *request.mutable_keys());
  if (view.values) CopyTensor(*view.values, *request.mutable_values());
  if (view.state) {
    kvcache::v1::RecurrentState& state = *request.mutable_state();
    CopyTensor(view.state->conv_state, *state.mutable_conv_state());
    CopyTensor(view.state->delta_state, *state.mutable_delta_state());
    state.set_advance(view.state->advance);
  }
  if (view.expected_offset) request.set_expected_offset(*view.expected_offset);
  request.set_speculation_id(view.speculation_id);
  return request;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  // data[0] % 4 cuts at the next bytes' positions, then the message.
  const size_t cuts = std::min<size_t>(data[0] % 4, size - 1);
  const auto* message = reinterpret_cast<const std::byte*>(data + 1 + cuts);
  const size_t message_size = size - 1 - cuts;
  std::vector<size_t> at = {0};
  for (size_t i = 0; i < cuts; ++i) {
    at.push_back(message_size == 0 ? 0 : data[1 + i] % (message_size + 1));
  }
  at.push_back(message_size);
  std::sort(at.begin(), at.end());
  std::vector<absl::Span<const std::byte>> pieces;
  for (size_t i = 0; i + 1 < at.size(); ++i)
    pieces.emplace_back(message + at[i], at[i + 1] - at[i]);

  kvcache::service::UpdateView view;
  if (!kvcache::service::ParseUpdateRequest(pieces, view)) return 0;
  kvcache::v1::UpdateRequest expected;
  if (!expected.ParseFromArray(message, static_cast<int>(message_size))) std::abort();
  // A view's state always has both tensors (the server reads an absent one as
  // empty), so the two are compared with both present.
  if (expected.has_state()) {
    expected.mutable_state()->mutable_conv_state();
    expected.mutable_state()->mutable_delta_state();
  }
  if (!google::protobuf::util::MessageDifferencer::Equals(expected, Rebuild(view))) std::abort();
  return 0;
}
