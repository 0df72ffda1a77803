// The one small surface every layer kind implements (mlx-lm's cache.py has the
// same for each kind): update, temporal-order reads, offset, trim, snapshot,
// restore, free, size on the layer; merge and split on its snapshots. Layers are not thread-safe: their Cache
// serialises calls. Snapshots are immutable and may be read from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvcache::engine {

// Absolute token positions [begin, end).
struct TokenRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - begin; }
  bool operator==(const TokenRange&) const = default;
};

// L new tokens of one layer: keys [B, H, L, Dk], values [B, H, L, Dv], row-major.
struct KvInput {
  absl::Span<const std::byte> keys;
  absl::Span<const std::byte> values;
  uint64_t tokens = 0;
};

// Where a read lands: [B, H, L, Dk] keys and [B, H, L, Dv] values for a range of L.
struct KvOutput {
  absl::Span<std::byte> keys;
  absl::Span<std::byte> values;
};

class LayerSnapshot;
using LayerSnapshotPtr = std::shared_ptr<const LayerSnapshot>;

// The immutable, page-referencing state of one layer over [from, to). Merge and
// split live here, not on Layer: they need no live state, and snapshots outlive
// the cache they came from.
class LayerSnapshot : public std::enable_shared_from_this<LayerSnapshot> {
 public:
  virtual ~LayerSnapshot() = default;
  virtual uint64_t from() const = 0;
  virtual uint64_t to() const = 0;
  // The tokens it holds, in temporal order.
  virtual std::vector<TokenRange> Ranges() const = 0;
  // Copies `range` (inside one of Ranges()) out in [B, H, L, D] order.
  virtual absl::Status Read(TokenRange range, const KvOutput& out) const = 0;
  virtual uint64_t size_bytes() const = 0;
  // This [a,b) followed by `child` [b,c) -> [a,c).
  virtual absl::StatusOr<LayerSnapshotPtr> MergedWith(const LayerSnapshot& child) const = 0;
  // [a,c) at b -> ([a,b), [b,c)); null for a side that holds nothing. Kinds that
  // cannot split return (null, this).
  virtual absl::StatusOr<std::pair<LayerSnapshotPtr, LayerSnapshotPtr>> SplitAt(
      uint64_t at) const = 0;
};

class Layer {
 public:
  virtual ~Layer() = default;

  virtual uint64_t offset() const = 0;
  virtual absl::Status Update(const KvInput& kv) = 0;
  // The tokens held, in temporal order (rotating: sinks, then the window).
  virtual std::vector<TokenRange> Ranges() const = 0;
  virtual absl::Status Read(TokenRange range, const KvOutput& out) const = 0;
  virtual bool IsTrimmable() const = 0;
  // Drops the last min(offset, n) tokens and returns how many; callers check
  // IsTrimmable first.
  virtual uint64_t Trim(uint64_t n) = 0;

  // State from `from_offset` to offset(); nullptr when offset() <= from_offset.
  virtual absl::StatusOr<LayerSnapshotPtr> Snapshot(uint64_t from_offset) const = 0;
  // A new layer holding what Restore(snapshot, target) leaves (snapshot may be
  // null: rewind the live state). This layer is unchanged, so a cache can
  // restore all layers or none. FAILED_PRECONDITION says why it is unreachable.
  virtual absl::StatusOr<std::unique_ptr<Layer>> Restored(const LayerSnapshot* snapshot,
                                                          uint64_t target) const = 0;
  // Releases every page; offset returns to 0.
  virtual void Free() = 0;
  virtual uint64_t size_bytes() const = 0;
};

}  // namespace kvcache::engine
