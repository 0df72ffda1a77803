// The CPU reference of a chunked layer: a port of mlx-lm ChunkedKVCache
// (chunk_size, start_position, maybe_trim_front, update_and_fetch, trim), with
// the snapshot rules of server/engine/layers/chunked_layer.h written again from their
// statement, not from the engine's code:
//
//   Update          maybe_trim_front (llama4 calls it before every forward),
//                   then update_and_fetch. maybe_trim_front measures the held
//                   length offset - start_position (mlx-lm uses its buffer's
//                   length, which is the held length rounded up to its growth step).
//   Trim(n)         n = min(offset - start_position, n).
//   Snapshot(from)  the tokens at positions >= from it holds, and start_position.
//   Restore         rebuild the state the snapshot was taken from (its tokens,
//                   and those below `from` from the live cache unless it holds
//                   its own chunk from start_position), then trim to the target.
//   Merge / Split   the child's state over both ranges / the parent's state
//                   trimmed to `at`, null when that state no longer exists.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "reference_model.h"

namespace kvcache::testing {

class RefChunkedLayer final : public RefLayer {
 public:
  explicit RefChunkedLayer(uint64_t chunk_size) : chunk_size_(chunk_size) {}

  std::unique_ptr<RefLayer> Clone() const override;
  uint64_t offset() const override { return offset_; }
  uint64_t start_position() const { return start_position_; }
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
  bool CanMerge(const RefLayerSnapshotPtr& parent, const RefLayerSnapshotPtr& child) const override;

 private:
  // mlx-lm maybe_trim_front.
  void MaybeTrimFront();
  // mlx-lm update_and_fetch (without the fetch).
  void UpdateAndFetch(std::vector<RefToken> tokens);

  uint64_t chunk_size_;
  uint64_t start_position_ = 0;
  uint64_t offset_ = 0;
  // mlx-lm `keys`/`values` along the sequence axis: [0, offset - start_position)
  // are live, entries beyond are stale (left by a trim).
  std::vector<RefToken> buffer_;
};

}  // namespace kvcache::testing
