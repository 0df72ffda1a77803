// A plain CPU reference model of the engine's cache kinds, written from the
// reference algorithms (shared/reference: ollama KVCache / RotatingKVCache for
// Snapshot / Restore / Merge / Split, mlx-lm RotatingKVCache for the ring buffer
// with attention sinks), never from the engine's code. It holds bytes in host
// vectors, one RefToken per stored token, and remembers each token's absolute
// position, so a test can compare both the ranges and the bytes a fetch returns.
//
// Only the spec's data types are shared with the engine (CacheSpec, TokenRange):
// every decision (what is kept, what is refused) is made here independently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "engine/layers/cache_spec.h"
#include "engine/layers/layer.h"

namespace kvcache::testing {

inline constexpr uint64_t kPaddingPosition = std::numeric_limits<uint64_t>::max();

// The bytes of one token of one layer: K as [B, H, Dk] and V as [B, H, Dv].
struct RefToken {
  uint64_t position = kPaddingPosition;  // kPaddingPosition: mlx's zero-filled grow slots
  std::vector<std::byte> keys;
  std::vector<std::byte> values;
};

// How one layer's tokens are shaped (one token of all rows and heads).
struct RefShape {
  uint32_t batch = 1;
  uint32_t heads = 1;
  uint32_t k_dim = 1;
  uint32_t v_dim = 1;
  uint32_t elem_bytes = 2;

  uint64_t KRowBytes() const { return uint64_t{k_dim} * elem_bytes; }
  uint64_t VRowBytes() const { return uint64_t{v_dim} * elem_bytes; }
  uint64_t KTensorBytes(uint64_t tokens) const { return tokens * batch * heads * KRowBytes(); }
  uint64_t VTensorBytes(uint64_t tokens) const { return tokens * batch * heads * VRowBytes(); }
};

RefShape ShapeOf(const engine::CacheSpec& spec, size_t layer);

// [B, H, L, D] tensors -> L tokens (positions left unset), and back.
std::vector<RefToken> TokensFromTensors(const RefShape& shape, absl::Span<const std::byte> keys,
                                        absl::Span<const std::byte> values, uint64_t tokens);
void TensorsFromTokens(const RefShape& shape, absl::Span<const RefToken> tokens,
                       std::vector<std::byte>& keys, std::vector<std::byte>& values);

// Consecutive absolute positions merged into ranges, in the tokens' order.
std::vector<engine::TokenRange> RangesOf(absl::Span<const RefToken> tokens);

// A recurrent layer's state: conv [B, conv_tail, conv_dim] and delta
// [B, Hv, Dv, Dk] as the bytes UpdateState was given.
struct RefState {
  std::vector<std::byte> conv;
  std::vector<std::byte> delta;
  bool operator==(const RefState&) const = default;
};

// The state one layer snapshot holds. Standard: the tokens [from, to). Rotating
// (ollama rotatingSnapshot): the whole ring state in physical order, its `_idx`,
// and `to` as the offset it was taken at. Chunked: the tokens it holds and the
// start position. Recurrent: the state as of `to`.
struct RefLayerSnapshot {
  uint64_t from = 0;
  uint64_t to = 0;
  uint64_t idx = 0;
  uint64_t start = 0;  // chunked: mlx-lm start_position
  std::vector<RefToken> tokens;
  std::optional<RefState> state;  // recurrent
};
using RefLayerSnapshotPtr = std::shared_ptr<const RefLayerSnapshot>;

class RefLayer {
 public:
  virtual ~RefLayer() = default;
  virtual std::unique_ptr<RefLayer> Clone() const = 0;

  virtual uint64_t offset() const = 0;
  // Appends the tokens, assigning them positions offset, offset+1, ...
  virtual void Update(std::vector<RefToken> tokens) = 0;
  // What a fetch returns: the tokens held, in temporal order.
  virtual std::vector<RefToken> Fetch() const = 0;
  virtual bool IsTrimmable() const = 0;
  virtual uint64_t Trim(uint64_t n) = 0;

  virtual RefLayerSnapshotPtr Snapshot(uint64_t from) const = 0;
  // The tokens a snapshot holds, in temporal order.
  virtual std::vector<RefToken> FetchSnapshot(const RefLayerSnapshot& snapshot) const = 0;
  // ollama Restore: false (and no change) when `target` is unreachable; else
  // the layer ends at `target`.
  virtual bool Restore(const RefLayerSnapshot* snapshot, uint64_t target) = 0;
  virtual RefLayerSnapshotPtr Merge(const RefLayerSnapshotPtr& parent,
                                    const RefLayerSnapshotPtr& child) const = 0;
  virtual std::pair<RefLayerSnapshotPtr, RefLayerSnapshotPtr> Split(
      const RefLayerSnapshotPtr& snapshot, uint64_t at) const = 0;
  // Whether Merge(parent, child) of adjacent snapshots, one of them null at
  // most, is allowed. By default both must hold something (a null part is
  // refused, as the engine does). Both null merge to null (RefCache::Merge).
  virtual bool CanMerge(const RefLayerSnapshotPtr& parent, const RefLayerSnapshotPtr& child) const;

  // Recurrent layers only (others abort: a driver bug): replace the state and
  // advance the offset; the state held (nullopt before the first update).
  virtual void UpdateState(RefState state, uint64_t advance);
  virtual std::optional<RefState> FetchState() const;
};

// mlx-lm KVCache / ollama KVCache.
class RefStandardLayer final : public RefLayer {
 public:
  std::unique_ptr<RefLayer> Clone() const override;
  uint64_t offset() const override { return offset_; }
  void Update(std::vector<RefToken> tokens) override;
  std::vector<RefToken> Fetch() const override;
  bool IsTrimmable() const override { return true; }
  uint64_t Trim(uint64_t n) override;
  RefLayerSnapshotPtr Snapshot(uint64_t from) const override;
  std::vector<RefToken> FetchSnapshot(const RefLayerSnapshot& snapshot) const override;
  bool Restore(const RefLayerSnapshot* snapshot, uint64_t target) override;
  RefLayerSnapshotPtr Merge(const RefLayerSnapshotPtr& parent,
                            const RefLayerSnapshotPtr& child) const override;
  std::pair<RefLayerSnapshotPtr, RefLayerSnapshotPtr> Split(const RefLayerSnapshotPtr& snapshot,
                                                            uint64_t at) const override;

 private:
  // Tokens [0, offset_) are live; entries beyond are stale (like mlx's buffer).
  std::vector<RefToken> buffer_;
  uint64_t offset_ = 0;
};

// mlx-lm RotatingKVCache (max_size, keep), with its physical ring buffer and
// `_idx`; snapshots and restore as ollama's RotatingKVCache.
class RefRotatingLayer final : public RefLayer {
 public:
  RefRotatingLayer(uint64_t max_size, uint64_t keep) : max_size_(max_size), keep_(keep) {}

  std::unique_ptr<RefLayer> Clone() const override;
  uint64_t offset() const override { return offset_; }
  uint64_t idx() const { return idx_; }
  size_t buffer_size() const { return buffer_.size(); }
  void Update(std::vector<RefToken> tokens) override;
  std::vector<RefToken> Fetch() const override;
  bool IsTrimmable() const override { return offset_ < max_size_; }
  uint64_t Trim(uint64_t n) override;
  RefLayerSnapshotPtr Snapshot(uint64_t from) const override;
  std::vector<RefToken> FetchSnapshot(const RefLayerSnapshot& snapshot) const override;
  bool Restore(const RefLayerSnapshot* snapshot, uint64_t target) override;
  RefLayerSnapshotPtr Merge(const RefLayerSnapshotPtr& parent,
                            const RefLayerSnapshotPtr& child) const override;
  std::pair<RefLayerSnapshotPtr, RefLayerSnapshotPtr> Split(const RefLayerSnapshotPtr& snapshot,
                                                            uint64_t at) const override;
  bool CanMerge(const RefLayerSnapshotPtr&, const RefLayerSnapshotPtr&) const override {
    return true;  // the child (or its absence) supersedes the parent
  }

 private:
  static constexpr uint64_t kStep = 256;

  // mlx-lm `state`: the buffer cut to offset while offset < its length.
  std::vector<RefToken> State() const;
  // mlx-lm `_temporal_order` of `v` for a given `_idx` and offset.
  std::vector<RefToken> TemporalOrder(const std::vector<RefToken>& v, uint64_t idx,
                                      uint64_t offset) const;
  // mlx-lm `_trim`: drops [keep, keep + trim_size) and appends `append`.
  std::vector<RefToken> TrimBuffer(uint64_t trim_size, const std::vector<RefToken>& v,
                                   std::vector<RefToken> append) const;
  void UpdateInPlace(RefToken token);
  void UpdateConcat(std::vector<RefToken> tokens);

  uint64_t max_size_;
  uint64_t keep_;
  std::vector<RefToken> buffer_;  // physical order
  uint64_t offset_ = 0;
  uint64_t idx_ = 0;
};

// Every kind but quantized (which needs the cache's dtype and batch).
std::unique_ptr<RefLayer> MakeRefLayer(const engine::LayerSpec& spec);
// Any kind: layer `layer` of `spec` (quantized: reference_quantized.h).
std::unique_ptr<RefLayer> MakeRefLayer(const engine::CacheSpec& spec, size_t layer);

// A whole-cache snapshot: one (possibly null) layer snapshot per layer.
struct RefCacheSnapshot {
  engine::CacheSpec spec;
  uint64_t from = 0;
  uint64_t to = 0;
  std::vector<RefLayerSnapshotPtr> layers;
};
using RefCacheSnapshotPtr = std::shared_ptr<const RefCacheSnapshot>;

// A cache of layers stepping together, with the engine's cache-level rules:
// whole-cache snapshots need every layer in step; restore is all
// layers or none.
class RefCache {
 public:
  explicit RefCache(const engine::CacheSpec& spec);

  const engine::CacheSpec& spec() const { return spec_; }
  size_t num_layers() const { return layers_.size(); }
  const RefLayer& layer(size_t index) const { return *layers_[index]; }
  std::vector<uint64_t> layer_offsets() const;
  // The common offset, or nullopt while layers are out of step.
  std::optional<uint64_t> CommonOffset() const;

  void Update(size_t layer, std::vector<RefToken> tokens);
  void UpdateState(size_t layer, RefState state, uint64_t advance);
  // nullopt when refused (a layer not trimmable, or out of step). All layers
  // trim the least any of them can (a chunked layer stops at its start).
  std::optional<uint64_t> Trim(uint64_t n);
  // nullptr when refused (from >= offset, or out of step).
  RefCacheSnapshotPtr Snapshot(uint64_t from) const;
  // snapshot null: live rewind. False (and no change) when any layer refuses;
  // else every layer ends at `target`.
  bool Restore(const RefCacheSnapshot* snapshot, uint64_t target);

  // nullptr when refused: same snapshot, layouts differ, not adjacent, or a
  // layer refuses (RefLayer::CanMerge).
  static RefCacheSnapshotPtr Merge(const RefCacheSnapshotPtr& parent,
                                   const RefCacheSnapshotPtr& child);
  // nullopt when `at` is outside (from, to).
  static std::optional<std::pair<RefCacheSnapshotPtr, RefCacheSnapshotPtr>> Split(
      const RefCacheSnapshotPtr& snapshot, uint64_t at);
  // The tokens of one layer of a snapshot, in temporal order.
  static std::vector<RefToken> FetchSnapshot(const RefCacheSnapshot& snapshot, size_t layer);

 private:
  engine::CacheSpec spec_;
  std::vector<std::unique_ptr<RefLayer>> layers_;
};

}  // namespace kvcache::testing
