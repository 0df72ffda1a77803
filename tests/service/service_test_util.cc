#include "service_test_util.h"

namespace kvcache::testing {

v1::CacheSpec ProtoSpec(uint32_t standard_layers, uint32_t heads, uint32_t head_dim,
                        uint32_t window, v1::DType dtype, uint32_t batch) {
  v1::CacheSpec spec;
  spec.set_dtype(dtype);
  spec.set_batch_size(batch);
  for (uint32_t i = 0; i < standard_layers; ++i) {
    auto* layer = spec.add_layers();
    layer->set_num_kv_heads(heads);
    layer->set_k_head_dim(head_dim);
    layer->mutable_standard();
  }
  if (window > 0) {
    auto* layer = spec.add_layers();
    layer->set_num_kv_heads(heads);
    layer->set_k_head_dim(head_dim);
    layer->mutable_rotating()->set_max_size(window);
    layer->mutable_rotating()->set_keep(4);
  }
  return spec;
}

v1::Tensor RandomTensor(v1::DType dtype, std::vector<uint64_t> shape, std::mt19937_64& rng) {
  v1::Tensor tensor;
  tensor.set_dtype(dtype);
  uint64_t bytes = dtype == v1::DTYPE_FLOAT32 ? 4 : 2;
  for (uint64_t d : shape) {
    tensor.add_shape(d);
    bytes *= d;
  }
  std::string* data = tensor.mutable_data();
  data->resize(bytes);
  for (char& c : *data) c = static_cast<char>(rng());
  return tensor;
}

v1::UpdateRequest RandomUpdate(const std::string& cache_id, const v1::CacheSpec& spec,
                               uint32_t layer, uint64_t tokens, std::mt19937_64& rng) {
  const v1::LayerSpec& l = spec.layers(layer);
  const uint64_t batch = spec.batch_size() == 0 ? 1 : spec.batch_size();
  const uint32_t v_dim = l.v_head_dim() == 0 ? l.k_head_dim() : l.v_head_dim();
  v1::UpdateRequest request;
  request.set_cache_id(cache_id);
  request.set_layer(layer);
  *request.mutable_keys() =
      RandomTensor(spec.dtype(), {batch, l.num_kv_heads(), tokens, l.k_head_dim()}, rng);
  *request.mutable_values() = RandomTensor(spec.dtype(), {batch, l.num_kv_heads(), tokens, v_dim}, rng);
  return request;
}

}  // namespace kvcache::testing
