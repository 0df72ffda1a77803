#include "engine/layers/rotating_layer.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "engine/layers/row_assembly.h"
#include "engine/layers/token_store.h"

namespace kvcache::engine {

std::vector<TokenRange> RotatingState::Ranges(uint32_t keep) const {
  const uint64_t sinks = sink_end(keep);
  const uint64_t begin = window_begin(keep);
  if (begin == sinks) {
    if (offset == 0) return {};
    return {{0, offset}};
  }
  std::vector<TokenRange> ranges;
  if (sinks > 0) ranges.push_back({0, sinks});
  if (offset > begin) ranges.push_back({begin, offset});
  return ranges;
}

absl::Status RotatingSnapshot::Read(TokenRange range, const KvOutput& out) const {
  return ReadHeld(table_, geometry_, Ranges(), range, out);
}

absl::Status RotatingSnapshot::Mapped(TokenRange range, KvMappedPieces& out) const {
  return MappedHeld(table_, geometry_, Ranges(), range, out);
}

uint64_t RotatingSnapshot::size_bytes() const { return PoolBytes(table_); }

// mlx-lm routes a single token to _update_in_place (the ring: once full, the
// token overwrites the oldest non-sink one, trimming first if a multi-token
// update left more than max_size) and longer updates to _update_concat (keep
// max_size - 1 old tokens so every new token sees a full window, then append).
std::pair<uint64_t, uint64_t> RotatingLayer::PlanEviction(uint64_t tokens) const {
  const uint64_t held = state_.held(kind_.keep);
  const uint64_t max_size = kind_.max_size;
  if (tokens > 1) {
    const uint64_t evict = held + 1 > max_size ? held + 1 - max_size : 0;
    return {evict, held - evict + tokens};
  }
  if (held < max_size) return {0, state_.offset + 1};
  uint64_t idx = held > max_size ? max_size : state_.ring_idx;
  if (idx == max_size) idx = kind_.keep;
  return {held - max_size + 1, idx + 1};
}

RotatingState RotatingLayer::Appended(uint64_t tokens) const {
  const auto [evict, ring_idx] = PlanEviction(tokens);
  RotatingState next = state_;
  if (evict > 0) next.window_start = state_.window_begin(kind_.keep) + evict;
  next.offset += tokens;
  next.ring_idx = ring_idx;
  return next;
}

void RotatingLayer::ReleaseEvicted(const RotatingState& next) {
  if (next.window_start == state_.window_start) return;
  const uint32_t p = geometry_.page_tokens;
  // Pages with no sink and no held position left in them.
  const uint64_t first = std::max(PagesFor(kind_.keep, p), state_.window_begin(kind_.keep) / p);
  for (uint64_t index = first; index < next.window_start / p; ++index) {
    table_.Set(index, gpu::kNoPage);
  }
}

absl::Status RotatingLayer::Update(const KvInput& kv) {
  RETURN_IF_ERROR(Stage(0, kv));
  Adopt(kv.tokens);
  return absl::OkStatus();
}

absl::Status RotatingLayer::Stage(uint64_t staged, const KvInput& kv) {
  writes_.ClaimBeforeWrite(table_, geometry_, state_.offset + staged);
  return WriteTokens(table_, geometry_, state_.offset + staged, kv, &writes_.right);
}

// Sliced at the end: the frozen layer holds no page of positions past it.
LayerSnapshotPtr RotatingLayer::FreezeStaged(uint64_t staged) const {
  const RotatingState next = staged == 0 ? state_ : Appended(staged);
  if (next.offset == 0) return nullptr;
  return std::make_shared<RotatingSnapshot>(
      table_.Slice(0, PagesFor(next.offset, geometry_.page_tokens)), geometry_, kind_, next, 0);
}

void RotatingLayer::Adopt(uint64_t tokens) {
  const RotatingState next = Appended(tokens);
  ReleaseEvicted(next);
  state_ = next;
}

void RotatingLayer::DropStaged() {
  table_.Truncate(PagesFor(state_.offset, geometry_.page_tokens));
}

absl::Status RotatingLayer::Read(TokenRange range, const KvOutput& out) const {
  return ReadHeld(table_, geometry_, Ranges(), range, out);
}

absl::Status RotatingLayer::CheckTrimmable() const {
  if (state_.offset < kind_.max_size) return absl::OkStatus();
  return absl::FailedPreconditionError("its rotating window has filled");
}

// Only called while nothing has been evicted (offset < max_size).
uint64_t RotatingLayer::Trim(uint64_t n) {
  n = std::min(n, state_.offset);
  state_.offset -= n;
  state_.ring_idx -= std::min(n, state_.ring_idx);
  table_.Truncate(PagesFor(state_.offset, geometry_.page_tokens));
  writes_.right = {};
  return n;
}

// The pages up to the offset: none that only staged tokens (a speculation's) hold.
absl::StatusOr<LayerSnapshotPtr> RotatingLayer::Snapshot(uint64_t from_offset) const {
  if (state_.offset <= from_offset) return nullptr;
  writes_.ClaimBeforeSharing(table_, geometry_, state_.offset);
  return std::make_shared<RotatingSnapshot>(
      table_.Slice(0, PagesFor(state_.offset, geometry_.page_tokens)), geometry_, kind_, state_,
      from_offset);
}

std::unique_ptr<Layer> RotatingLayer::TrimmedCopy(const PageTable& table, RotatingState state,
                                                  uint64_t target) const {
  PageTable copy = table.Slice(0, PagesFor(target, geometry_.page_tokens));
  state.offset = target;
  state.ring_idx = std::min(state.ring_idx, target);
  if (state.window_start > target) state.window_start = target;
  return std::unique_ptr<Layer>(new RotatingLayer(std::move(copy), geometry_, kind_, state));
}

// ollama RotatingKVCache.Restore: live rewind only while nothing has been
// evicted; a snapshot restores whole, and may be clamped only if its window
// had not wrapped (else the clamped window would be incomplete).
absl::StatusOr<std::unique_ptr<Layer>> RotatingLayer::Restored(const LayerSnapshot* snapshot,
                                                               uint64_t target) const {
  if (snapshot == nullptr) {
    if (target > state_.offset) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "target %d is beyond the live offset %d; rewinding cannot go forward", target,
          state_.offset));
    }
    if (target < state_.offset && state_.offset > kind_.max_size) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "the rotating window has wrapped (offset %d > max_size %d): a live rewind would lose "
          "the window, restore from a snapshot instead",
          state_.offset, kind_.max_size));
    }
    return TrimmedCopy(table_, state_, target);
  }
  const auto* snap = dynamic_cast<const RotatingSnapshot*>(snapshot);
  if (snap == nullptr) return absl::FailedPreconditionError("snapshot is not of a rotating layer");
  if (target > snap->to()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("target %d is beyond the snapshot's end %d", target, snap->to()));
  }
  if (target < snap->to() && snap->to() > kind_.max_size) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "restoring to %d would leave an incomplete window: the snapshot ends at %d, past "
        "max_size %d",
        target, snap->to(), kind_.max_size));
  }
  std::unique_ptr<Layer> layer = TrimmedCopy(snap->table(), snap->state(), target);
  static_cast<RotatingLayer&>(*layer).writes_.restored_from = SourceOf(*snap);
  return layer;
}

// A rotating snapshot holds the whole window, so the child supersedes the parent.
absl::StatusOr<LayerSnapshotPtr> RotatingSnapshot::MergedWith(const LayerSnapshot& child) const {
  if (dynamic_cast<const RotatingSnapshot*>(&child) == nullptr) {
    return absl::FailedPreconditionError("child is not a rotating-layer snapshot");
  }
  return child.shared_from_this();
}

// A ring cannot be cut at an arbitrary position: the whole snapshot is the child.
absl::StatusOr<std::pair<LayerSnapshotPtr, LayerSnapshotPtr>> RotatingSnapshot::SplitAt(
    uint64_t at) const {
  return std::make_pair(LayerSnapshotPtr(), shared_from_this());
}

absl::StatusOr<std::vector<const RotatingSnapshot*>> RotatingLayer::AssemblySources(
    absl::Span<const RowSource> rows) const {
  std::vector<const RotatingSnapshot*> sources;
  for (const RowSource& row : rows) {
    const auto* snap = dynamic_cast<const RotatingSnapshot*>(row.source);
    if (row.source != nullptr && (snap == nullptr || !(snap->kind() == kind_))) {
      return absl::FailedPreconditionError(
          "a source row is not of a rotating layer with this max_size and keep");
    }
    if (kind_.keep > 0 && snap != nullptr && (row.shift != 0 || row.padding != 0)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "the layer keeps %d attention sinks (rotating keep > 0), which left padding would "
          "displace: its rows can only be batched at equal lengths, without padding",
          kind_.keep));
    }
    sources.push_back(snap);
  }
  return sources;
}

// mlx-lm BatchRotatingKVCache right-aligns every row's window at the common
// offset; SharedWindowStart picks where the shared window begins (a row that
// lost tokens of its own to the ring bounds it: mlx-lm's merge keeps at most
// max_size per row too).
RotatingState RotatingLayer::AssembledState(absl::Span<const RowSource> rows,
                                            const std::vector<const RotatingSnapshot*>& sources,
                                            uint64_t offset) const {
  const uint32_t keep = kind_.keep;
  std::vector<RowWindow> windows(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    if (sources[i] == nullptr) continue;
    const RotatingState& source = sources[i]->state();
    windows[i] = {.present = true,
                  .held = {source.window_begin(keep), source.offset},
                  .own_start = std::max(rows[i].padding, source.sink_end(keep))};
  }
  const uint64_t sinks = std::min<uint64_t>(keep, offset);
  const uint64_t start = SharedWindowStart(rows, windows, sinks, offset);
  // A window that starts at the sinks is an unevicted one: window_start 0, as
  // Update leaves it (Trim relies on that).
  RotatingState state{.offset = offset, .window_start = start <= sinks ? 0 : start};
  // In temporal order, as mlx-lm leaves a buffer it has rebuilt.
  state.ring_idx = state.held(keep);
  return state;
}

absl::Status RotatingLayer::AssembleRows(absl::Span<const RowSource> rows, uint64_t offset) {
  if (state_.offset != 0 || table_.CountPages() != 0) {
    return absl::InternalError("rows can only be assembled into an empty layer");
  }
  ASSIGN_OR_RETURN(const std::vector<const RotatingSnapshot*> sources, AssemblySources(rows));
  const RotatingState state = AssembledState(rows, sources, offset);
  const std::vector<TokenRange> held = state.Ranges(kind_.keep);
  std::vector<RowCopy> copies;
  for (size_t i = 0; i < rows.size(); ++i) {
    RowCopy& copy = copies.emplace_back(RowCopy{.row = rows[i].row, .shift = rows[i].shift});
    if (sources[i] == nullptr) continue;
    copy.table = &sources[i]->table();
    copy.geometry = &sources[i]->geometry();
    copy.ranges = LandingRanges(sources[i]->Ranges(), FirstCopied(rows[i]), rows[i].shift, held);
  }
  RETURN_IF_ERROR(AssembleRowsInto(table_, geometry_, held, copies));
  state_ = state;
  return absl::OkStatus();
}

// The state mlx-lm's RotatingKVCache is in with `held` tokens at `offset`:
// tokens were evicted (held < offset) only once the ring had filled, and the
// write index lies inside the buffer, before its end only after a wrap.
static absl::Status CheckLoadable(const RotatingKind& kind, uint64_t held, uint64_t offset,
                                  uint64_t ring_idx) {
  const auto invalid = [&](const char* why) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rotating state (keep %d, max_size %d, offset %d, _idx %d, %d tokens): %s",
                        kind.keep, kind.max_size, offset, ring_idx, held, why));
  };
  if (held > offset) return invalid("holds more tokens than its offset");
  if (held < offset && held < kind.max_size) return invalid("evicted before the window filled");
  if (held == 0 && offset != 0) return invalid("an offset with no tokens");
  if (ring_idx > held) return invalid("_idx is past the buffer");
  if (ring_idx < held && (held != kind.max_size || ring_idx <= kind.keep || held == offset)) {
    return invalid("_idx before the buffer's end without a wrapped ring");
  }
  return absl::OkStatus();
}

absl::Status RotatingLayer::Load(const LayerContents& contents) {
  if (state_.offset != 0) return absl::FailedPreconditionError("only an empty layer can be loaded");
  const uint64_t held = contents.held.tokens;
  RETURN_IF_ERROR(CheckLoadable(kind_, held, contents.offset, contents.ring_idx));
  const uint64_t sinks = std::min<uint64_t>(kind_.keep, contents.offset);
  const RotatingState loaded_state{.offset = contents.offset,
                                   .window_start = contents.offset - (held - sinks),
                                   .ring_idx = contents.ring_idx};
  PageTable loaded(table_.pool());
  if (held > 0) RETURN_IF_ERROR(CheckInput(geometry_, contents.held));
  if (sinks > 0) {
    RETURN_IF_ERROR(
        WriteTokens(loaded, geometry_, 0, SliceTokens(geometry_, contents.held, 0, sinks)));
  }
  if (held > sinks) {
    RETURN_IF_ERROR(WriteTokens(loaded, geometry_, loaded_state.window_start,
                                SliceTokens(geometry_, contents.held, sinks, held - sinks)));
  }
  table_ = std::move(loaded);
  state_ = loaded_state;
  writes_ = {};
  return absl::OkStatus();
}

void RotatingLayer::Free() {
  table_.Clear();
  state_ = RotatingState{};
  writes_.right = {};
}

uint64_t RotatingLayer::size_bytes() const { return PoolBytes(table_); }

}  // namespace kvcache::engine
