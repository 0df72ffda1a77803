// The one small surface every layer kind implements (mlx-lm's cache.py has the
// same for each kind): update, temporal-order reads, offset, trim, snapshot,
// restore, row assembly (batch operations), drafts (speculation), free, size
// on the layer; merge and split on its snapshots. Each kind answers its own
// rules here, so the Cache never asks which kind a layer is (only
// engine/layers/layer_factory.h names kinds). Layers are not thread-safe: their Cache
// serialises calls. Snapshots are immutable and may be read from any thread.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
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

// A tensor's bytes, held in one or more contiguous pieces that read as their
// concatenation: the service hands over gRPC's receive slices as they are
// rather than gathering them into one string first.
class TensorBytes {
 public:
  TensorBytes() = default;
  TensorBytes(absl::Span<const std::byte> bytes) { Append(bytes); }  // NOLINT: implicit
  // Any contiguous byte container (a vector, a mutable span); it must outlive this.
  template <typename Bytes, typename = std::enable_if_t<
                                std::is_convertible_v<const Bytes&, absl::Span<const std::byte>>>>
  TensorBytes(const Bytes& bytes)  // NOLINT: implicit
      : TensorBytes(absl::Span<const std::byte>(bytes)) {}
  void Append(absl::Span<const std::byte> piece);
  absl::Span<const absl::Span<const std::byte>> pieces() const { return pieces_; }
  uint64_t size() const { return size_; }
  // Calls visit(span) for each contiguous part of bytes [offset, offset + bytes),
  // in order; the range must lie inside size().
  template <typename Visit>
  void ForEachPart(uint64_t offset, uint64_t bytes, Visit&& visit) const;
  // Copies bytes [offset, offset + dst.size()) into dst.
  void CopyTo(uint64_t offset, absl::Span<std::byte> dst) const;

 private:
  absl::InlinedVector<absl::Span<const std::byte>, 2> pieces_;
  uint64_t size_ = 0;
};

// L new tokens of one layer: keys [B, H, L, Dk], values [B, H, L, Dv], row-major.
struct KvInput {
  TensorBytes keys;
  TensorBytes values;
  uint64_t tokens = 0;
};

// A recurrent layer's new state (ollama RecurrentCache SetConvState /
// SetDeltaState, then Advance): conv [B, conv_tail, conv_dim] and delta
// [B, Hv, Dv, Dk] in the cache dtype, replacing the old state whole, and the
// number of tokens it has consumed since the last one.
struct StateInput {
  TensorBytes conv;
  TensorBytes delta;
  uint64_t advance = 0;
};

// Where a recurrent state is read to: conv and delta, shaped as in StateInput.
struct StateOutput {
  absl::Span<std::byte> conv;
  absl::Span<std::byte> delta;
};

// Where a quantized layer's stored form is read to, per side (K and V), for a
// range of L tokens: wq [B, H, L, D*bits/32] uint32 words, scales and biases
// [B, H, L, D/group_size] in the cache dtype, exactly as mlx packs them.
struct PackedOutput {
  struct Side {
    absl::Span<std::byte> wq;
    absl::Span<std::byte> scales;
    absl::Span<std::byte> biases;
  };
  Side keys;
  Side values;
};

// A quantized range in its stored form, as input: shaped as in PackedOutput.
struct PackedInput {
  struct Side {
    absl::Span<const std::byte> wq;
    absl::Span<const std::byte> scales;
    absl::Span<const std::byte> biases;
  };
  Side keys;
  Side values;
};

// A whole layer state to put a fresh layer straight into (Layer::Load), as a
// saved prompt-cache file holds it; each kind reads the fields it has.
struct LayerContents {
  uint64_t offset = 0;
  // Attention kinds: the held tokens in temporal order (what Ranges() lists,
  // concatenated), [B, H, L, D].
  KvInput held;
  // Quantized layers: the held tokens as stored, instead of `held`; their
  // bytes land as they are (never requantized). L is `packed_tokens`.
  const PackedInput* packed = nullptr;
  uint64_t packed_tokens = 0;
  uint64_t ring_idx = 0;              // rotating: mlx-lm `_idx`
  uint64_t start_position = 0;        // chunked: mlx-lm start_position
  const StateInput* state = nullptr;  // recurrent: the state as of `offset`
};

// Where a read lands: [B, H, L, Dk] keys and [B, H, L, Dv] values for a range of L.
struct KvOutput {
  absl::Span<std::byte> keys;
  absl::Span<std::byte> values;
};

// Keys and values where they lie, as pieces whose concatenation is the
// [B, H, L, D] tensor (LayerSnapshot::Mapped).
struct KvMappedPieces {
  std::vector<absl::Span<const std::byte>> keys;
  std::vector<absl::Span<const std::byte>> values;
};

class LayerDraft;
class LayerSnapshot;
class PageTable;
class StagedAppend;

// One row of a layer being assembled by a batch operation (mlx-lm BatchKVCache
// merge / extend / filter / extract): row `row` of `source`, with its token at
// position p moved to p + shift. Positions no source token lands on are padding
// (zeros). `source` may be null: the row is all padding.
struct RowSource {
  const LayerSnapshot* source = nullptr;
  uint32_t row = 0;
  int64_t shift = 0;
  // The row's left padding in the source: its own tokens start there.
  uint64_t padding = 0;
  // Whether the padding positions' contents travel with the row (mlx filter
  // slices the buffer, extend pads it) or land as zeros (merge builds a zero
  // buffer and copies each row's own tokens into it).
  bool copy_padding = true;
};

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
  // What Read would copy, as pieces of the host-mapped pages it lies in,
  // valid while this snapshot lives: for sending without a copy.
  // FAILED_PRECONDITION where the bytes are not stored as they are read
  // (quantized, recurrent layers) or not host-visible (the default).
  virtual absl::Status Mapped(TokenRange range, KvMappedPieces& out) const;
  virtual uint64_t size_bytes() const = 0;
  // Every page it holds: what eviction moves and promotion brings back.
  virtual const PageTable& held_pages() const = 0;
  // Quantized layers: `range` in its stored, packed form. Others: INVALID_ARGUMENT.
  virtual absl::Status ReadPacked(TokenRange range, const PackedOutput& out) const;
  // Recurrent layers: the state as of to(). Others: INVALID_ARGUMENT.
  virtual absl::Status ReadState(const StateOutput& out) const;
  // This [a,b) followed by `child` [b,c) -> [a,c).
  virtual absl::StatusOr<LayerSnapshotPtr> MergedWith(const LayerSnapshot& child) const = 0;
  // Whether, in a merge, the child of this kind supersedes the parent whole
  // (its snapshots hold the layer's whole state: a rotating window, a
  // recurrent state), so the merge may go on where one side holds nothing.
  virtual bool ChildSupersedes() const { return false; }
  // [a,c) at b -> ([a,b), [b,c)); null for a side that holds nothing. Kinds that
  // cannot split return (null, this).
  virtual absl::StatusOr<std::pair<LayerSnapshotPtr, LayerSnapshotPtr>> SplitAt(
      uint64_t at) const = 0;
};

class Layer {
 public:
  virtual ~Layer() = default;

  virtual uint64_t offset() const = 0;
  // Attention layers: appends kv's tokens. Recurrent layers: INVALID_ARGUMENT.
  virtual absl::Status Update(const KvInput& kv) = 0;
  // Recurrent layers: replaces the state and advances the offset. Attention
  // layers: INVALID_ARGUMENT (the default).
  virtual absl::Status UpdateState(const StateInput& state);
  // The tokens held, in temporal order (rotating: sinks, then the window).
  virtual std::vector<TokenRange> Ranges() const = 0;
  virtual absl::Status Read(TokenRange range, const KvOutput& out) const = 0;
  // mlx-lm is_trimmable, with the reason: OK, or FAILED_PRECONDITION saying
  // why this layer cannot drop tokens now (the cache names the layer).
  virtual absl::Status CheckTrimmable() const = 0;
  // The most tokens Trim can drop: the offset, or what a chunked layer holds
  // above its start position (mlx-lm trim).
  virtual uint64_t TrimmableTokens() const = 0;
  // Drops the last min(TrimmableTokens(), n) tokens and returns how many;
  // callers check CheckTrimmable first.
  virtual uint64_t Trim(uint64_t n) = 0;

  // State from `from_offset` to offset(); nullptr when offset() <= from_offset.
  virtual absl::StatusOr<LayerSnapshotPtr> Snapshot(uint64_t from_offset) const = 0;
  // A new layer holding what Restore(snapshot, target) leaves, at offset
  // `target` (snapshot may be null: rewind the live state). This layer is
  // unchanged, so a cache can restore all layers or none. FAILED_PRECONDITION
  // says why `target` is unreachable.
  virtual absl::StatusOr<std::unique_ptr<Layer>> Restored(const LayerSnapshot* snapshot,
                                                          uint64_t target) const = 0;
  // Fills this empty layer (batch = rows.size()) from other layers' rows, up to
  // `offset`: the batch operations (engine/batch/batch_ops.h). The sources are of this
  // layer's kind and dims. All or nothing: on error the layer stays empty.
  virtual absl::Status AssembleRows(absl::Span<const RowSource> rows, uint64_t offset) = 0;
  // Puts this empty layer straight into `contents` (loading a saved cache).
  // All or nothing: on error the layer stays empty and holds no page.
  // INVALID_ARGUMENT when the contents break the kind's rules.
  virtual absl::Status Load(const LayerContents& contents) = 0;
  // Releases every page; offset returns to 0.
  virtual void Free() = 0;
  virtual uint64_t size_bytes() const = 0;
  // Attention kinds: themselves, for speculation (engine/layers/staged_append.h);
  // others null. A virtual call, not a cross-cast, on every speculation's begin.
  virtual StagedAppend* staged_append() { return nullptr; }
  // This layer's part of a speculation (engine/layers/layer_draft.h); it must
  // outlive the draft and not change otherwise while the draft exists. By
  // default a draft stages tokens (staged_append()); kinds that cannot stage
  // draft their own way or are FAILED_PRECONDITION.
  virtual absl::StatusOr<std::unique_ptr<LayerDraft>> MakeDraft(bool isolated);
};

template <typename Visit>
void TensorBytes::ForEachPart(uint64_t offset, uint64_t bytes, Visit&& visit) const {
  for (const absl::Span<const std::byte>& piece : pieces_) {
    if (bytes == 0) return;
    if (offset >= piece.size()) {
      offset -= piece.size();
      continue;
    }
    const uint64_t take = std::min<uint64_t>(bytes, piece.size() - offset);
    visit(piece.subspan(offset, take));
    offset = 0;
    bytes -= take;
  }
}

}  // namespace kvcache::engine
