// The CPU reference of a recurrent layer: a port of ollama's RecurrentCache
// (shared/reference/003) holding the state as host bytes:
//
//   state           none until the first update (ollama's convState / deltaState
//                   are nil; ensure() would make zeros, which is how it reads).
//   UpdateState     SetConvState + SetDeltaState, then Advance(n).
//   Snapshot        nil without a state, else the whole state and the offset.
//   Restore(nil, t) true only when t == offset.
//   Restore(S, t)   true only when t == S.offset: S's state. (ollama also
//                   accepts t > S.offset, landing at S.offset; the service's
//                   contract is that every layer ends at t.)
//   Merge / Split   child / (nil, snapshot).
//   Trim            never (mlx-lm ArraysCache is not trimmable).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "engine/layers/cache_spec.h"
#include "reference_model.h"

namespace kvcache::testing {

class RefRecurrentLayer final : public RefLayer {
 public:
  std::unique_ptr<RefLayer> Clone() const override;
  uint64_t offset() const override { return offset_; }
  // Recurrent layers take no tokens: calling this is a driver bug (aborts).
  void Update(std::vector<RefToken> tokens) override;
  void UpdateState(RefState state, uint64_t advance) override;
  std::optional<RefState> FetchState() const override { return state_; }
  std::vector<RefToken> Fetch() const override { return {}; }
  bool IsTrimmable() const override { return false; }
  uint64_t Trim(uint64_t n) override;
  RefLayerSnapshotPtr Snapshot(uint64_t from) const override;
  std::vector<RefToken> FetchSnapshot(const RefLayerSnapshot&) const override { return {}; }
  bool Restore(const RefLayerSnapshot* snapshot, uint64_t target) override;
  RefLayerSnapshotPtr Merge(const RefLayerSnapshotPtr& parent,
                            const RefLayerSnapshotPtr& child) const override;
  std::pair<RefLayerSnapshotPtr, RefLayerSnapshotPtr> Split(const RefLayerSnapshotPtr& snapshot,
                                                            uint64_t at) const override;
  bool CanMerge(const RefLayerSnapshotPtr&, const RefLayerSnapshotPtr&) const override {
    return true;  // snapshots are self-contained
  }

 private:
  std::optional<RefState> state_;
  uint64_t offset_ = 0;
};

// Bytes of layer `layer`'s conv and delta states ([B, conv_tail, conv_dim] and
// [B, Hv, Dv, Dk] in the cache dtype).
uint64_t ConvStateBytes(const engine::CacheSpec& spec, size_t layer);
uint64_t DeltaStateBytes(const engine::CacheSpec& spec, size_t layer);
// The state a layer without one reads as: zeros (ollama ensure()).
RefState ZeroState(const engine::CacheSpec& spec, size_t layer);

}  // namespace kvcache::testing
