#include "engine/files/mlx_layer_parsers.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/client_text.h"
#include "core/status_macros.h"
#include "engine/files/mlx_batch_meta.h"
#include "engine/files/mlx_file_util.h"

namespace kvcache::engine::mlx_file {
namespace {

// Tokens runs [first, first + count) of every row-head of a [B, H, L, D]
// tensor, in that order per row-head: pieces of the tensor's own bytes.
TensorBytes TokenRuns(const FileTensor& tensor,
                      std::initializer_list<std::pair<uint64_t, uint64_t>> runs) {
  const uint64_t tokens = tensor.shape[2];
  const uint64_t token_bytes = tensor.data.size() / (tensor.shape[0] * tensor.shape[1] * tokens);
  TensorBytes bytes;
  for (uint64_t rh = 0; rh < tensor.shape[0] * tensor.shape[1]; ++rh) {
    for (const auto& [first, count] : runs) {
      if (count == 0) continue;
      bytes.Append(absl::MakeConstSpan(tensor.data)
                       .subspan((rh * tokens + first) * token_bytes, count * token_bytes));
    }
  }
  return bytes;
}

absl::Status TakeDType(const std::string& key, const FileTensor& tensor, ParsedLayer& out) {
  const std::optional<DType> dtype = mlx_file::CacheDType(tensor.dtype);
  if (!dtype.has_value()) return BadTensor(key, "dtype must be F32, F16 or BF16");
  for (uint64_t dim : tensor.shape) {
    if (dim > UINT32_MAX) return BadTensor(key, absl::StrFormat("dimension %d is too large", dim));
  }
  out.dtype = *dtype;
  out.batch = tensor.shape[0];
  out.shape_key = key;
  return absl::OkStatus();
}

std::string Shape(const FileTensor& tensor) {
  return absl::StrCat("[", absl::StrJoin(tensor.shape, ","), "]");
}

// `second` has `first`'s dtype and its dims [0, dims) (B, H, L).
absl::Status SameLeading(const std::string& first_key, const FileTensor& first,
                         const std::string& key, const FileTensor& second, size_t dims) {
  for (size_t d = 0; d < dims; ++d) {
    if (second.shape[d] != first.shape[d]) {
      return BadTensor(key, absl::StrFormat("shape %s does not match \"%s\"'s %s", Shape(second),
                                            first_key, Shape(first)));
    }
  }
  return absl::OkStatus();
}

// keys "<l>.0" [B,H,L,Dk] and values "<l>.1" [B,H,L,Dv]: the dims and dtype.
absl::StatusOr<std::pair<const FileTensor*, const FileTensor*>> ParseKeysValues(FileReader& reader,
                                                                                uint32_t layer,
                                                                                ParsedLayer& out) {
  const std::string k_key = Key(layer, 0), v_key = Key(layer, 1);
  ASSIGN_OR_RETURN(const FileTensor* keys, reader.Tensor(k_key, 4));
  ASSIGN_OR_RETURN(const FileTensor* values, reader.Tensor(v_key, 4));
  RETURN_IF_ERROR(TakeDType(k_key, *keys, out));
  if (values->dtype != keys->dtype) return BadTensor(v_key, "dtype differs from the keys'");
  RETURN_IF_ERROR(SameLeading(k_key, *keys, v_key, *values, 3));
  if (values->shape[3] > UINT32_MAX) return BadTensor(v_key, "head dim too large");
  out.spec.num_kv_heads = static_cast<uint32_t>(keys->shape[1]);
  out.spec.k_head_dim = static_cast<uint32_t>(keys->shape[3]);
  out.spec.v_head_dim = static_cast<uint32_t>(values->shape[3]);
  return std::make_pair(keys, values);
}

absl::Status ParseStandard(FileReader& reader, uint32_t layer, ParsedLayer& out) {
  RETURN_IF_ERROR(reader.NoMeta(layer, out.mlx_class));
  ASSIGN_OR_RETURN(const auto kv, ParseKeysValues(reader, layer, out));
  const uint64_t tokens = kv.first->shape[2];
  out.spec.kind = StandardKind{};
  out.offset = tokens;
  out.offset_key = Key(layer, 0);
  out.contents.held = {kv.first->data, kv.second->data, tokens};
  return absl::OkStatus();
}

// An int32 [B] array of a BatchKVCache (mx.array of Python ints).
absl::StatusOr<std::vector<int64_t>> BatchArray(FileReader& reader, const std::string& key,
                                                uint64_t batch) {
  ASSIGN_OR_RETURN(const FileTensor* tensor, reader.Tensor(key, 1));
  if (tensor->dtype != FileDType::kI32) return BadTensor(key, "dtype must be I32");
  if (tensor->shape[0] != batch) {
    return BadTensor(key,
                     absl::StrFormat("has %d entries for a batch of %d", tensor->shape[0], batch));
  }
  std::vector<int64_t> values(batch);
  for (uint64_t b = 0; b < batch; ++b) {
    int32_t value;
    std::memcpy(&value, tensor->data.data() + b * 4, 4);
    values[b] = value;
  }
  return values;
}

// mlx-lm BatchKVCache: offset[b] = _idx - left_padding[b], _idx = L.
absl::Status ParseBatch(FileReader& reader, uint32_t layer, ParsedLayer& out) {
  RETURN_IF_ERROR(ParseStandard(reader, layer, out));
  const uint64_t tokens = *out.offset;
  ASSIGN_OR_RETURN(const std::vector<int64_t> offsets,
                   BatchArray(reader, Key(layer, 2), out.batch));
  ASSIGN_OR_RETURN(const std::vector<int64_t> paddings,
                   BatchArray(reader, Key(layer, 3), out.batch));
  std::vector<uint32_t> left_padding;
  for (uint64_t b = 0; b < out.batch; ++b) {
    if (paddings[b] < 0) {
      return BadTensor(Key(layer, 3), absl::StrFormat("left_padding[%d] is negative", b));
    }
    if (offsets[b] != static_cast<int64_t>(tokens) - paddings[b]) {
      return BadTensor(Key(layer, 2),
                       absl::StrFormat("offset[%d] is %d, but %d tokens less left_padding %d is %d",
                                       b, offsets[b], tokens, paddings[b],
                                       static_cast<int64_t>(tokens) - paddings[b]));
    }
    left_padding.push_back(static_cast<uint32_t>(paddings[b]));
  }
  out.left_padding = std::move(left_padding);
  return absl::OkStatus();
}

// mlx-lm RotatingKVCache: the checks that make (keep, max_size, offset, _idx)
// and L held tokens a state its updates can reach (rotating_layer.h).
absl::Status CheckRotatingMeta(uint32_t layer, uint64_t keep, uint64_t max_size, uint64_t offset,
                               uint64_t idx, uint64_t held, const std::string& max_size_key,
                               const std::string& offset_key, const std::string& idx_key) {
  if (max_size == 0) return BadMeta(max_size_key, "max_size must be at least 1");
  if (keep >= max_size) {
    return BadMeta(Key(0, layer, 0),
                   absl::StrFormat("keep %d must be below max_size %d", keep, max_size));
  }
  if (held > offset) {
    return BadMeta(offset_key,
                   absl::StrFormat("offset %d is below the %d tokens held", offset, held));
  }
  if (held < offset && held < max_size) {
    return BadMeta(offset_key,
                   absl::StrFormat("offset %d with %d tokens held: tokens evicted before the "
                                   "window of %d filled",
                                   offset, held, max_size));
  }
  if (idx > held) {
    return BadMeta(idx_key, absl::StrFormat("_idx %d is past the buffer's %d tokens", idx, held));
  }
  if (idx < held && (held != max_size || idx <= keep || held == offset)) {
    return BadMeta(
        Key(0, layer, 3),
        absl::StrFormat("_idx %d inside a buffer of %d tokens that has not wrapped", idx, held));
  }
  return absl::OkStatus();
}

absl::Status ParseRotating(FileReader& reader, uint32_t layer, const SpecLimits& limits,
                           ParsedLayer& out) {
  ASSIGN_OR_RETURN(const auto kv, ParseKeysValues(reader, layer, out));
  ASSIGN_OR_RETURN(const uint64_t keep, reader.MetaNumber(Key(0, layer, 0), limits.max_window));
  ASSIGN_OR_RETURN(const uint64_t max_size, reader.MetaNumber(Key(0, layer, 1), limits.max_window));
  ASSIGN_OR_RETURN(const uint64_t offset, reader.MetaNumber(Key(0, layer, 2), kMaxOffset));
  ASSIGN_OR_RETURN(const uint64_t idx, reader.MetaNumber(Key(0, layer, 3), kMaxOffset));
  const uint64_t held = kv.first->shape[2];
  RETURN_IF_ERROR(CheckRotatingMeta(layer, keep, max_size, offset, idx, held, Key(0, layer, 1),
                                    Key(0, layer, 2), Key(0, layer, 3)));
  out.spec.kind = RotatingKind{.max_size = static_cast<uint32_t>(max_size),
                               .keep = static_cast<uint32_t>(keep)};
  out.offset = offset;
  out.offset_key = Key(0, layer, 2);
  // The ring buffer back in temporal order: [:keep] + [_idx:] + [keep:_idx].
  const uint64_t sinks = std::min(keep, offset);
  const auto temporal = [&](const FileTensor& tensor) {
    if (idx >= held) return TokenRuns(tensor, {{0, held}});
    return TokenRuns(tensor, {{0, sinks}, {idx, held - idx}, {sinks, idx - sinks}});
  };
  out.contents.held = {temporal(*kv.first), temporal(*kv.second), held};
  out.contents.ring_idx = idx;
  return absl::OkStatus();
}

// mlx-lm BatchRotatingKVCache (keep 0; mlx_state.h): the ring, offset[b] =
// _offset - padding[b], left_padding[b] = padding[b] - (_offset - L), and
// meta (max_size, _offset, _idx, rotated) with rotated "True" or "False".
// `rotated` agrees with the ring: a rotated one is full, and _idx lies inside
// the buffer only once it has rotated.
absl::Status CheckRotated(uint32_t layer, bool rotated, uint64_t held, uint64_t max_size,
                          uint64_t idx) {
  if (rotated && held != max_size) {
    return BadMeta(Key(0, layer, 3),
                   absl::StrFormat("rotated with %d tokens held; a rotated ring holds max_size %d",
                                   held, max_size));
  }
  if (!rotated && idx < held) {
    return BadMeta(
        Key(0, layer, 3),
        absl::StrFormat("not rotated, but _idx %d is inside the buffer of %d tokens", idx, held));
  }
  return absl::OkStatus();
}

// The cache's own left padding from offset[b] = _offset - padding[b], checked
// against the file's left_padding[b] = padding[b] - (_offset - held).
absl::StatusOr<std::vector<uint32_t>> BatchRotatingPadding(FileReader& reader, uint32_t layer,
                                                           uint64_t batch, uint64_t offset,
                                                           uint64_t held) {
  ASSIGN_OR_RETURN(const std::vector<int64_t> offsets, BatchArray(reader, Key(layer, 2), batch));
  ASSIGN_OR_RETURN(const std::vector<int64_t> paddings, BatchArray(reader, Key(layer, 3), batch));
  std::vector<uint32_t> left_padding;
  const int64_t evicted = static_cast<int64_t>(offset - held);
  for (uint64_t b = 0; b < batch; ++b) {
    const int64_t padding = static_cast<int64_t>(offset) - offsets[b];
    if (padding < 0 || padding > INT32_MAX) {
      return BadTensor(Key(layer, 2),
                       absl::StrFormat("offset[%d] %d is past _offset %d", b, offsets[b], offset));
    }
    if (paddings[b] != padding - evicted) {
      return BadTensor(Key(layer, 3),
                       absl::StrFormat("left_padding[%d] is %d, but padding %d less the %d "
                                       "evicted tokens is %d",
                                       b, paddings[b], padding, evicted, padding - evicted));
    }
    left_padding.push_back(static_cast<uint32_t>(padding));
  }
  return left_padding;
}

absl::Status ParseBatchRotating(FileReader& reader, uint32_t layer, const SpecLimits& limits,
                                ParsedLayer& out) {
  ASSIGN_OR_RETURN(const auto kv, ParseKeysValues(reader, layer, out));
  ASSIGN_OR_RETURN(const uint64_t max_size, reader.MetaNumber(Key(0, layer, 0), limits.max_window));
  ASSIGN_OR_RETURN(const uint64_t offset, reader.MetaNumber(Key(0, layer, 1), kMaxOffset));
  ASSIGN_OR_RETURN(const uint64_t idx, reader.MetaNumber(Key(0, layer, 2), kMaxOffset));
  ASSIGN_OR_RETURN(const std::string rotated_text, reader.Meta(Key(0, layer, 3)));
  const absl::StatusOr<bool> rotated = ParsePythonBool(rotated_text);
  if (!rotated.ok()) return BadMeta(Key(0, layer, 3), rotated.status().message());
  const uint64_t held = kv.first->shape[2];
  RETURN_IF_ERROR(CheckRotatingMeta(layer, 0, max_size, offset, idx, held, Key(0, layer, 0),
                                    Key(0, layer, 1), Key(0, layer, 2)));
  RETURN_IF_ERROR(CheckRotated(layer, *rotated, held, max_size, idx));
  ASSIGN_OR_RETURN(out.left_padding, BatchRotatingPadding(reader, layer, out.batch, offset, held));
  out.spec.kind = RotatingKind{.max_size = static_cast<uint32_t>(max_size), .keep = 0};
  out.offset = offset;
  out.offset_key = Key(0, layer, 1);
  const auto temporal = [&](const FileTensor& tensor) {
    if (idx >= held) return TokenRuns(tensor, {{0, held}});
    return TokenRuns(tensor, {{idx, held - idx}, {0, idx}});
  };
  out.contents.held = {temporal(*kv.first), temporal(*kv.second), held};
  out.contents.ring_idx = idx;
  return absl::OkStatus();
}

// mlx-lm ChunkedKVCache: loaded, offset = L; the held tokens are rows
// [0, L - start_position) (mlx_state.h).
absl::Status ParseChunked(FileReader& reader, uint32_t layer, const SpecLimits& limits,
                          ParsedLayer& out) {
  ASSIGN_OR_RETURN(const auto kv, ParseKeysValues(reader, layer, out));
  ASSIGN_OR_RETURN(const uint64_t chunk_size,
                   reader.MetaNumber(Key(0, layer, 0), limits.max_window));
  ASSIGN_OR_RETURN(const uint64_t start, reader.MetaNumber(Key(0, layer, 1), kMaxOffset));
  const uint64_t tokens = kv.first->shape[2];
  if (chunk_size == 0) return BadMeta(Key(0, layer, 0), "chunk_size must be at least 1");
  if (start > tokens) {
    return BadMeta(Key(0, layer, 1),
                   absl::StrFormat("start_position %d is past the offset %d (the tensors' length)",
                                   start, tokens));
  }
  out.spec.kind = ChunkedKind{.chunk_size = static_cast<uint32_t>(chunk_size)};
  out.offset = tokens;
  out.offset_key = Key(layer, 0);
  out.contents.held = {TokenRuns(*kv.first, {{0, tokens - start}}),
                       TokenRuns(*kv.second, {{0, tokens - start}}), tokens - start};
  out.contents.start_position = start;
  return absl::OkStatus();
}

// One side of a QuantizedKVCache: "<l>.<side>.{0,1,2}" = wq u32 [B,H,L,D*bits/32],
// scales and biases [B,H,L,D/group]; returns D.
absl::StatusOr<uint32_t> ParsePackedSide(FileReader& reader, uint32_t layer, int side,
                                         uint64_t group_size, uint64_t bits, ParsedLayer& out,
                                         PackedInput::Side& packed) {
  const std::string wq_key = Key(layer, side, 0), s_key = Key(layer, side, 1),
                    b_key = Key(layer, side, 2);
  ASSIGN_OR_RETURN(const FileTensor* wq, reader.Tensor(wq_key, 4));
  ASSIGN_OR_RETURN(const FileTensor* scales, reader.Tensor(s_key, 4));
  ASSIGN_OR_RETURN(const FileTensor* biases, reader.Tensor(b_key, 4));
  if (wq->dtype != FileDType::kU32) return BadTensor(wq_key, "dtype must be U32 (packed words)");
  if (side == 0) RETURN_IF_ERROR(TakeDType(s_key, *scales, out));
  const FileTensor& first_scales = *reader.Tensor(Key(layer, 0, 1), 4).value();
  if (scales->dtype != first_scales.dtype) return BadTensor(s_key, "dtype differs from keys'");
  if (biases->dtype != scales->dtype) return BadTensor(b_key, "dtype differs from the scales'");
  const FileTensor& first_wq = *reader.Tensor(Key(layer, 0, 0), 4).value();
  RETURN_IF_ERROR(SameLeading(Key(layer, 0, 0), first_wq, wq_key, *wq, 3));
  RETURN_IF_ERROR(SameLeading(wq_key, *wq, s_key, *scales, 3));
  const uint64_t dim = wq->shape[3] * 32 / bits;
  if (dim > UINT32_MAX || dim % group_size != 0 || scales->shape[3] != dim / group_size) {
    return BadTensor(s_key, absl::StrFormat("shape %s does not fit a head dim of %d (from \"%s\") "
                                            "in groups of %d",
                                            Shape(*scales), dim, wq_key, group_size));
  }
  RETURN_IF_ERROR(SameLeading(s_key, *scales, b_key, *biases, 4));
  packed = {wq->data, scales->data, biases->data};
  return static_cast<uint32_t>(dim);
}

absl::Status ParseQuantized(FileReader& reader, uint32_t layer, ParsedLayer& out) {
  ASSIGN_OR_RETURN(const uint64_t offset, reader.MetaNumber(Key(0, layer, 0), kMaxOffset));
  ASSIGN_OR_RETURN(const uint64_t group_size, reader.MetaNumber(Key(0, layer, 1), 1024));
  ASSIGN_OR_RETURN(const uint64_t bits, reader.MetaNumber(Key(0, layer, 2), 64));
  if (bits != 4 && bits != 8) return BadMeta(Key(0, layer, 2), "bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    return BadMeta(Key(0, layer, 1), "group_size must be 32, 64 or 128");
  }
  ASSIGN_OR_RETURN(out.spec.k_head_dim,
                   ParsePackedSide(reader, layer, 0, group_size, bits, out, out.packed.keys));
  ASSIGN_OR_RETURN(out.spec.v_head_dim,
                   ParsePackedSide(reader, layer, 1, group_size, bits, out, out.packed.values));
  const FileTensor& wq = *reader.Tensor(Key(layer, 0, 0), 4).value();
  if (wq.shape[2] != offset) {
    return BadMeta(Key(0, layer, 0), absl::StrFormat("offset %d, but the tensors hold %d tokens",
                                                     offset, wq.shape[2]));
  }
  out.spec.num_kv_heads = static_cast<uint32_t>(wq.shape[1]);
  out.spec.kind = QuantizedKind{.group_size = static_cast<uint32_t>(group_size),
                                .bits = static_cast<uint32_t>(bits)};
  out.offset = offset;
  out.offset_key = Key(0, layer, 0);
  out.contents.packed_tokens = offset;
  return absl::OkStatus();
}

// ArraysCache of a gated-delta / Mamba layer: conv [B, conv_tail, conv_dim]
// and delta [B, Hv, Dv, Dk].
absl::Status ParseArrays(FileReader& reader, uint32_t layer, ParsedLayer& out) {
  RETURN_IF_ERROR(reader.NoMeta(layer, out.mlx_class));
  const std::string c_key = Key(layer, 0), d_key = Key(layer, 1);
  ASSIGN_OR_RETURN(const FileTensor* conv, reader.Tensor(c_key, 3));
  ASSIGN_OR_RETURN(const FileTensor* delta, reader.Tensor(d_key, 4));
  RETURN_IF_ERROR(TakeDType(c_key, *conv, out));
  if (delta->dtype != conv->dtype) return BadTensor(d_key, "dtype differs from the conv state's");
  RETURN_IF_ERROR(SameLeading(c_key, *conv, d_key, *delta, 1));
  for (uint64_t dim : delta->shape) {
    if (dim > UINT32_MAX) return BadTensor(d_key, "dimension too large");
  }
  out.spec.kind = RecurrentKind{.conv_tail = static_cast<uint32_t>(conv->shape[1]),
                                .conv_dim = static_cast<uint32_t>(conv->shape[2]),
                                .num_v_heads = static_cast<uint32_t>(delta->shape[1]),
                                .head_v_dim = static_cast<uint32_t>(delta->shape[2]),
                                .head_k_dim = static_cast<uint32_t>(delta->shape[3])};
  out.state = {.conv = conv->data, .delta = delta->data};
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ParsedLayer> ParseLayer(FileReader& reader, uint32_t layer,
                                       const SpecLimits& limits) {
  ParsedLayer out;
  ASSIGN_OR_RETURN(out.mlx_class, reader.Meta(Key(2, layer)));
  const std::string& name = out.mlx_class;
  if (name == "KVCache" || name == "ConcatenateKVCache") {
    RETURN_IF_ERROR(ParseStandard(reader, layer, out));
  } else if (name == "BatchKVCache") {
    RETURN_IF_ERROR(ParseBatch(reader, layer, out));
  } else if (name == "RotatingKVCache") {
    RETURN_IF_ERROR(ParseRotating(reader, layer, limits, out));
  } else if (name == "QuantizedKVCache") {
    RETURN_IF_ERROR(ParseQuantized(reader, layer, out));
  } else if (name == "ChunkedKVCache") {
    RETURN_IF_ERROR(ParseChunked(reader, layer, limits, out));
  } else if (name == "ArraysCache") {
    RETURN_IF_ERROR(ParseArrays(reader, layer, out));
  } else if (name == "BatchRotatingKVCache") {
    RETURN_IF_ERROR(ParseBatchRotating(reader, layer, limits, out));
  } else if (name == "CacheList") {
    return absl::FailedPreconditionError(absl::StrFormat(
        "metadata \"%s\": loading a %s layer is not supported", Key(2, layer), name));
  } else {
    return BadMeta(Key(2, layer), absl::StrCat("unknown cache class ", Quoted(name), ""));
  }
  return out;
}

}  // namespace kvcache::engine::mlx_file
