#include "wire_forms_util.h"

#include <cstring>
#include <string>
#include <tuple>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "reference_quantized.h"
#include "reference_recurrent.h"

namespace kvcache::testing {
namespace {

absl::Status Invalid(const std::string& field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

// `tensor` has `dtype`, `shape`, and product(shape) * elem_bytes bytes of data.
absl::Status CheckTensor(const std::string& field, const v1::Tensor& tensor, v1::DType dtype,
                         const std::vector<uint64_t>& shape, uint64_t elem_bytes) {
  if (tensor.dtype() != dtype) {
    return Invalid(field, absl::StrCat("dtype ", tensor.dtype(), ", expected ", dtype));
  }
  const std::vector<uint64_t> actual(tensor.shape().begin(), tensor.shape().end());
  if (actual != shape) {
    return Invalid(field, absl::StrCat("shape [", absl::StrJoin(actual, ","), "], expected [",
                                       absl::StrJoin(shape, ","), "]"));
  }
  uint64_t bytes = elem_bytes;
  for (uint64_t d : shape) bytes *= d;
  if (tensor.data().size() != bytes) {
    return Invalid(field, absl::StrCat(tensor.data().size(), " bytes, expected ", bytes));
  }
  return absl::OkStatus();
}

absl::Span<const std::byte> Bytes(const std::string& data) {
  return {reinterpret_cast<const std::byte*>(data.data()), data.size()};
}

// One side (keys or values) of a packed chunk of `tokens` tokens, checked.
absl::Status CheckPackedSide(const std::string& field, const v1::QuantizedTensor& side,
                             const RefQuantFormat& f, v1::DType dtype, uint64_t batch,
                             uint64_t heads, uint64_t tokens, uint32_t dim) {
  if (side.group_size() != f.group_size || side.bits() != f.bits) {
    return Invalid(field, absl::StrCat("group_size ", side.group_size(), " bits ", side.bits(),
                                       ", expected ", f.group_size, " and ", f.bits));
  }
  const uint64_t groups = dim / f.group_size;
  // wq holds uint32 words, which no DType names.
  RETURN_IF_ERROR(CheckTensor(field + ".wq", side.wq(), v1::DTYPE_UNSPECIFIED,
                              {batch, heads, tokens, uint64_t{dim} * f.bits / 32}, 4));
  const uint64_t elem = DTypeSize(f.dtype);
  RETURN_IF_ERROR(
      CheckTensor(field + ".scales", side.scales(), dtype, {batch, heads, tokens, groups}, elem));
  return CheckTensor(field + ".biases", side.biases(), dtype, {batch, heads, tokens, groups}, elem);
}

// Token `l`'s packed rows of one side: per (row, head) its wq, scales, biases.
std::vector<std::byte> PackedToken(const v1::QuantizedTensor& side, const RefQuantFormat& f,
                                   uint32_t dim, uint64_t row_heads, uint64_t tokens, uint64_t l) {
  const uint64_t w = WqRowBytes(f, dim);
  const uint64_t s = ScaleRowBytes(f, dim);
  std::vector<std::byte> out;
  out.reserve(row_heads * (w + 2 * s));
  for (uint64_t rh = 0; rh < row_heads; ++rh) {
    const uint64_t row = rh * tokens + l;
    for (auto [plane, bytes] :
         {std::pair{&side.wq(), w}, std::pair{&side.scales(), s}, std::pair{&side.biases(), s}}) {
      const absl::Span<const std::byte> data = Bytes(plane->data());
      out.insert(out.end(), data.begin() + row * bytes, data.begin() + (row + 1) * bytes);
    }
  }
  return out;
}

// The kind of a wire LayerSpec, field by field.
struct WireKind {
  v1::LayerSpec* out;
  void operator()(const engine::StandardKind&) const { out->mutable_standard(); }
  void operator()(const engine::RotatingKind& k) const {
    out->mutable_rotating()->set_max_size(k.max_size);
    out->mutable_rotating()->set_keep(k.keep);
  }
  void operator()(const engine::QuantizedKind& k) const {
    out->mutable_quantized()->set_group_size(k.group_size);
    out->mutable_quantized()->set_bits(k.bits);
  }
  void operator()(const engine::ChunkedKind& k) const {
    out->mutable_chunked()->set_chunk_size(k.chunk_size);
  }
  void operator()(const engine::RecurrentKind& k) const {
    v1::RecurrentLayer* r = out->mutable_recurrent();
    r->set_conv_tail(k.conv_tail);
    r->set_conv_dim(k.conv_dim);
    r->set_num_v_heads(k.num_v_heads);
    r->set_head_v_dim(k.head_v_dim);
    r->set_head_k_dim(k.head_k_dim);
  }
};

}  // namespace

v1::CacheSpec ToWireSpec(const engine::CacheSpec& spec) {
  v1::CacheSpec wire;
  wire.set_dtype(static_cast<v1::DType>(spec.dtype));
  wire.set_batch_size(spec.batch_size);
  wire.set_model(spec.model);
  for (uint32_t padding : spec.left_padding) wire.add_left_padding(padding);
  for (const engine::LayerSpec& layer : spec.layers) {
    v1::LayerSpec* out = wire.add_layers();
    out->set_num_kv_heads(layer.num_kv_heads);
    out->set_k_head_dim(layer.k_head_dim);
    out->set_v_head_dim(layer.v_head_dim);
    std::visit(WireKind{out}, layer.kind);
  }
  return wire;
}

absl::StatusOr<std::vector<RefToken>> PackedTokensOf(const engine::CacheSpec& spec, uint32_t layer,
                                                     absl::Span<const v1::FetchResponse> chunks) {
  RefQuantFormat f;
  if (!QuantFormatOf(spec, layer, f)) {
    return absl::FailedPreconditionError(absl::StrCat("layer ", layer, " is not quantized"));
  }
  const RefShape shape = ShapeOf(spec, layer);
  const v1::DType dtype = static_cast<v1::DType>(spec.dtype);
  std::vector<RefToken> tokens;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const v1::FetchResponse& chunk = chunks[c];
    const std::string name = absl::StrCat("chunk ", c, " (layer ", chunk.layer(), ")");
    if (chunk.layer() != layer) return Invalid(name, absl::StrCat("expected layer ", layer));
    if (chunk.has_keys() || chunk.has_values() || chunk.has_state()) {
      return Invalid(name, "a packed chunk carries keys, values or a state");
    }
    const uint64_t length =
        chunk.packed_keys().wq().shape_size() == 4 ? chunk.packed_keys().wq().shape(2) : 0;
    if (length == 0) return Invalid(name + " packed_keys.wq.shape", "no tokens");
    for (auto [field, side, dim] :
         {std::tuple{".packed_keys", &chunk.packed_keys(), shape.k_dim},
          std::tuple{".packed_values", &chunk.packed_values(), shape.v_dim}}) {
      RETURN_IF_ERROR(
          CheckPackedSide(name + field, *side, f, dtype, shape.batch, shape.heads, length, dim));
    }
    const uint64_t row_heads = uint64_t{shape.batch} * shape.heads;
    for (uint64_t l = 0; l < length; ++l) {
      tokens.push_back(RefToken{
          .position = chunk.start() + l,
          .keys = PackedToken(chunk.packed_keys(), f, shape.k_dim, row_heads, length, l),
          .values = PackedToken(chunk.packed_values(), f, shape.v_dim, row_heads, length, l)});
    }
  }
  return tokens;
}

absl::StatusOr<RefState> StateOf(const engine::CacheSpec& spec, uint32_t layer,
                                 const v1::RecurrentState& state) {
  const auto& r = std::get<engine::RecurrentKind>(spec.layers[layer].kind);
  const v1::DType dtype = static_cast<v1::DType>(spec.dtype);
  const uint64_t elem = DTypeSize(spec.dtype), b = spec.batch_size;
  RETURN_IF_ERROR(CheckTensor("state.conv_state", state.conv_state(), dtype,
                              {b, r.conv_tail, r.conv_dim}, elem));
  RETURN_IF_ERROR(CheckTensor("state.delta_state", state.delta_state(), dtype,
                              {b, r.num_v_heads, r.head_v_dim, r.head_k_dim}, elem));
  const absl::Span<const std::byte> conv = Bytes(state.conv_state().data());
  const absl::Span<const std::byte> delta = Bytes(state.delta_state().data());
  return RefState{.conv = {conv.begin(), conv.end()}, .delta = {delta.begin(), delta.end()}};
}

std::vector<RefToken> AsFetched(const engine::CacheSpec& spec, uint32_t layer,
                                std::vector<RefToken> stored) {
  RefQuantFormat f;
  if (!QuantFormatOf(spec, layer, f)) return stored;
  const RefShape shape = ShapeOf(spec, layer);
  for (RefToken& token : stored) token = DequantizeToken(shape, f, token);
  return stored;
}

v1::RecurrentState ToWireState(const engine::CacheSpec& spec, uint32_t layer, const RefState& state,
                               uint64_t advance) {
  const auto& r = std::get<engine::RecurrentKind>(spec.layers[layer].kind);
  const v1::DType dtype = static_cast<v1::DType>(spec.dtype);
  const uint64_t b = spec.batch_size;
  v1::RecurrentState out;
  for (auto [tensor, bytes, shape] :
       {std::tuple{out.mutable_conv_state(), &state.conv,
                   std::vector<uint64_t>{b, r.conv_tail, r.conv_dim}},
        std::tuple{out.mutable_delta_state(), &state.delta,
                   std::vector<uint64_t>{b, r.num_v_heads, r.head_v_dim, r.head_k_dim}}}) {
    tensor->set_dtype(dtype);
    for (uint64_t d : shape) tensor->add_shape(d);
    tensor->set_data(reinterpret_cast<const char*>(bytes->data()), bytes->size());
  }
  out.set_advance(advance);
  return out;
}

}  // namespace kvcache::testing
