// ToPromptCache: each layer kind's mlx-lm `state` and `meta_state` (mlx_state.h).
#include <algorithm>
#include <cstring>
#include <variant>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "engine/files/mlx_batch_meta.h"
#include "engine/files/mlx_file_util.h"
#include "engine/files/mlx_state.h"
#include "engine/layers/chunked_layer.h"
#include "engine/layers/recurrent_layer.h"
#include "engine/layers/rotating_layer.h"

namespace kvcache::engine {
namespace {

using mlx_file::Key;
using mlx_file::MakeTensor;

// Dims of one attention layer, for sizing [B, H, L, D] buffers.
struct KvDims {
  uint64_t batch = 1;
  uint64_t heads = 1;
  uint64_t k_dim = 1;
  uint64_t v_dim = 1;
  uint64_t elem = 2;

  uint64_t k_token() const { return k_dim * elem; }
  uint64_t v_token() const { return v_dim * elem; }
  uint64_t row_heads() const { return batch * heads; }
};

KvDims DimsOf(const CacheSpec& spec, uint32_t layer) {
  const LayerSpec& l = spec.layers[layer];
  return {.batch = spec.batch_size,
          .heads = l.num_kv_heads,
          .k_dim = l.k_head_dim,
          .v_dim = l.v_head_dim == 0 ? l.k_head_dim : l.v_head_dim,
          .elem = DTypeSize(spec.dtype)};
}

// A layer's tokens as [B, H, L, D] keys and values.
struct KvRows {
  std::vector<std::byte> keys;
  std::vector<std::byte> values;
  uint64_t tokens = 0;
};

// Copies token `from` of every row-head of `source` (holding source_tokens)
// to token `to` of `target` (holding target_tokens), `count` tokens on.
void CopyTokens(const std::vector<std::byte>& source, uint64_t source_tokens, uint64_t from,
                std::vector<std::byte>& target, uint64_t target_tokens, uint64_t to, uint64_t count,
                uint64_t token_bytes, uint64_t row_heads) {
  for (uint64_t rh = 0; rh < row_heads; ++rh) {
    std::memcpy(target.data() + (rh * target_tokens + to) * token_bytes,
                source.data() + (rh * source_tokens + from) * token_bytes, count * token_bytes);
  }
}

// The layer's held tokens in temporal order (its Ranges(), concatenated),
// with room for `total` >= held tokens (the rest zeros).
absl::StatusOr<KvRows> ReadHeldTokens(const CacheSnapshot& snapshot, uint32_t layer,
                                      uint64_t total) {
  const KvDims d = DimsOf(snapshot.spec, layer);
  KvRows rows{.keys = std::vector<std::byte>(total * d.row_heads() * d.k_token()),
              .values = std::vector<std::byte>(total * d.row_heads() * d.v_token()),
              .tokens = total};
  uint64_t at = 0;
  for (const TokenRange& range : snapshot.Ranges(layer, {0, snapshot.to})) {
    std::vector<std::byte> keys(range.size() * d.row_heads() * d.k_token());
    std::vector<std::byte> values(range.size() * d.row_heads() * d.v_token());
    RETURN_IF_ERROR(snapshot.Read(layer, range, {absl::MakeSpan(keys), absl::MakeSpan(values)}));
    CopyTokens(keys, range.size(), 0, rows.keys, total, at, range.size(), d.k_token(),
               d.row_heads());
    CopyTokens(values, range.size(), 0, rows.values, total, at, range.size(), d.v_token(),
               d.row_heads());
    at += range.size();
  }
  return rows;
}

uint64_t HeldTokens(const CacheSnapshot& snapshot, uint32_t layer) {
  uint64_t held = 0;
  for (const TokenRange& range : snapshot.Ranges(layer, {0, snapshot.to})) held += range.size();
  return held;
}

void PutKv(PromptCacheFile& file, const CacheSnapshot& snapshot, uint32_t layer, KvRows rows) {
  const KvDims d = DimsOf(snapshot.spec, layer);
  const FileDType dtype = mlx_file::ToFileDType(snapshot.spec.dtype);
  file.tensors[Key(layer, 0)] =
      MakeTensor(dtype, {d.batch, d.heads, rows.tokens, d.k_dim}, std::move(rows.keys));
  file.tensors[Key(layer, 1)] =
      MakeTensor(dtype, {d.batch, d.heads, rows.tokens, d.v_dim}, std::move(rows.values));
}

std::vector<std::byte> Int32Bytes(const std::vector<int64_t>& values) {
  std::vector<std::byte> bytes(values.size() * 4);
  for (size_t i = 0; i < values.size(); ++i) {
    const auto value = static_cast<int32_t>(values[i]);
    std::memcpy(bytes.data() + i * 4, &value, 4);  // little-endian hosts only
  }
  return bytes;
}

absl::Status ExportStandard(const CacheSnapshot& snapshot, uint32_t layer, PromptCacheFile& file) {
  ASSIGN_OR_RETURN(KvRows rows, ReadHeldTokens(snapshot, layer, snapshot.to));
  PutKv(file, snapshot, layer, std::move(rows));
  const std::vector<uint32_t>& padding = snapshot.spec.left_padding;
  if (padding.empty()) {
    file.metadata[Key(2, layer)] = "KVCache";
    file.metadata[Key(0, layer)] = "";
    return absl::OkStatus();
  }
  std::vector<int64_t> offsets, paddings;
  for (uint32_t pad : padding) {
    offsets.push_back(static_cast<int64_t>(snapshot.to) - pad);
    paddings.push_back(pad);
  }
  const uint64_t batch = snapshot.spec.batch_size;
  file.tensors[Key(layer, 2)] = MakeTensor(FileDType::kI32, {batch}, Int32Bytes(offsets));
  file.tensors[Key(layer, 3)] = MakeTensor(FileDType::kI32, {batch}, Int32Bytes(paddings));
  file.metadata[Key(2, layer)] = "BatchKVCache";
  file.metadata[Key(0, layer)] = "";
  return absl::OkStatus();
}

// Temporal order -> mlx-lm's ring buffer: with L held and _idx < L, buffer
// slot j holds temporal token j (j < keep), j + L - _idx (keep <= j < _idx),
// keep + j - _idx (j >= _idx).
KvRows RingOrder(const KvDims& d, const KvRows& temporal, uint64_t keep, uint64_t idx) {
  const uint64_t held = temporal.tokens;
  if (idx >= held) return temporal;
  KvRows ring{.keys = std::vector<std::byte>(temporal.keys.size()),
              .values = std::vector<std::byte>(temporal.values.size()),
              .tokens = held};
  const auto move = [&](uint64_t from, uint64_t to, uint64_t count) {
    CopyTokens(temporal.keys, held, from, ring.keys, held, to, count, d.k_token(), d.row_heads());
    CopyTokens(temporal.values, held, from, ring.values, held, to, count, d.v_token(),
               d.row_heads());
  };
  move(0, 0, keep);
  move(keep + held - idx, keep, idx - keep);
  move(keep, idx, held - idx);
  return ring;
}

// mlx-lm BatchRotatingKVCache (keep 0): offset[b] = _offset - padding[b] as
// the cache was made; left_padding[b] shrinks by each token evicted from the
// front (padding first), so it is padding[b] - (_offset - held) and may go
// negative. `rotated` is set by a single-token update that wraps the ring and
// cleared by a multi-token one: so exactly when a full ring has evicted.
void PutBatchRotatingState(const CacheSnapshot& snapshot, uint32_t layer, const RotatingKind& kind,
                           const RotatingState& state, uint64_t held, PromptCacheFile& file) {
  std::vector<int64_t> offsets, paddings;
  for (uint32_t pad : snapshot.spec.left_padding) {
    offsets.push_back(static_cast<int64_t>(state.offset) - pad);
    paddings.push_back(static_cast<int64_t>(pad) - static_cast<int64_t>(state.offset - held));
  }
  const uint64_t batch = snapshot.spec.batch_size;
  file.tensors[Key(layer, 2)] = MakeTensor(FileDType::kI32, {batch}, Int32Bytes(offsets));
  file.tensors[Key(layer, 3)] = MakeTensor(FileDType::kI32, {batch}, Int32Bytes(paddings));
  file.metadata[Key(2, layer)] = "BatchRotatingKVCache";
  const BatchRotatingMeta meta{.max_size = kind.max_size,
                               .offset = state.offset,
                               .idx = state.ring_idx,
                               .rotated = held == kind.max_size && state.offset > held};
  const std::vector<std::string> meta_state = BatchRotatingMetaState(meta);
  for (size_t i = 0; i < meta_state.size(); ++i) file.metadata[Key(0, layer, i)] = meta_state[i];
}

absl::Status ExportRotating(const CacheSnapshot& snapshot, uint32_t layer, const RotatingKind& kind,
                            PromptCacheFile& file) {
  const auto* rotating = dynamic_cast<const RotatingSnapshot*>(snapshot.layers[layer].get());
  if (rotating == nullptr) {
    return absl::InternalError("a rotating layer's snapshot is not rotating");
  }
  const RotatingState& state = rotating->state();
  ASSIGN_OR_RETURN(KvRows temporal, ReadHeldTokens(snapshot, layer, HeldTokens(snapshot, layer)));
  const uint64_t held = temporal.tokens;
  const uint64_t sinks = state.sink_end(kind.keep);
  PutKv(file, snapshot, layer,
        RingOrder(DimsOf(snapshot.spec, layer), temporal, sinks, state.ring_idx));
  if (!snapshot.spec.left_padding.empty()) {
    PutBatchRotatingState(snapshot, layer, kind, state, held, file);
    return absl::OkStatus();
  }
  file.metadata[Key(2, layer)] = "RotatingKVCache";
  const uint64_t meta[] = {kind.keep, kind.max_size, state.offset, state.ring_idx};
  for (int i = 0; i < 4; ++i) file.metadata[Key(0, layer, i)] = absl::StrCat(meta[i]);
  return absl::OkStatus();
}

absl::Status ExportQuantized(const CacheSnapshot& snapshot, uint32_t layer,
                             const QuantizedKind& kind, PromptCacheFile& file) {
  const KvDims d = DimsOf(snapshot.spec, layer);
  const uint64_t rows = d.row_heads() * snapshot.to;
  const FileDType dtype = mlx_file::ToFileDType(snapshot.spec.dtype);
  std::vector<std::byte> planes[2][3];
  PackedOutput out;
  PackedOutput::Side* sides[2] = {&out.keys, &out.values};
  for (int side = 0; side < 2; ++side) {
    const uint64_t dim = side == 0 ? d.k_dim : d.v_dim;
    planes[side][0].resize(rows * dim * kind.bits / 8);
    planes[side][1].resize(rows * dim / kind.group_size * d.elem);
    planes[side][2].resize(rows * dim / kind.group_size * d.elem);
    *sides[side] = {absl::MakeSpan(planes[side][0]), absl::MakeSpan(planes[side][1]),
                    absl::MakeSpan(planes[side][2])};
  }
  RETURN_IF_ERROR(snapshot.ReadPacked(layer, {0, snapshot.to}, out));
  for (int side = 0; side < 2; ++side) {
    const uint64_t dim = side == 0 ? d.k_dim : d.v_dim;
    const std::vector<uint64_t> prefix = {d.batch, d.heads, snapshot.to};
    file.tensors[Key(layer, side, 0)] =
        MakeTensor(FileDType::kU32, {d.batch, d.heads, snapshot.to, dim * kind.bits / 32},
                   std::move(planes[side][0]));
    for (int j = 1; j < 3; ++j) {
      file.tensors[Key(layer, side, j)] =
          MakeTensor(dtype, {d.batch, d.heads, snapshot.to, dim / kind.group_size},
                     std::move(planes[side][j]));
    }
  }
  file.metadata[Key(2, layer)] = "QuantizedKVCache";
  const uint64_t meta[] = {snapshot.to, kind.group_size, kind.bits};
  for (int i = 0; i < 3; ++i) file.metadata[Key(0, layer, i)] = absl::StrCat(meta[i]);
  return absl::OkStatus();
}

absl::Status ExportChunked(const CacheSnapshot& snapshot, uint32_t layer, const ChunkedKind& kind,
                           PromptCacheFile& file) {
  const auto* chunked = dynamic_cast<const ChunkedSnapshot*>(snapshot.layers[layer].get());
  if (chunked == nullptr) return absl::InternalError("a chunked layer's snapshot is not chunked");
  // `offset` rows: the held tokens, then start_position rows of zeros (mlx_state.h).
  ASSIGN_OR_RETURN(KvRows rows, ReadHeldTokens(snapshot, layer, snapshot.to));
  PutKv(file, snapshot, layer, std::move(rows));
  file.metadata[Key(2, layer)] = "ChunkedKVCache";
  file.metadata[Key(0, layer, 0)] = absl::StrCat(kind.chunk_size);
  file.metadata[Key(0, layer, 1)] = absl::StrCat(chunked->start_position());
  return absl::OkStatus();
}

absl::Status ExportRecurrent(const CacheSnapshot& snapshot, uint32_t layer,
                             const RecurrentKind& kind, PromptCacheFile& file) {
  const auto* recurrent = dynamic_cast<const RecurrentSnapshot*>(snapshot.layers[layer].get());
  if (recurrent == nullptr) {
    return absl::InternalError("a recurrent layer's snapshot is not recurrent");
  }
  if (recurrent->pages().CountPages() == 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "layer %d: a recurrent layer with no state yet; mlx-lm cannot save an ArraysCache "
        "holding None",
        layer));
  }
  const uint64_t batch = snapshot.spec.batch_size;
  std::vector<std::byte> conv(recurrent->geometry().conv_bytes());
  std::vector<std::byte> delta(recurrent->geometry().delta_bytes());
  RETURN_IF_ERROR(snapshot.ReadState(layer, {absl::MakeSpan(conv), absl::MakeSpan(delta)}));
  const FileDType dtype = mlx_file::ToFileDType(snapshot.spec.dtype);
  file.tensors[Key(layer, 0)] =
      MakeTensor(dtype, {batch, kind.conv_tail, kind.conv_dim}, std::move(conv));
  file.tensors[Key(layer, 1)] = MakeTensor(
      dtype, {batch, kind.num_v_heads, kind.head_v_dim, kind.head_k_dim}, std::move(delta));
  file.metadata[Key(2, layer)] = "ArraysCache";
  file.metadata[Key(0, layer)] = "";
  return absl::OkStatus();
}

absl::Status NoBatchForm(uint32_t layer, const char* mlx_class) {
  return absl::FailedPreconditionError(absl::StrFormat(
      "layer %d: mlx-lm has no batch form of %s for a cache with left_padding", layer, mlx_class));
}

absl::Status ExportLayer(const CacheSnapshot& snapshot, uint32_t layer, PromptCacheFile& file) {
  const bool padded = !snapshot.spec.left_padding.empty();
  return std::visit(
      [&](const auto& kind) -> absl::Status {
        using Kind = std::decay_t<decltype(kind)>;
        if constexpr (std::is_same_v<Kind, StandardKind>) {
          return ExportStandard(snapshot, layer, file);
        } else if constexpr (std::is_same_v<Kind, RotatingKind>) {
          return ExportRotating(snapshot, layer, kind, file);
        } else if constexpr (std::is_same_v<Kind, QuantizedKind>) {
          if (padded) return NoBatchForm(layer, "QuantizedKVCache");
          return ExportQuantized(snapshot, layer, kind, file);
        } else if constexpr (std::is_same_v<Kind, ChunkedKind>) {
          if (padded) return NoBatchForm(layer, "ChunkedKVCache");
          return ExportChunked(snapshot, layer, kind, file);
        } else {
          return ExportRecurrent(snapshot, layer, kind, file);
        }
      },
      snapshot.spec.layers[layer].kind);
}

}  // namespace

absl::StatusOr<PromptCacheFile> ToPromptCache(
    const CacheSnapshot& snapshot, const std::map<std::string, std::string>& user_metadata) {
  if (snapshot.from != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the snapshot starts at %d; a prompt-cache file holds a whole cache, from 0",
        snapshot.from));
  }
  PromptCacheFile file;
  for (uint32_t layer = 0; layer < snapshot.layers.size(); ++layer) {
    if (snapshot.layers[layer] == nullptr || snapshot.layers[layer]->to() == 0) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "layer %d holds nothing; mlx-lm cannot save an empty cache layer", layer));
    }
    RETURN_IF_ERROR(ExportLayer(snapshot, layer, file));
  }
  for (const auto& [key, value] : user_metadata) {
    if (key.empty()) return absl::InvalidArgumentError("metadata: an empty key");
    file.metadata[Key(1, key)] = value;
  }
  if (!snapshot.spec.model.empty() && user_metadata.count("model") == 0) {
    file.metadata[Key(1, "model")] = snapshot.spec.model;
  }
  return file;
}

}  // namespace kvcache::engine
