// The Fetch chunks that are not plain keys and values: a quantized layer's
// stored form (FetchRequest.packed) and a recurrent layer's state. Both go
// through protobuf (they are small next to the tokens' path, whose chunks
// fetch_call.cc frames by hand around data read from pages or mapped in them).
#include <algorithm>
#include <string>

#include "core/status_macros.h"
#include "core/tensor_size.h"
#include "service/convert.h"
#include "service/handlers.h"

namespace kvcache::service {
namespace {

absl::Span<std::byte> Resized(v1::Tensor* tensor, DType dtype,
                              std::initializer_list<uint64_t> shape) {
  tensor->set_dtype(ToProto(dtype));
  for (uint64_t d : shape) tensor->add_shape(d);
  std::string* data = tensor->mutable_data();
  data->resize(TensorByteSize(dtype, shape));
  return absl::MakeSpan(reinterpret_cast<std::byte*>(data->data()), data->size());
}

// wq [B, H, L, D*bits/32] uint32 words (dtype left unspecified: they are not
// floats), scales and biases [B, H, L, D/group] in the cache dtype.
engine::PackedOutput::Side ShapePacked(v1::QuantizedTensor* out, const engine::CacheSpec& spec,
                                       const engine::LayerSpec& layer,
                                       const engine::QuantizedKind& q, uint64_t tokens,
                                       uint32_t dim) {
  out->set_group_size(q.group_size);
  out->set_bits(q.bits);
  const uint64_t b = spec.batch_size, h = layer.num_kv_heads;
  engine::PackedOutput::Side side;
  // Sized as float32, the 4-byte type the words share their size with.
  side.wq = Resized(out->mutable_wq(), DType::kFloat32, {b, h, tokens, dim * q.bits / 32});
  out->mutable_wq()->set_dtype(v1::DTYPE_UNSPECIFIED);
  const uint64_t groups = dim / q.group_size;
  side.scales = Resized(out->mutable_scales(), spec.dtype, {b, h, tokens, groups});
  side.biases = Resized(out->mutable_biases(), spec.dtype, {b, h, tokens, groups});
  return side;
}

}  // namespace

void Handlers::PlanLayer(const v1::FetchRequest& request, uint32_t layer, uint64_t end,
                         FetchPlan& plan) const {
  const engine::LayerSpec& spec = plan.snapshot->spec.layers[layer];
  if (engine::IsRecurrent(spec)) {
    // One chunk with the whole state, when the layer has one.
    const engine::LayerSnapshotPtr& part = plan.snapshot->layers[layer];
    if (part) plan.chunks.push_back({layer, {part->to(), part->to()}, FetchPlan::Form::kState});
    return;
  }
  // `packed` asks for the stored form: only quantized layers store another one.
  const bool packed = request.packed() && std::holds_alternative<engine::QuantizedKind>(spec.kind);
  const FetchPlan::Form form = packed ? FetchPlan::Form::kPacked : FetchPlan::Form::kTokens;
  const uint64_t step = ChunkTokens(plan.snapshot->spec, layer, request.max_chunk_tokens());
  for (const engine::TokenRange& range : plan.snapshot->Ranges(layer, {request.start(), end})) {
    for (uint64_t begin = range.begin; begin < range.end; begin += step) {
      plan.chunks.push_back({layer, {begin, std::min(range.end, begin + step)}, form});
    }
  }
}

absl::Status Handlers::FillPackedChunk(const FetchPlan& plan, size_t index,
                                       v1::FetchResponse* response) const {
  const FetchPlan::Chunk& chunk = plan.chunks[index];
  const engine::CacheSpec& spec = plan.snapshot->spec;
  const engine::LayerSpec& layer = spec.layers[chunk.layer];
  const auto& q = std::get<engine::QuantizedKind>(layer.kind);
  response->set_layer(chunk.layer);
  response->set_start(chunk.range.begin);
  const uint64_t tokens = chunk.range.size();
  engine::PackedOutput out;
  out.keys = ShapePacked(response->mutable_packed_keys(), spec, layer, q, tokens, layer.k_head_dim);
  out.values =
      ShapePacked(response->mutable_packed_values(), spec, layer, q, tokens, layer.v_head_dim);
  return plan.snapshot->ReadPacked(chunk.layer, chunk.range, out);
}

absl::Status Handlers::FillStateChunk(const FetchPlan& plan, size_t index,
                                      v1::FetchResponse* response) const {
  const FetchPlan::Chunk& chunk = plan.chunks[index];
  const engine::CacheSpec& spec = plan.snapshot->spec;
  const auto& r = std::get<engine::RecurrentKind>(spec.layers[chunk.layer].kind);
  response->set_layer(chunk.layer);
  response->set_start(chunk.range.begin);
  v1::RecurrentState* state = response->mutable_state();
  const uint64_t b = spec.batch_size;
  engine::StateOutput out;
  out.conv = Resized(state->mutable_conv_state(), spec.dtype, {b, r.conv_tail, r.conv_dim});
  out.delta = Resized(state->mutable_delta_state(), spec.dtype,
                      {b, r.num_v_heads, r.head_v_dim, r.head_k_dim});
  return plan.snapshot->ReadState(chunk.layer, out);
}

}  // namespace kvcache::service
