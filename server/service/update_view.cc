#include "service/update_view.h"

namespace kvcache::service {
namespace {

TensorView ViewOf(const v1::Tensor& tensor) {
  TensorView view;
  view.dtype = tensor.dtype();
  view.shape.assign(tensor.shape().begin(), tensor.shape().end());
  const std::string& data = tensor.data();
  view.data = absl::MakeConstSpan(reinterpret_cast<const std::byte*>(data.data()), data.size());
  return view;
}

}  // namespace

UpdateView ViewOf(const v1::UpdateRequest& request) {
  UpdateView view;
  view.cache_id = request.cache_id();
  view.layer = request.layer();
  if (request.has_keys()) view.keys = ViewOf(request.keys());
  if (request.has_values()) view.values = ViewOf(request.values());
  if (request.has_state()) {
    const v1::RecurrentState& state = request.state();
    view.state = StateView{.conv_state = ViewOf(state.conv_state()),
                           .delta_state = ViewOf(state.delta_state()),
                           .advance = state.advance()};
  }
  if (request.has_expected_offset()) view.expected_offset = request.expected_offset();
  view.speculation_id = request.speculation_id();
  return view;
}

}  // namespace kvcache::service
