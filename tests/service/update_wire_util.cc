#include "update_wire_util.h"

#include <google/protobuf/util/message_differencer.h>

#include <algorithm>
#include <functional>

namespace kvcache::testing {
namespace {

bool Coin(std::mt19937_64& rng) { return rng() % 2 == 0; }

std::string RandomBytes(uint64_t size, std::mt19937_64& rng) {
  std::string bytes(size, '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  return bytes;
}

// Values from every varint length, the edges included.
uint64_t RandomValue(std::mt19937_64& rng) {
  switch (rng() % 5) {
    case 0: return 0;
    case 1: return rng() % 200;
    case 2: return UINT64_MAX - rng() % 2;
    case 3: return rng() >> (rng() % 64);
    default: return uint64_t{1} << (rng() % 64);
  }
}

v1::Tensor RandomTensorMessage(std::mt19937_64& rng, uint64_t max_data) {
  static constexpr int32_t kDTypes[] = {0, 1, 2, 3, -1, 1000, INT32_MIN, INT32_MAX};
  v1::Tensor tensor;
  tensor.set_dtype(static_cast<v1::DType>(kDTypes[rng() % std::size(kDTypes)]));
  for (uint64_t d = rng() % 7; d > 0; --d) tensor.add_shape(RandomValue(rng));
  const uint64_t size = rng() % 4 == 0 ? 0 : rng() % (max_data + 1);
  *tensor.mutable_data() = RandomBytes(size, rng);
  return tensor;
}

// Up to two unknown fields with numbers from `numbers`, if asked for.
void AddUnknown(std::vector<std::string>& fields, std::initializer_list<uint32_t> numbers,
                UnknownFields unknown, std::mt19937_64& rng) {
  if (unknown == UnknownFields::kNone) return;
  for (uint64_t n = rng() % 3; n > 0; --n) {
    fields.push_back(UnknownField(numbers.begin()[rng() % numbers.size()], rng));
  }
}

// `ordered` kept in order, `free` anywhere, interleaved at random.
std::string Interleave(std::vector<std::string> ordered, std::vector<std::string> free,
                       std::mt19937_64& rng) {
  std::shuffle(free.begin(), free.end(), rng);
  std::string out;
  size_t a = 0, b = 0;
  while (a < ordered.size() || b < free.size()) {
    const bool take_ordered = b == free.size() || (a < ordered.size() && Coin(rng));
    out += take_ordered ? ordered[a++] : free[b++];
  }
  return out;
}

// Shape values in runs, each run packed or one field per value.
std::vector<std::string> ShapeFields(const v1::Tensor& tensor, std::mt19937_64& rng) {
  std::vector<std::string> fields;
  int i = 0;
  while (i < tensor.shape_size() || rng() % 8 == 0) {
    const int run = std::min<int>(tensor.shape_size() - i, 1 + rng() % 3);
    if (Coin(rng)) {
      std::string packed;
      for (int j = 0; j < run; ++j) packed += Varint(tensor.shape(i + j));
      fields.push_back(BytesField(2, packed));  // run may be 0: an empty packed field
    } else {
      for (int j = 0; j < run; ++j) fields.push_back(VarintField(2, tensor.shape(i + j)));
    }
    i += run;
  }
  return fields;
}

std::string EncodeTensor(const v1::Tensor& tensor, UnknownFields unknown, std::mt19937_64& rng) {
  std::vector<std::string> free;
  if (tensor.dtype() != 0 || Coin(rng)) {
    free.push_back(VarintField(1, static_cast<uint64_t>(int64_t{tensor.dtype()})));
  }
  if (!tensor.data().empty() || Coin(rng)) free.push_back(BytesField(3, tensor.data()));
  AddUnknown(free, {4, 5, 15, 16, 2047, 536870911}, unknown, rng);
  return Interleave(ShapeFields(tensor, rng), std::move(free), rng);
}

std::string EncodeState(const v1::RecurrentState& state, UnknownFields unknown,
                        std::mt19937_64& rng) {
  std::vector<std::string> fields;
  if (state.has_conv_state()) {
    fields.push_back(BytesField(1, EncodeTensor(state.conv_state(), unknown, rng)));
  }
  if (state.has_delta_state()) {
    fields.push_back(BytesField(2, EncodeTensor(state.delta_state(), unknown, rng)));
  }
  if (state.advance() != 0 || Coin(rng)) fields.push_back(VarintField(3, state.advance()));
  AddUnknown(fields, {4, 7, 100}, unknown, rng);
  return Interleave({}, std::move(fields), rng);
}

}  // namespace

std::string Varint(uint64_t value) {
  std::string out;
  while (value >= 0x80) {
    out.push_back(static_cast<char>(value | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
  return out;
}

std::string WireTag(uint32_t field, int wire_type) {
  return Varint((uint64_t{field} << 3) | static_cast<uint64_t>(wire_type));
}

std::string VarintField(uint32_t field, uint64_t value) {
  return WireTag(field, 0) + Varint(value);
}

std::string BytesField(uint32_t field, const std::string& body) {
  return WireTag(field, 2) + Varint(body.size()) + body;
}

std::string UnknownField(uint32_t field, std::mt19937_64& rng) {
  switch (rng() % 4) {
    case 0: return VarintField(field, RandomValue(rng));
    case 1: return WireTag(field, 1) + RandomBytes(8, rng);
    case 2: return BytesField(field, RandomBytes(rng() % 20, rng));
    default: return WireTag(field, 5) + RandomBytes(4, rng);
  }
}

v1::UpdateRequest RandomUpdateRequest(std::mt19937_64& rng, uint64_t max_data) {
  v1::UpdateRequest request;
  std::string id(rng() % 40, ' ');
  for (char& c : id) c = static_cast<char>(rng() % 128);  // ASCII, control characters included
  request.set_cache_id(id);
  request.set_layer(static_cast<uint32_t>(RandomValue(rng)));
  if (Coin(rng)) *request.mutable_keys() = RandomTensorMessage(rng, max_data);
  if (Coin(rng)) *request.mutable_values() = RandomTensorMessage(rng, max_data);
  if (rng() % 3 == 0) {
    v1::RecurrentState* state = request.mutable_state();
    if (Coin(rng)) *state->mutable_conv_state() = RandomTensorMessage(rng, max_data);
    if (Coin(rng)) *state->mutable_delta_state() = RandomTensorMessage(rng, max_data);
    state->set_advance(RandomValue(rng));
  }
  if (Coin(rng)) request.set_expected_offset(RandomValue(rng));
  if (Coin(rng)) {
    const size_t length = rng() % 40;
    const char letter = static_cast<char>('a' + rng() % 26);
    request.set_speculation_id(std::string(length, letter));
  }
  return request;
}

std::string RandomEncoding(const v1::UpdateRequest& request, std::mt19937_64& rng,
                           UnknownFields unknown) {
  std::vector<std::string> fields;
  if (!request.cache_id().empty() || Coin(rng)) fields.push_back(BytesField(1, request.cache_id()));
  if (request.layer() != 0 || Coin(rng)) fields.push_back(VarintField(2, request.layer()));
  if (request.has_keys()) {
    fields.push_back(BytesField(3, EncodeTensor(request.keys(), unknown, rng)));
  }
  if (request.has_values()) {
    fields.push_back(BytesField(4, EncodeTensor(request.values(), unknown, rng)));
  }
  if (request.has_state()) {
    fields.push_back(BytesField(5, EncodeState(request.state(), unknown, rng)));
  }
  if (!request.speculation_id().empty() || Coin(rng)) {
    fields.push_back(BytesField(6, request.speculation_id()));
  }
  if (request.has_expected_offset()) fields.push_back(VarintField(7, request.expected_offset()));
  AddUnknown(fields, {8, 9, 10, 1000}, unknown, rng);
  return Interleave({}, std::move(fields), rng);
}

std::vector<std::string> RandomPieces(const std::string& bytes, std::mt19937_64& rng,
                                      int max_cuts) {
  std::vector<size_t> cuts = {0, bytes.size()};
  for (int n = static_cast<int>(rng() % (max_cuts + 1)); n > 0; --n) {
    cuts.push_back(rng() % (bytes.size() + 1));
  }
  std::sort(cuts.begin(), cuts.end());
  std::vector<std::string> pieces;
  for (size_t i = 1; i < cuts.size(); ++i) {
    pieces.push_back(bytes.substr(cuts[i - 1], cuts[i] - cuts[i - 1]));
  }
  return pieces;
}

std::vector<absl::Span<const std::byte>> Spans(const std::vector<std::string>& pieces) {
  std::vector<absl::Span<const std::byte>> spans;
  for (const std::string& piece : pieces) {
    spans.emplace_back(reinterpret_cast<const std::byte*>(piece.data()), piece.size());
  }
  return spans;
}

namespace {

void RebuildTensor(const service::TensorView& view, v1::Tensor* out) {
  out->set_dtype(static_cast<v1::DType>(view.dtype));
  for (uint64_t d : view.shape) out->add_shape(d);
  std::string* data = out->mutable_data();
  data->resize(view.data.size());
  view.data.CopyTo(0, absl::MakeSpan(reinterpret_cast<std::byte*>(data->data()), data->size()));
}

}  // namespace

v1::UpdateRequest Rebuild(const service::UpdateView& view) {
  v1::UpdateRequest request;
  request.set_cache_id(view.cache_id);
  request.set_layer(view.layer);
  if (view.keys.has_value()) RebuildTensor(*view.keys, request.mutable_keys());
  if (view.values.has_value()) RebuildTensor(*view.values, request.mutable_values());
  if (view.state.has_value()) {
    v1::RecurrentState* state = request.mutable_state();
    RebuildTensor(view.state->conv_state, state->mutable_conv_state());
    RebuildTensor(view.state->delta_state, state->mutable_delta_state());
    state->set_advance(view.state->advance);
  }
  if (view.expected_offset.has_value()) request.set_expected_offset(*view.expected_offset);
  request.set_speculation_id(view.speculation_id);
  return request;
}

std::string Differences(v1::UpdateRequest expected, const v1::UpdateRequest& actual) {
  expected.DiscardUnknownFields();  // kept by protobuf, skipped by the service
  // A view's state has both tensors, present or not on the wire: nothing
  // reads their presence (an absent tensor is an empty one).
  if (expected.has_state()) {
    expected.mutable_state()->mutable_conv_state();
    expected.mutable_state()->mutable_delta_state();
  }
  google::protobuf::util::MessageDifferencer differencer;
  std::string report;
  differencer.ReportDifferencesToString(&report);
  differencer.Compare(expected, actual);
  return report;
}

bool PointsInto(const service::UpdateView& view, const std::vector<std::string>& pieces) {
  const auto inside = [&](absl::Span<const std::byte> part) {
    const char* begin = reinterpret_cast<const char*>(part.data());
    return std::any_of(pieces.begin(), pieces.end(), [&](const std::string& piece) {
      return begin >= piece.data() && begin + part.size() <= piece.data() + piece.size();
    });
  };
  std::vector<const service::TensorView*> tensors;
  if (view.keys.has_value()) tensors.push_back(&*view.keys);
  if (view.values.has_value()) tensors.push_back(&*view.values);
  if (view.state.has_value()) {
    tensors.push_back(&view.state->conv_state);
    tensors.push_back(&view.state->delta_state);
  }
  return std::all_of(tensors.begin(), tensors.end(), [&](const service::TensorView* tensor) {
    const auto parts = tensor->data.pieces();
    return std::all_of(parts.begin(), parts.end(), inside);
  });
}

}  // namespace kvcache::testing
