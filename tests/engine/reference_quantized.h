// The reference for quantized layers (mlx-lm QuantizedKVCache): standard-layer
// semantics (RefStandardLayer) over tokens whose stored bytes are the CPU
// reference quantizer's packed form (support/ref_quantizer.h). A packed token
// holds, per side and per (row, head), one row of each plane back to back:
//
//   keys   = [ (b,h)=0: wq Dk*bits/8 | scales Dk/g*elem | biases Dk/g*elem ][ (b,h)=1 ... ]
//   values = the same over Dv
//
// and the engine's packed fetch (LayerSnapshot::ReadPacked) is compared with it
// byte for byte; its dequantized fetch with the CPU dequantization of it.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/layers/cache.h"
#include "engine_test_util.h"
#include "reference_model.h"
#include "support/ref_quantizer.h"

namespace kvcache::testing {

// One packed row of a side: wq, then scales, then biases.
inline uint64_t PackedRowBytes(const RefQuantFormat& f, uint32_t dim) {
  return WqRowBytes(f, dim) + 2 * ScaleRowBytes(f, dim);
}

// A raw token ([B, H, D] dtype elements per side) in its packed form, and back.
RefToken QuantizeToken(const RefShape& shape, const RefQuantFormat& format, const RefToken& raw);
RefToken DequantizeToken(const RefShape& shape, const RefQuantFormat& format,
                         const RefToken& packed);

class RefQuantizedLayer final : public RefLayer {
 public:
  RefQuantizedLayer(const RefShape& shape, const RefQuantFormat& format)
      : shape_(shape), format_(format) {}

  std::unique_ptr<RefLayer> Clone() const override;
  uint64_t offset() const override { return standard_.offset(); }
  // Quantizes each token, then appends it as a standard layer would.
  void Update(std::vector<RefToken> tokens) override;
  std::vector<RefToken> Fetch() const override { return standard_.Fetch(); }
  bool IsTrimmable() const override { return true; }
  uint64_t Trim(uint64_t n) override { return standard_.Trim(n); }
  RefLayerSnapshotPtr Snapshot(uint64_t from) const override { return standard_.Snapshot(from); }
  std::vector<RefToken> FetchSnapshot(const RefLayerSnapshot& snapshot) const override {
    return standard_.FetchSnapshot(snapshot);
  }
  bool Restore(const RefLayerSnapshot* snapshot, uint64_t target) override {
    return standard_.Restore(snapshot, target);
  }
  RefLayerSnapshotPtr Merge(const RefLayerSnapshotPtr& parent,
                            const RefLayerSnapshotPtr& child) const override {
    return standard_.Merge(parent, child);
  }
  std::pair<RefLayerSnapshotPtr, RefLayerSnapshotPtr> Split(const RefLayerSnapshotPtr& snapshot,
                                                            uint64_t at) const override {
    return standard_.Split(snapshot, at);
  }

 private:
  RefShape shape_;
  RefQuantFormat format_;
  RefStandardLayer standard_;
};

// Fills `format` and returns true when `layer` is quantized.
bool QuantFormatOf(const engine::CacheSpec& spec, size_t layer, RefQuantFormat& format);

// L random tokens for `layer`: finite values with quantization edge cases
// (RandomQuantizableValues) for quantized layers, random bytes otherwise.
KvTensors RandomLayerKv(const engine::CacheSpec& spec, size_t layer, uint64_t tokens,
                        std::mt19937_64& rng);

// A layer's tokens as the reference stores them: FetchLayer / ReadRange for
// plain layers; for quantized layers the packed form (ReadPacked), after
// checking that the dequantized read (Read) is the CPU dequantization of it,
// byte for byte (INTERNAL naming the position if not).
absl::StatusOr<std::vector<RefToken>> ReadStoredRange(const engine::CacheSnapshot& view,
                                                      uint32_t layer, engine::TokenRange range);
absl::StatusOr<std::vector<RefToken>> FetchStoredLayer(const engine::CacheSnapshot& view,
                                                       uint32_t layer, engine::TokenRange window);

}  // namespace kvcache::testing
