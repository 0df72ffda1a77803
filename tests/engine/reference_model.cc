#include "reference_model.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <variant>

#include "reference_chunked.h"
#include "reference_quantized.h"
#include "reference_recurrent.h"

namespace kvcache::testing {
namespace {

// A broken reference invariant is a bug in this file, not in the engine:
// stop loudly rather than let a test blame the engine.
void RefCheck(bool condition, const char* what) {
  if (!condition) {
    std::cerr << "reference model invariant violated: " << what << "\n";
    std::abort();
  }
}

std::vector<RefToken> Slice(const std::vector<RefToken>& v, uint64_t begin, uint64_t end) {
  RefCheck(begin <= end && end <= v.size(), "slice bounds");
  return std::vector<RefToken>(v.begin() + begin, v.begin() + end);
}

void Append(std::vector<RefToken>& to, std::vector<RefToken> tokens) {
  for (RefToken& token : tokens) to.push_back(std::move(token));
}

// Copies one [B, H, L, D] tensor into (or out of) per-token [B, H, D] rows.
void ScatterRows(uint64_t row_heads, uint64_t row_bytes, uint64_t tokens, const std::byte* tensor,
                 std::vector<RefToken>& out, bool keys) {
  for (uint64_t l = 0; l < tokens; ++l) {
    std::vector<std::byte>& dst = keys ? out[l].keys : out[l].values;
    dst.resize(row_heads * row_bytes);
    for (uint64_t rh = 0; rh < row_heads; ++rh) {
      std::memcpy(dst.data() + rh * row_bytes, tensor + (rh * tokens + l) * row_bytes, row_bytes);
    }
  }
}

void GatherRows(uint64_t row_heads, uint64_t row_bytes, absl::Span<const RefToken> tokens,
                std::vector<std::byte>& tensor, bool keys) {
  const uint64_t count = tokens.size();
  tensor.assign(row_heads * count * row_bytes, std::byte{0});
  for (uint64_t l = 0; l < count; ++l) {
    const std::vector<std::byte>& src = keys ? tokens[l].keys : tokens[l].values;
    RefCheck(src.size() == row_heads * row_bytes, "token byte size");
    for (uint64_t rh = 0; rh < row_heads; ++rh) {
      std::memcpy(tensor.data() + (rh * count + l) * row_bytes, src.data() + rh * row_bytes,
                  row_bytes);
    }
  }
}

bool SameLayerLayout(const engine::LayerSpec& a, const engine::LayerSpec& b) {
  const uint32_t av = a.v_head_dim == 0 ? a.k_head_dim : a.v_head_dim;
  const uint32_t bv = b.v_head_dim == 0 ? b.k_head_dim : b.v_head_dim;
  if (a.num_kv_heads != b.num_kv_heads || a.k_head_dim != b.k_head_dim || av != bv) return false;
  if (a.kind.index() != b.kind.index()) return false;
  return a.kind == b.kind;  // kind and its parameters (window, chunk, state dims)
}

bool SameCacheLayout(const engine::CacheSpec& a, const engine::CacheSpec& b) {
  if (a.dtype != b.dtype || a.batch_size != b.batch_size) return false;
  // Positions mean different tokens under different padding (after a filter).
  if (a.left_padding != b.left_padding) return false;
  if (a.layers.size() != b.layers.size()) return false;
  for (size_t i = 0; i < a.layers.size(); ++i) {
    if (!SameLayerLayout(a.layers[i], b.layers[i])) return false;
  }
  return true;
}

}  // namespace

RefShape ShapeOf(const engine::CacheSpec& spec, size_t layer) {
  const engine::LayerSpec& l = spec.layers[layer];
  return RefShape{.batch = spec.batch_size,
                  .heads = l.num_kv_heads,
                  .k_dim = l.k_head_dim,
                  .v_dim = l.v_head_dim == 0 ? l.k_head_dim : l.v_head_dim,
                  .elem_bytes = DTypeSize(spec.dtype)};
}

std::vector<RefToken> TokensFromTensors(const RefShape& shape, absl::Span<const std::byte> keys,
                                        absl::Span<const std::byte> values, uint64_t tokens) {
  RefCheck(keys.size() == shape.KTensorBytes(tokens), "keys tensor size");
  RefCheck(values.size() == shape.VTensorBytes(tokens), "values tensor size");
  std::vector<RefToken> out(tokens);
  const uint64_t row_heads = uint64_t{shape.batch} * shape.heads;
  ScatterRows(row_heads, shape.KRowBytes(), tokens, keys.data(), out, /*keys=*/true);
  ScatterRows(row_heads, shape.VRowBytes(), tokens, values.data(), out, /*keys=*/false);
  return out;
}

void TensorsFromTokens(const RefShape& shape, absl::Span<const RefToken> tokens,
                       std::vector<std::byte>& keys, std::vector<std::byte>& values) {
  const uint64_t row_heads = uint64_t{shape.batch} * shape.heads;
  GatherRows(row_heads, shape.KRowBytes(), tokens, keys, /*keys=*/true);
  GatherRows(row_heads, shape.VRowBytes(), tokens, values, /*keys=*/false);
}

std::vector<engine::TokenRange> RangesOf(absl::Span<const RefToken> tokens) {
  std::vector<engine::TokenRange> ranges;
  for (const RefToken& token : tokens) {
    RefCheck(token.position != kPaddingPosition, "a padding slot is visible");
    if (!ranges.empty() && ranges.back().end == token.position) {
      ++ranges.back().end;
    } else {
      ranges.push_back({token.position, token.position + 1});
    }
  }
  return ranges;
}

// ---------------------------------------------------------------- any layer

bool RefLayer::CanMerge(const RefLayerSnapshotPtr& parent, const RefLayerSnapshotPtr& child) const {
  return parent != nullptr && child != nullptr;
}

void RefLayer::UpdateState(RefState, uint64_t) {
  RefCheck(false, "UpdateState on a layer that is not recurrent");
}

std::optional<RefState> RefLayer::FetchState() const {
  RefCheck(false, "FetchState on a layer that is not recurrent");
  return std::nullopt;
}

// ---------------------------------------------------------------- standard

std::unique_ptr<RefLayer> RefStandardLayer::Clone() const {
  return std::make_unique<RefStandardLayer>(*this);
}

void RefStandardLayer::Update(std::vector<RefToken> tokens) {
  buffer_.resize(offset_);  // positions beyond offset are stale (trimmed)
  for (RefToken& token : tokens) {
    token.position = offset_++;
    buffer_.push_back(std::move(token));
  }
}

std::vector<RefToken> RefStandardLayer::Fetch() const { return Slice(buffer_, 0, offset_); }

uint64_t RefStandardLayer::Trim(uint64_t n) {
  n = std::min(offset_, n);
  offset_ -= n;
  return n;
}

RefLayerSnapshotPtr RefStandardLayer::Snapshot(uint64_t from) const {
  if (offset_ <= from) return nullptr;
  auto snapshot = std::make_shared<RefLayerSnapshot>();
  snapshot->from = from;
  snapshot->to = offset_;
  snapshot->tokens = Slice(buffer_, from, offset_);
  return snapshot;
}

std::vector<RefToken> RefStandardLayer::FetchSnapshot(const RefLayerSnapshot& snapshot) const {
  return snapshot.tokens;
}

bool RefStandardLayer::Restore(const RefLayerSnapshot* snapshot, uint64_t target) {
  if (snapshot == nullptr) {
    if (target > offset_) return false;
    offset_ = target;
    return true;
  }
  if (target > snapshot->to || offset_ < snapshot->from) return false;
  // Rewind to the snapshot's start, then feed the snapshot (ollama appendKV).
  offset_ = snapshot->from;
  buffer_.resize(offset_);
  Append(buffer_, snapshot->tokens);
  offset_ = snapshot->to;
  if (target < offset_) offset_ = target;
  return true;
}

RefLayerSnapshotPtr RefStandardLayer::Merge(const RefLayerSnapshotPtr& parent,
                                            const RefLayerSnapshotPtr& child) const {
  if (parent == nullptr || child == nullptr) return nullptr;  // ollama: nil either way
  auto merged = std::make_shared<RefLayerSnapshot>();
  merged->from = parent->from;
  merged->to = child->to;
  merged->tokens = parent->tokens;
  Append(merged->tokens, child->tokens);
  return merged;
}

std::pair<RefLayerSnapshotPtr, RefLayerSnapshotPtr> RefStandardLayer::Split(
    const RefLayerSnapshotPtr& snapshot, uint64_t at) const {
  if (snapshot == nullptr) return {nullptr, nullptr};
  const uint64_t length = snapshot->to - snapshot->from;
  if (at <= snapshot->from) return {nullptr, snapshot};
  const uint64_t split = at - snapshot->from;
  if (split >= length) return {snapshot, nullptr};
  auto parent = std::make_shared<RefLayerSnapshot>();
  parent->from = snapshot->from;
  parent->to = at;
  parent->tokens = Slice(snapshot->tokens, 0, split);
  auto child = std::make_shared<RefLayerSnapshot>();
  child->from = at;
  child->to = snapshot->to;
  child->tokens = Slice(snapshot->tokens, split, length);
  return {parent, child};
}

// ---------------------------------------------------------------- rotating

std::unique_ptr<RefLayer> RefRotatingLayer::Clone() const {
  return std::make_unique<RefRotatingLayer>(*this);
}

std::vector<RefToken> RefRotatingLayer::State() const {
  if (offset_ < buffer_.size()) return Slice(buffer_, 0, offset_);
  return buffer_;
}

std::vector<RefToken> RefRotatingLayer::TemporalOrder(const std::vector<RefToken>& v,
                                                      uint64_t idx, uint64_t offset) const {
  if (idx == v.size()) return v;
  if (idx < offset) {
    // [:keep] + [idx:] + [keep:idx]
    std::vector<RefToken> out = Slice(v, 0, std::min<uint64_t>(keep_, v.size()));
    Append(out, Slice(v, idx, v.size()));
    if (keep_ < idx) Append(out, Slice(v, keep_, idx));
    return out;
  }
  return Slice(v, 0, idx);
}

std::vector<RefToken> RefRotatingLayer::TrimBuffer(uint64_t trim_size,
                                                   const std::vector<RefToken>& v,
                                                   std::vector<RefToken> append) const {
  std::vector<RefToken> out;
  if (trim_size > 0) {
    out = Slice(v, 0, std::min<uint64_t>(keep_, v.size()));
    const uint64_t resume = std::min<uint64_t>(trim_size + keep_, v.size());
    Append(out, Slice(v, resume, v.size()));
  } else {
    out = v;
  }
  Append(out, std::move(append));
  return out;
}

void RefRotatingLayer::UpdateInPlace(RefToken token) {
  const uint64_t prev = offset_;
  if (buffer_.empty() || (prev >= buffer_.size() && buffer_.size() < max_size_)) {
    RefCheck(max_size_ > prev, "grow with prev >= max_size");
    const uint64_t new_size = std::min(kStep, max_size_ - prev);
    buffer_.resize(buffer_.size() + new_size);  // zero-filled: kPaddingPosition
    idx_ = prev;
  }
  if (buffer_.size() > max_size_) {
    buffer_ = TrimBuffer(buffer_.size() - max_size_, buffer_, {});
    idx_ = max_size_;
  }
  if (idx_ == max_size_) idx_ = keep_;
  RefCheck(idx_ < buffer_.size(), "in-place write beyond the buffer");
  token.position = offset_;
  buffer_[idx_] = std::move(token);
  offset_ += 1;
  idx_ += 1;
}

void RefRotatingLayer::UpdateConcat(std::vector<RefToken> tokens) {
  const uint64_t count = tokens.size();
  for (uint64_t i = 0; i < count; ++i) tokens[i].position = offset_ + i;
  if (buffer_.empty()) {
    buffer_ = std::move(tokens);
  } else {
    // Temporal order first, so the trim keeps the most recent context.
    buffer_ = TemporalOrder(buffer_, idx_, offset_);
    idx_ = buffer_.size();
    // The largest size is max_size + L - 1: every new token sees max_size.
    const int64_t trim_size = static_cast<int64_t>(idx_) - static_cast<int64_t>(max_size_) + 1;
    buffer_ = TrimBuffer(trim_size > 0 ? trim_size : 0, buffer_, std::move(tokens));
  }
  offset_ += count;
  idx_ = buffer_.size();
}

void RefRotatingLayer::Update(std::vector<RefToken> tokens) {
  if (tokens.size() == 1) {
    UpdateInPlace(std::move(tokens[0]));
  } else {
    UpdateConcat(std::move(tokens));
  }
}

std::vector<RefToken> RefRotatingLayer::Fetch() const {
  return TemporalOrder(State(), idx_, offset_);
}

uint64_t RefRotatingLayer::Trim(uint64_t n) {
  n = std::min(offset_, n);
  RefCheck(idx_ >= n, "trim below idx 0");
  offset_ -= n;
  idx_ -= n;
  return n;
}

RefLayerSnapshotPtr RefRotatingLayer::Snapshot(uint64_t from) const {
  if (offset_ <= from) return nullptr;
  auto snapshot = std::make_shared<RefLayerSnapshot>();
  snapshot->from = from;
  snapshot->to = offset_;
  snapshot->idx = idx_;
  snapshot->tokens = State();
  return snapshot;
}

std::vector<RefToken> RefRotatingLayer::FetchSnapshot(const RefLayerSnapshot& snapshot) const {
  const std::vector<RefToken>& v = snapshot.tokens;
  // The snapshot's state viewed as a cache at offset `to` (mlx-lm `state`, then
  // `_temporal_order`).
  std::vector<RefToken> state = snapshot.to < v.size() ? Slice(v, 0, snapshot.to) : v;
  return TemporalOrder(state, snapshot.idx, snapshot.to);
}

bool RefRotatingLayer::Restore(const RefLayerSnapshot* snapshot, uint64_t target) {
  if (snapshot == nullptr) {
    if (target >= offset_) return target == offset_;
    // A window that has shifted cannot be rewound without a snapshot.
    if (offset_ > max_size_) return false;
    offset_ = idx_ = target;
    return true;
  }
  if (target > snapshot->to) return false;
  // Clamping a wrapped snapshot would leave an incomplete window.
  if (target < snapshot->to && snapshot->to > max_size_) return false;
  buffer_ = snapshot->tokens;
  offset_ = snapshot->to;
  idx_ = snapshot->idx;
  if (target < offset_) offset_ = idx_ = target;
  return true;
}

RefLayerSnapshotPtr RefRotatingLayer::Merge(const RefLayerSnapshotPtr& /*parent*/,
                                            const RefLayerSnapshotPtr& child) const {
  return child;  // the child holds the whole window
}

std::pair<RefLayerSnapshotPtr, RefLayerSnapshotPtr> RefRotatingLayer::Split(
    const RefLayerSnapshotPtr& snapshot, uint64_t /*at*/) const {
  return {nullptr, snapshot};  // a ring cannot be cut at a position
}

std::unique_ptr<RefLayer> MakeRefLayer(const engine::LayerSpec& spec) {
  RefCheck(!std::holds_alternative<engine::QuantizedKind>(spec.kind),
           "a quantized layer needs MakeRefLayer(cache spec, layer)");
  if (const auto* chunked = std::get_if<engine::ChunkedKind>(&spec.kind)) {
    return std::make_unique<RefChunkedLayer>(chunked->chunk_size);
  }
  if (std::holds_alternative<engine::RecurrentKind>(spec.kind)) {
    return std::make_unique<RefRecurrentLayer>();
  }
  if (const auto* rotating = std::get_if<engine::RotatingKind>(&spec.kind)) {
    return std::make_unique<RefRotatingLayer>(rotating->max_size, rotating->keep);
  }
  return std::make_unique<RefStandardLayer>();
}

std::unique_ptr<RefLayer> MakeRefLayer(const engine::CacheSpec& spec, size_t layer) {
  RefQuantFormat format;
  if (QuantFormatOf(spec, layer, format)) {
    return std::make_unique<RefQuantizedLayer>(ShapeOf(spec, layer), format);
  }
  return MakeRefLayer(spec.layers[layer]);
}

// ---------------------------------------------------------------- cache

RefCache::RefCache(const engine::CacheSpec& spec) : spec_(spec) {
  for (size_t i = 0; i < spec.layers.size(); ++i) layers_.push_back(MakeRefLayer(spec, i));
}

std::vector<uint64_t> RefCache::layer_offsets() const {
  std::vector<uint64_t> offsets;
  for (const auto& layer : layers_) offsets.push_back(layer->offset());
  return offsets;
}

std::optional<uint64_t> RefCache::CommonOffset() const {
  const uint64_t first = layers_.front()->offset();
  for (const auto& layer : layers_) {
    if (layer->offset() != first) return std::nullopt;
  }
  return first;
}

void RefCache::Update(size_t layer, std::vector<RefToken> tokens) {
  layers_[layer]->Update(std::move(tokens));
}

void RefCache::UpdateState(size_t layer, RefState state, uint64_t advance) {
  layers_[layer]->UpdateState(std::move(state), advance);
}

std::optional<uint64_t> RefCache::Trim(uint64_t n) {
  if (!CommonOffset().has_value()) return std::nullopt;
  for (const auto& layer : layers_) {
    if (!layer->IsTrimmable()) return std::nullopt;
  }
  // What each layer's own trim would drop, tried on a copy; the least is what
  // all of them can drop and stay in step.
  for (const auto& layer : layers_) n = std::min(n, layer->Clone()->Trim(n));
  for (const auto& layer : layers_) RefCheck(layer->Trim(n) == n, "trim in step");
  return n;
}

RefCacheSnapshotPtr RefCache::Snapshot(uint64_t from) const {
  const std::optional<uint64_t> offset = CommonOffset();
  if (!offset.has_value() || from >= *offset) return nullptr;
  auto snapshot = std::make_shared<RefCacheSnapshot>();
  snapshot->spec = spec_;
  snapshot->from = from;
  snapshot->to = *offset;
  for (const auto& layer : layers_) snapshot->layers.push_back(layer->Snapshot(from));
  return snapshot;
}

// Layers out of step may restore (that is how a torn step is recovered).
bool RefCache::Restore(const RefCacheSnapshot* snapshot, uint64_t target) {
  if (snapshot != nullptr && !SameCacheLayout(snapshot->spec, spec_)) return false;
  // Restore copies first: the cache moves only if every layer can.
  std::vector<std::unique_ptr<RefLayer>> restored;
  for (size_t i = 0; i < layers_.size(); ++i) {
    std::unique_ptr<RefLayer> copy = layers_[i]->Clone();
    const RefLayerSnapshot* layer_snapshot =
        snapshot == nullptr ? nullptr : snapshot->layers[i].get();
    if (!copy->Restore(layer_snapshot, target)) return false;
    restored.push_back(std::move(copy));
  }
  for (const auto& layer : restored) RefCheck(layer->offset() == target, "restored to the target");
  layers_ = std::move(restored);
  return true;
}

RefCacheSnapshotPtr RefCache::Merge(const RefCacheSnapshotPtr& parent,
                                    const RefCacheSnapshotPtr& child) {
  if (parent == child || !SameCacheLayout(parent->spec, child->spec)) return nullptr;
  if (parent->to != child->from) return nullptr;
  auto merged = std::make_shared<RefCacheSnapshot>();
  merged->spec = parent->spec;
  merged->from = parent->from;
  merged->to = child->to;
  for (size_t i = 0; i < parent->layers.size(); ++i) {
    if (parent->layers[i] == nullptr && child->layers[i] == nullptr) {
      merged->layers.push_back(nullptr);  // neither holds anything, nor does the merge
      continue;
    }
    std::unique_ptr<RefLayer> kind = MakeRefLayer(parent->spec, i);
    if (!kind->CanMerge(parent->layers[i], child->layers[i])) return nullptr;
    merged->layers.push_back(kind->Merge(parent->layers[i], child->layers[i]));
  }
  return merged;
}

std::optional<std::pair<RefCacheSnapshotPtr, RefCacheSnapshotPtr>> RefCache::Split(
    const RefCacheSnapshotPtr& snapshot, uint64_t at) {
  if (at <= snapshot->from || at >= snapshot->to) return std::nullopt;
  auto parent = std::make_shared<RefCacheSnapshot>();
  auto child = std::make_shared<RefCacheSnapshot>();
  parent->spec = child->spec = snapshot->spec;
  parent->from = snapshot->from;
  parent->to = child->from = at;
  child->to = snapshot->to;
  for (size_t i = 0; i < snapshot->layers.size(); ++i) {
    std::unique_ptr<RefLayer> kind = MakeRefLayer(snapshot->spec, i);
    auto [lower, upper] = kind->Split(snapshot->layers[i], at);
    parent->layers.push_back(lower);
    child->layers.push_back(upper);
  }
  return std::make_pair(RefCacheSnapshotPtr(parent), RefCacheSnapshotPtr(child));
}

std::vector<RefToken> RefCache::FetchSnapshot(const RefCacheSnapshot& snapshot, size_t layer) {
  if (snapshot.layers[layer] == nullptr) return {};
  return MakeRefLayer(snapshot.spec, layer)->FetchSnapshot(*snapshot.layers[layer]);
}

}  // namespace kvcache::testing
