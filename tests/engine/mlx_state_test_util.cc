#include "mlx_state_test_util.h"

#include <algorithm>
#include <cstring>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "chunked_recurrent_test_util.h"
#include "engine_test_util.h"

namespace kvcache::testing {
namespace {

using engine::CacheSnapshot;
using engine::FileDType;
using engine::PromptCacheFile;

std::vector<int64_t> Slice(const std::vector<int64_t>& v, uint64_t begin, uint64_t end) {
  begin = std::min<uint64_t>(begin, v.size());
  end = std::min<uint64_t>(std::max(begin, end), v.size());
  return std::vector<int64_t>(v.begin() + begin, v.begin() + end);
}

void AppendAll(std::vector<int64_t>& to, const std::vector<int64_t>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

std::vector<int64_t> Iota(uint64_t begin, uint64_t end) {
  std::vector<int64_t> positions;
  for (uint64_t p = begin; p < end; ++p) positions.push_back(static_cast<int64_t>(p));
  return positions;
}

FileDType FileDTypeOf(DType dtype) {
  return dtype == DType::kFloat32    ? FileDType::kF32
         : dtype == DType::kBFloat16 ? FileDType::kBF16
                                     : FileDType::kF16;
}

std::vector<std::byte> Int32s(const std::vector<int64_t>& values) {
  std::vector<std::byte> bytes(values.size() * 4);
  for (size_t i = 0; i < values.size(); ++i) {
    const auto value = static_cast<int32_t>(values[i]);
    std::memcpy(bytes.data() + 4 * i, &value, 4);
  }
  return bytes;
}

::testing::AssertionResult MetaIs(const PromptCacheFile& file, const std::string& key,
                                  const std::string& value) {
  const auto it = file.metadata.find(key);
  if (it == file.metadata.end()) return ::testing::AssertionFailure() << "no metadata " << key;
  if (it->second != value) {
    return ::testing::AssertionFailure()
           << "metadata " << key << " is \"" << it->second << "\", expected \"" << value << "\"";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult MetaNumbers(const PromptCacheFile& file, uint32_t layer,
                                       const std::vector<uint64_t>& values) {
  for (size_t i = 0; i < values.size(); ++i) {
    auto result = MetaIs(file, absl::StrCat("0.", layer, ".", i), absl::StrCat(values[i]));
    if (!result) return result;
  }
  return ::testing::AssertionSuccess();
}

// The quantized planes of `view`'s layer as stored: {K wq, K scales, K biases, V ...}.
std::vector<std::vector<std::byte>> PackedPlanes(const CacheSnapshot& view, uint32_t layer) {
  const auto& kind = std::get<engine::QuantizedKind>(view.spec.layers[layer].kind);
  const RefShape shape = ShapeOf(view.spec, layer);
  const uint64_t rows = uint64_t{shape.batch} * shape.heads * view.to;
  std::vector<std::vector<std::byte>> planes(6);
  for (int side = 0; side < 2; ++side) {
    const uint64_t dim = side == 0 ? shape.k_dim : shape.v_dim;
    planes[3 * side].resize(rows * dim * kind.bits / 8);
    planes[3 * side + 1].resize(rows * dim / kind.group_size * shape.elem_bytes);
    planes[3 * side + 2].resize(rows * dim / kind.group_size * shape.elem_bytes);
  }
  engine::PackedOutput out{
      .keys = {absl::MakeSpan(planes[0]), absl::MakeSpan(planes[1]), absl::MakeSpan(planes[2])},
      .values = {absl::MakeSpan(planes[3]), absl::MakeSpan(planes[4]), absl::MakeSpan(planes[5])}};
  EXPECT_TRUE(view.ReadPacked(layer, {0, view.to}, out).ok());
  return planes;
}

}  // namespace

void MlxRotatingModel::Update(uint64_t tokens) {
  if (tokens == 1) {
    UpdateInPlace();
  } else {
    UpdateConcat(tokens);
  }
}

void MlxRotatingModel::Trim(uint64_t n) {
  n = std::min(n, offset_);
  offset_ -= n;
  idx_ -= n;
}

std::vector<int64_t> MlxRotatingModel::State() const {
  return offset_ < buffer_.size() ? Slice(buffer_, 0, offset_) : buffer_;
}

std::vector<int64_t> MlxRotatingModel::TemporalOrder() const {
  if (idx_ == buffer_.size()) return buffer_;
  if (idx_ < offset_) {
    std::vector<int64_t> order = Slice(buffer_, 0, keep_);
    AppendAll(order, Slice(buffer_, idx_, buffer_.size()));
    AppendAll(order, Slice(buffer_, keep_, idx_));
    return order;
  }
  return Slice(buffer_, 0, idx_);
}

std::vector<int64_t> MlxRotatingModel::TrimFront(int64_t trim_size, const std::vector<int64_t>& v,
                                                 const std::vector<int64_t>& append) const {
  std::vector<int64_t> out = v;
  if (trim_size > 0) {
    out = Slice(v, 0, keep_);
    AppendAll(out, Slice(v, static_cast<uint64_t>(trim_size) + keep_, v.size()));
  }
  AppendAll(out, append);
  return out;
}

void MlxRotatingModel::UpdateConcat(uint64_t tokens) {
  const std::vector<int64_t> fresh = Iota(offset_, offset_ + tokens);
  rotated_ = false;
  if (empty_) {
    buffer_ = fresh;
  } else {
    buffer_ = TemporalOrder();
    idx_ = buffer_.size();
    const int64_t trim_size = static_cast<int64_t>(idx_) - static_cast<int64_t>(max_size_) + 1;
    buffer_ = TrimFront(trim_size, buffer_, fresh);
  }
  empty_ = false;
  offset_ += tokens;
  idx_ = buffer_.size();
}

void MlxRotatingModel::UpdateInPlace() {
  const uint64_t prev = offset_;
  if (empty_ || (prev >= buffer_.size() && buffer_.size() < max_size_)) {
    const uint64_t new_size = std::min<uint64_t>(256, max_size_ - prev);
    buffer_.insert(buffer_.end(), new_size, -1);
    idx_ = prev;
    empty_ = false;
  }
  const int64_t trim_size = static_cast<int64_t>(buffer_.size()) - static_cast<int64_t>(max_size_);
  if (trim_size > 0) {
    buffer_ = TrimFront(trim_size, buffer_, {});
    idx_ = max_size_;
  }
  if (idx_ == max_size_) {
    idx_ = keep_;
    rotated_ = true;
  }
  buffer_[idx_] = static_cast<int64_t>(offset_);
  offset_ += 1;
  idx_ += 1;
}

void TokenHistory::Write(uint64_t offset, const std::vector<std::byte>& keys,
                         const std::vector<std::byte>& values, uint64_t tokens) {
  const uint64_t row_heads = uint64_t{shape_.batch} * shape_.heads;
  if (keys_.size() < offset + tokens) {
    keys_.resize(offset + tokens);
    values_.resize(offset + tokens);
  }
  for (uint64_t t = 0; t < tokens; ++t) {
    keys_[offset + t].clear();
    values_[offset + t].clear();
    for (uint64_t rh = 0; rh < row_heads; ++rh) {
      const auto k = keys.begin() + (rh * tokens + t) * shape_.KRowBytes();
      keys_[offset + t].insert(keys_[offset + t].end(), k, k + shape_.KRowBytes());
      const auto v = values.begin() + (rh * tokens + t) * shape_.VRowBytes();
      values_[offset + t].insert(values_[offset + t].end(), v, v + shape_.VRowBytes());
    }
  }
}

std::vector<std::byte> TokenHistory::Gather(const std::vector<int64_t>& positions,
                                            bool values) const {
  const uint64_t row = values ? shape_.VRowBytes() : shape_.KRowBytes();
  const auto& source = values ? values_ : keys_;
  const uint64_t row_heads = uint64_t{shape_.batch} * shape_.heads;
  std::vector<std::byte> out(row_heads * positions.size() * row);
  for (uint64_t rh = 0; rh < row_heads; ++rh) {
    for (size_t j = 0; j < positions.size(); ++j) {
      if (positions[j] < 0) continue;
      std::memcpy(out.data() + (rh * positions.size() + j) * row,
                  source[positions[j]].data() + rh * row, row);
    }
  }
  return out;
}

MlxMirror::MlxMirror(engine::Engine& engine, const engine::CacheSpec& spec, uint64_t seed)
    : engine_(engine), spec_(spec), rng_(seed) {
  absl::StatusOr<engine::CacheInfo> info = engine_.CreateCache(spec);
  EXPECT_TRUE(info.ok()) << info.status();
  if (info.ok()) id_ = info->cache_id;
  for (size_t layer = 0; layer < spec.layers.size(); ++layer) {
    history_.emplace_back(IsRecurrent(spec.layers[layer]) ? RefShape{} : ShapeOf(spec, layer));
    const auto* rotating = std::get_if<engine::RotatingKind>(&spec.layers[layer].kind);
    rotating_.push_back(rotating == nullptr ? std::nullopt
                                            : std::optional<MlxRotatingModel>(MlxRotatingModel(
                                                  rotating->max_size, rotating->keep)));
  }
  chunk_start_.assign(spec.layers.size(), 0);
  states_.resize(spec.layers.size());
}

::testing::AssertionResult MlxMirror::Step(uint64_t tokens) {
  for (uint32_t layer = 0; layer < spec_.layers.size(); ++layer) {
    if (IsRecurrent(spec_.layers[layer])) {
      RefState state = RandomState(spec_, layer, rng_);
      auto updated = engine_.UpdateState(id_, layer, StateInputOf(state, tokens));
      if (!updated.ok()) return ::testing::AssertionFailure() << updated.status();
      states_[layer] = std::move(state);
      continue;
    }
    const KvTensors kv = RandomKv(spec_, layer, tokens, rng_);
    auto updated = engine_.Update(id_, layer, kv.input());
    if (!updated.ok()) return ::testing::AssertionFailure() << updated.status();
    history_[layer].Write(offset_, kv.keys, kv.values, tokens);
    if (rotating_[layer].has_value()) rotating_[layer]->Update(tokens);
    // chunked_layer.h: before an update the front is trimmed to chunk_size.
    if (const auto* chunked = std::get_if<engine::ChunkedKind>(&spec_.layers[layer].kind)) {
      const uint64_t held = offset_ - chunk_start_[layer];
      if (held >= chunked->chunk_size) chunk_start_[layer] += held - chunked->chunk_size;
    }
  }
  offset_ += tokens;
  return ::testing::AssertionSuccess();
}

absl::StatusOr<uint64_t> MlxMirror::Trim(uint64_t n) {
  absl::StatusOr<uint64_t> trimmed = engine_.Trim(id_, n);
  if (!trimmed.ok()) return trimmed;
  offset_ -= *trimmed;
  for (auto& rotating : rotating_) {
    if (rotating.has_value()) rotating->Trim(*trimmed);
  }
  return trimmed;
}

::testing::AssertionResult MlxMirror::FileMatches(const PromptCacheFile& file,
                                                  const CacheSnapshot& view) const {
  size_t tensors = 0, metadata = 0;
  for (uint32_t layer = 0; layer < spec_.layers.size(); ++layer) {
    if (auto result = LayerMatches(file, view, layer); !result) {
      return result << " (layer " << layer << ")";
    }
    const auto& kind = spec_.layers[layer].kind;
    const bool padded = !spec_.left_padding.empty();
    tensors += std::holds_alternative<engine::QuantizedKind>(kind) ? 6
               : padded && !std::holds_alternative<engine::ChunkedKind>(kind) &&
                       !IsRecurrent(spec_.layers[layer])
                   ? 4
                   : 2;
    metadata += 1 + (std::holds_alternative<engine::RotatingKind>(kind)    ? 4
                     : std::holds_alternative<engine::QuantizedKind>(kind) ? 3
                     : std::holds_alternative<engine::ChunkedKind>(kind)   ? 2
                                                                           : 1);
  }
  const size_t files_meta = std::count_if(file.metadata.begin(), file.metadata.end(),
                                          [](const auto& kv) { return kv.first[0] != '1'; });
  if (file.tensors.size() != tensors || files_meta != metadata) {
    return ::testing::AssertionFailure()
           << file.tensors.size() << " tensors and " << files_meta
           << " layer metadata entries, expected " << tensors << " and " << metadata;
  }
  return MetaIs(file, "1.model", spec_.model);
}

template <typename KvMatch>
::testing::AssertionResult MlxMirror::BatchRotatingMatches(const PromptCacheFile& file,
                                                           uint32_t layer,
                                                           const MlxRotatingModel& model,
                                                           const KvMatch& kv_match) const {
  const std::string at = absl::StrCat(layer);
  const std::vector<int64_t> ring = model.State();
  // mlx-lm decrements left_padding by every token evicted from the front.
  const int64_t evicted = static_cast<int64_t>(model.offset() - ring.size());
  std::vector<int64_t> offsets, paddings;
  for (uint32_t pad : spec_.left_padding) {
    offsets.push_back(static_cast<int64_t>(model.offset()) - pad);
    paddings.push_back(static_cast<int64_t>(pad) - evicted);
  }
  const std::vector<std::byte> offset_bytes = Int32s(offsets), padding_bytes = Int32s(paddings);
  const uint64_t batch = spec_.batch_size;
  if (auto r = MetaIs(file, "2." + at, "BatchRotatingKVCache"); !r) return r;
  const auto& kind = std::get<engine::RotatingKind>(spec_.layers[layer].kind);
  if (auto r = MetaNumbers(file, layer, {kind.max_size, model.offset(), model.idx()}); !r) return r;
  if (auto r = MetaIs(file, "0." + at + ".3", model.rotated() ? "True" : "False"); !r) return r;
  if (auto r = TensorIs(file, at + ".2", FileDType::kI32, {batch}, &offset_bytes); !r) return r;
  if (auto r = TensorIs(file, at + ".3", FileDType::kI32, {batch}, &padding_bytes); !r) return r;
  return kv_match(ring);
}

::testing::AssertionResult MlxMirror::LayerMatches(const PromptCacheFile& file,
                                                   const CacheSnapshot& view,
                                                   uint32_t layer) const {
  const engine::LayerSpec& spec = spec_.layers[layer];
  const FileDType dtype = FileDTypeOf(spec_.dtype);
  const uint64_t batch = spec_.batch_size, heads = spec.num_kv_heads;
  const std::string at = absl::StrCat(layer);
  const RefShape dims = IsRecurrent(spec) ? RefShape{} : ShapeOf(spec_, layer);
  const auto kv_match = [&](const std::vector<int64_t>& positions) {
    const std::vector<std::byte> keys = history_[layer].Gather(positions, false);
    const std::vector<std::byte> values = history_[layer].Gather(positions, true);
    const uint64_t length = positions.size();
    auto result = TensorIs(file, at + ".0", dtype, {batch, heads, length, dims.k_dim}, &keys);
    if (!result) return result;
    return TensorIs(file, at + ".1", dtype, {batch, heads, length, dims.v_dim}, &values);
  };
  if (std::holds_alternative<engine::StandardKind>(spec.kind)) {
    if (spec_.left_padding.empty()) {
      if (auto r = MetaIs(file, "2." + at, "KVCache"); !r) return r;
      if (auto r = MetaIs(file, "0." + at, ""); !r) return r;
      return kv_match(Iota(0, offset_));
    }
    std::vector<int64_t> offsets, paddings;
    for (uint32_t pad : spec_.left_padding) {
      offsets.push_back(static_cast<int64_t>(offset_) - pad);
      paddings.push_back(pad);
    }
    const std::vector<std::byte> offset_bytes = Int32s(offsets), padding_bytes = Int32s(paddings);
    if (auto r = MetaIs(file, "2." + at, "BatchKVCache"); !r) return r;
    if (auto r = MetaIs(file, "0." + at, ""); !r) return r;
    if (auto r = TensorIs(file, at + ".2", FileDType::kI32, {batch}, &offset_bytes); !r) return r;
    if (auto r = TensorIs(file, at + ".3", FileDType::kI32, {batch}, &padding_bytes); !r) return r;
    return kv_match(Iota(0, offset_));
  }
  if (const auto* rotating = std::get_if<engine::RotatingKind>(&spec.kind)) {
    const MlxRotatingModel& model = *rotating_[layer];
    if (!spec_.left_padding.empty()) return BatchRotatingMatches(file, layer, model, kv_match);
    if (auto r = MetaIs(file, "2." + at, "RotatingKVCache"); !r) return r;
    if (auto r = MetaNumbers(file, layer,
                             {rotating->keep, rotating->max_size, model.offset(), model.idx()});
        !r) {
      return r;
    }
    return kv_match(model.State());
  }
  if (const auto* chunked = std::get_if<engine::ChunkedKind>(&spec.kind)) {
    const uint64_t start = chunk_start_[layer];
    if (auto r = MetaIs(file, "2." + at, "ChunkedKVCache"); !r) return r;
    if (auto r = MetaNumbers(file, layer, {chunked->chunk_size, start}); !r) return r;
    std::vector<int64_t> rows = Iota(start, offset_);
    rows.insert(rows.end(), start, -1);  // mlx-lm slices by offset: zeros past the held tokens
    return kv_match(rows);
  }
  if (const auto* quantized = std::get_if<engine::QuantizedKind>(&spec.kind)) {
    if (auto r = MetaIs(file, "2." + at, "QuantizedKVCache"); !r) return r;
    if (auto r = MetaNumbers(file, layer, {offset_, quantized->group_size, quantized->bits}); !r) {
      return r;
    }
    const std::vector<std::vector<std::byte>> planes = PackedPlanes(view, layer);
    for (int side = 0; side < 2; ++side) {
      const uint64_t dim = side == 0 ? dims.k_dim : dims.v_dim;
      const std::string key = absl::StrCat(at, ".", side, ".");
      if (auto r = TensorIs(file, key + "0", FileDType::kU32,
                            {batch, heads, offset_, dim * quantized->bits / 32}, &planes[3 * side]);
          !r) {
        return r;
      }
      for (int j = 1; j < 3; ++j) {
        if (auto r = TensorIs(file, key + absl::StrCat(j), dtype,
                              {batch, heads, offset_, dim / quantized->group_size},
                              &planes[3 * side + j]);
            !r) {
          return r;
        }
      }
    }
    return ::testing::AssertionSuccess();
  }
  const auto& recurrent = std::get<engine::RecurrentKind>(spec.kind);
  if (auto r = MetaIs(file, "2." + at, "ArraysCache"); !r) return r;
  if (auto r = MetaIs(file, "0." + at, ""); !r) return r;
  if (auto r = TensorIs(file, at + ".0", dtype, {batch, recurrent.conv_tail, recurrent.conv_dim},
                        &states_[layer].conv);
      !r) {
    return r;
  }
  return TensorIs(file, at + ".1", dtype,
                  {batch, recurrent.num_v_heads, recurrent.head_v_dim, recurrent.head_k_dim},
                  &states_[layer].delta);
}

::testing::AssertionResult TensorIs(const PromptCacheFile& file, const std::string& key,
                                    FileDType dtype, const std::vector<uint64_t>& shape,
                                    const std::vector<std::byte>* bytes) {
  const auto it = file.tensors.find(key);
  if (it == file.tensors.end()) return ::testing::AssertionFailure() << "no tensor " << key;
  if (it->second.dtype != dtype) return ::testing::AssertionFailure() << key << ": wrong dtype";
  if (it->second.shape != shape) {
    return ::testing::AssertionFailure()
           << key << ": shape [" << absl::StrJoin(it->second.shape, ",") << "], expected ["
           << absl::StrJoin(shape, ",") << "]";
  }
  if (bytes != nullptr && it->second.data != *bytes) {
    return ::testing::AssertionFailure() << key << ": bytes differ";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult SameFile(const PromptCacheFile& expected,
                                    const PromptCacheFile& actual) {
  if (expected.metadata != actual.metadata) {
    return ::testing::AssertionFailure() << "metadata differs";
  }
  for (const auto& [key, tensor] : expected.tensors) {
    const std::vector<std::byte> bytes(tensor.data.begin(), tensor.data.end());
    if (auto r = TensorIs(actual, key, tensor.dtype, tensor.shape, &bytes); !r) return r;
  }
  if (expected.tensors.size() != actual.tensors.size()) {
    return ::testing::AssertionFailure()
           << actual.tensors.size() << " tensors, expected " << expected.tensors.size();
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult SameContents(const CacheSnapshot& expected,
                                        const CacheSnapshot& actual) {
  if (!engine::SameLayout(expected.spec, actual.spec) || expected.to != actual.to ||
      expected.spec.model != actual.spec.model ||
      expected.spec.left_padding != actual.spec.left_padding) {
    return ::testing::AssertionFailure() << "the spec or offset differs";
  }
  for (uint32_t layer = 0; layer < expected.spec.layers.size(); ++layer) {
    if (IsRecurrent(expected.spec.layers[layer])) {
      auto want = ReadLayerState(expected, layer), got = ReadLayerState(actual, layer);
      if (!want.ok() || !got.ok() || !(*want == *got)) {
        return ::testing::AssertionFailure() << "layer " << layer << ": states differ";
      }
      continue;
    }
    const auto ranges = expected.Ranges(layer, kEverything);
    if (ranges != actual.Ranges(layer, kEverything)) {
      return ::testing::AssertionFailure()
             << "layer " << layer << ": ranges " << RangesString(actual.Ranges(layer, kEverything))
             << ", expected " << RangesString(ranges);
    }
    for (const engine::TokenRange& range : ranges) {
      auto want = ReadRange(expected, layer, range), got = ReadRange(actual, layer, range);
      if (!want.ok() || !got.ok()) return ::testing::AssertionFailure() << "a read failed";
      if (auto r = SameTokens(*want, *got); !r) return r << " (layer " << layer << ")";
    }
    if (std::holds_alternative<engine::QuantizedKind>(expected.spec.layers[layer].kind) &&
        PackedPlanes(expected, layer) != PackedPlanes(actual, layer)) {
      return ::testing::AssertionFailure() << "layer " << layer << ": packed planes differ";
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace kvcache::testing
