#include "reference_quantized.h"

#include <cstring>
#include <variant>

#include "absl/strings/str_format.h"

namespace kvcache::testing {
namespace {

// One side of a raw token ([B*H][dim] elements) -> packed rows, one per (b, h).
std::vector<std::byte> PackSide(const RefQuantFormat& f, uint32_t dim, uint64_t row_heads,
                                const std::vector<std::byte>& raw) {
  const uint64_t raw_row = uint64_t{dim} * DTypeSize(f.dtype);
  std::vector<std::byte> packed;
  packed.reserve(row_heads * PackedRowBytes(f, dim));
  for (uint64_t rh = 0; rh < row_heads; ++rh) {
    const RefPacked row = RefQuantize(f, absl::MakeConstSpan(raw).subspan(rh * raw_row, raw_row));
    packed.insert(packed.end(), row.wq.begin(), row.wq.end());
    packed.insert(packed.end(), row.scales.begin(), row.scales.end());
    packed.insert(packed.end(), row.biases.begin(), row.biases.end());
  }
  return packed;
}

std::vector<std::byte> UnpackSide(const RefQuantFormat& f, uint32_t dim, uint64_t row_heads,
                                  const std::vector<std::byte>& packed) {
  const uint64_t wq = WqRowBytes(f, dim);
  const uint64_t scales = ScaleRowBytes(f, dim);
  std::vector<std::byte> raw;
  for (uint64_t rh = 0; rh < row_heads; ++rh) {
    const std::byte* row = packed.data() + rh * PackedRowBytes(f, dim);
    const RefPacked planes{
        {row, row + wq}, {row + wq, row + wq + scales}, {row + wq + scales, row + wq + 2 * scales}};
    const std::vector<std::byte> values = RefDequantize(f, planes);
    raw.insert(raw.end(), values.begin(), values.end());
  }
  return raw;
}

// One side of the engine's packed output for L tokens -> token l's packed rows.
struct SideBuffers {
  std::vector<std::byte> wq, scales, biases;

  SideBuffers(const RefQuantFormat& f, uint32_t dim, uint64_t rows)
      : wq(rows * WqRowBytes(f, dim), std::byte{0xA5}),
        scales(rows * ScaleRowBytes(f, dim), std::byte{0xA5}),
        biases(rows * ScaleRowBytes(f, dim), std::byte{0xA5}) {}
  engine::PackedOutput::Side Out() {
    return {absl::MakeSpan(wq), absl::MakeSpan(scales), absl::MakeSpan(biases)};
  }
  // [B, H, L, ...] planes -> token `l`'s rows in the packed-token layout.
  std::vector<std::byte> Token(const RefQuantFormat& f, uint32_t dim, uint64_t row_heads,
                               uint64_t tokens, uint64_t l) const {
    const uint64_t w = WqRowBytes(f, dim);
    const uint64_t s = ScaleRowBytes(f, dim);
    std::vector<std::byte> out;
    for (uint64_t rh = 0; rh < row_heads; ++rh) {
      const uint64_t row = rh * tokens + l;
      out.insert(out.end(), wq.begin() + row * w, wq.begin() + (row + 1) * w);
      out.insert(out.end(), scales.begin() + row * s, scales.begin() + (row + 1) * s);
      out.insert(out.end(), biases.begin() + row * s, biases.begin() + (row + 1) * s);
    }
    return out;
  }
};

absl::StatusOr<std::vector<RefToken>> ReadPackedRange(const engine::CacheSnapshot& view,
                                                      uint32_t layer, engine::TokenRange range,
                                                      const RefQuantFormat& f) {
  const RefShape shape = ShapeOf(view.spec, layer);
  const uint64_t row_heads = uint64_t{shape.batch} * shape.heads;
  const uint64_t rows = row_heads * range.size();
  SideBuffers keys(f, shape.k_dim, rows);
  SideBuffers values(f, shape.v_dim, rows);
  absl::Status status = view.ReadPacked(layer, range, {keys.Out(), values.Out()});
  if (!status.ok()) return status;
  std::vector<RefToken> tokens(range.size());
  for (uint64_t l = 0; l < range.size(); ++l) {
    tokens[l].position = range.begin + l;
    tokens[l].keys = keys.Token(f, shape.k_dim, row_heads, range.size(), l);
    tokens[l].values = values.Token(f, shape.v_dim, row_heads, range.size(), l);
  }
  return tokens;
}

}  // namespace

RefToken QuantizeToken(const RefShape& shape, const RefQuantFormat& f, const RefToken& raw) {
  const uint64_t row_heads = uint64_t{shape.batch} * shape.heads;
  return RefToken{.position = raw.position,
                  .keys = PackSide(f, shape.k_dim, row_heads, raw.keys),
                  .values = PackSide(f, shape.v_dim, row_heads, raw.values)};
}

RefToken DequantizeToken(const RefShape& shape, const RefQuantFormat& f, const RefToken& packed) {
  const uint64_t row_heads = uint64_t{shape.batch} * shape.heads;
  return RefToken{.position = packed.position,
                  .keys = UnpackSide(f, shape.k_dim, row_heads, packed.keys),
                  .values = UnpackSide(f, shape.v_dim, row_heads, packed.values)};
}

std::unique_ptr<RefLayer> RefQuantizedLayer::Clone() const {
  return std::make_unique<RefQuantizedLayer>(*this);
}

void RefQuantizedLayer::Update(std::vector<RefToken> tokens) {
  for (RefToken& token : tokens) token = QuantizeToken(shape_, format_, token);
  standard_.Update(std::move(tokens));
}

bool QuantFormatOf(const engine::CacheSpec& spec, size_t layer, RefQuantFormat& format) {
  const auto* quantized = std::get_if<engine::QuantizedKind>(&spec.layers[layer].kind);
  if (quantized == nullptr) return false;
  format = {spec.dtype, quantized->group_size, quantized->bits};
  return true;
}

KvTensors RandomLayerKv(const engine::CacheSpec& spec, size_t layer, uint64_t tokens,
                        std::mt19937_64& rng) {
  RefQuantFormat f;
  if (!QuantFormatOf(spec, layer, f)) return RandomKv(spec, layer, tokens, rng);
  const RefShape shape = ShapeOf(spec, layer);
  const uint64_t rows = tokens * shape.batch * shape.heads;
  return KvTensors{
      .keys = RandomQuantizableValues(spec.dtype, rows * shape.k_dim, f.group_size, rng),
      .values = RandomQuantizableValues(spec.dtype, rows * shape.v_dim, f.group_size, rng),
      .tokens = tokens};
}

absl::StatusOr<std::vector<RefToken>> ReadStoredRange(const engine::CacheSnapshot& view,
                                                      uint32_t layer, engine::TokenRange range) {
  RefQuantFormat f;
  if (!QuantFormatOf(view.spec, layer, f)) return ReadRange(view, layer, range);
  absl::StatusOr<std::vector<RefToken>> packed = ReadPackedRange(view, layer, range, f);
  if (!packed.ok()) return packed.status();
  absl::StatusOr<std::vector<RefToken>> dequantized = ReadRange(view, layer, range);
  if (!dequantized.ok()) return dequantized.status();
  const RefShape shape = ShapeOf(view.spec, layer);
  for (size_t i = 0; i < packed->size(); ++i) {
    const RefToken expected = DequantizeToken(shape, f, (*packed)[i]);
    if (expected.keys != (*dequantized)[i].keys || expected.values != (*dequantized)[i].values) {
      return absl::InternalError(absl::StrFormat(
          "the dequantized %s of position %d differ from the CPU dequantization of the packed form",
          expected.keys != (*dequantized)[i].keys ? "keys" : "values", expected.position));
    }
  }
  return packed;
}

absl::StatusOr<std::vector<RefToken>> FetchStoredLayer(const engine::CacheSnapshot& view,
                                                       uint32_t layer, engine::TokenRange window) {
  std::vector<RefToken> tokens;
  for (const engine::TokenRange& range : view.Ranges(layer, window)) {
    absl::StatusOr<std::vector<RefToken>> part = ReadStoredRange(view, layer, range);
    if (!part.ok()) return part.status();
    for (RefToken& token : *part) tokens.push_back(std::move(token));
  }
  return tokens;
}

}  // namespace kvcache::testing
