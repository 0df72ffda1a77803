#include "engine/layers/chunked_layer.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "engine/layers/token_store.h"

namespace kvcache::engine {

namespace {

absl::Status BelowStart(uint64_t target, uint64_t start) {
  return absl::FailedPreconditionError(absl::StrFormat(
      "target %d is below the start position %d: the chunked layer's tokens before it were "
      "trimmed away",
      target, start));
}

}  // namespace

std::vector<TokenRange> ChunkedSnapshot::Ranges() const {
  if (held_begin() >= state_.offset) return {};
  return {{held_begin(), state_.offset}};
}

absl::Status ChunkedSnapshot::Read(TokenRange range, const KvOutput& out) const {
  return ReadHeld(table_, geometry_, Ranges(), range, out);
}

absl::Status ChunkedSnapshot::Mapped(TokenRange range, KvMappedPieces& out) const {
  return MappedHeld(table_, geometry_, Ranges(), range, out);
}

uint64_t ChunkedSnapshot::size_bytes() const { return PoolBytes(table_); }

// The merged snapshot is the child's state over [from, child.to): its start
// position, and every token from max(from, child start); those below the
// child's from come from this parent.
absl::StatusOr<LayerSnapshotPtr> ChunkedSnapshot::MergedWith(const LayerSnapshot& child) const {
  const auto* c = dynamic_cast<const ChunkedSnapshot*>(&child);
  if (c == nullptr) return absl::FailedPreconditionError("child is not a chunked-layer snapshot");
  if (to() != c->from()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "snapshots are not adjacent: parent ends at %d, child starts at %d", to(), c->from()));
  }
  const uint64_t begin = std::max(from_, c->start_position());
  if (begin >= c->from()) {
    return std::make_shared<ChunkedSnapshot>(c->table(), geometry_, c->state(), from_);
  }
  if (held_begin() > begin) {
    return absl::FailedPreconditionError(
        absl::StrFormat("the child's chunk starts at %d but the parent holds tokens only from %d",
                        begin, held_begin()));
  }
  const uint32_t p = geometry_.page_tokens;
  ASSIGN_OR_RETURN(PageTable joined,
                   JoinAt(geometry_, table_.Slice(begin / p, PagesFor(to(), p)), c->table(), to()));
  return std::make_shared<ChunkedSnapshot>(std::move(joined), geometry_, c->state(), from_);
}

absl::StatusOr<std::pair<LayerSnapshotPtr, LayerSnapshotPtr>> ChunkedSnapshot::SplitAt(
    uint64_t at) const {
  if (at <= from_) return std::make_pair(LayerSnapshotPtr(), shared_from_this());
  if (at >= to()) return std::make_pair(shared_from_this(), LayerSnapshotPtr());
  const uint32_t p = geometry_.page_tokens;
  LayerSnapshotPtr child = std::make_shared<ChunkedSnapshot>(
      table_.Slice(std::max(at, state_.start) / p, PagesFor(to(), p)), geometry_, state_, at);
  if (state_.start > at) return std::make_pair(LayerSnapshotPtr(), std::move(child));
  LayerSnapshotPtr parent =
      std::make_shared<ChunkedSnapshot>(table_.Slice(held_begin() / p, PagesFor(at, p)), geometry_,
                                        ChunkedState{.offset = at, .start = state_.start}, from_);
  return std::make_pair(std::move(parent), std::move(child));
}

uint64_t ChunkedLayer::TrimmedStart() const {
  if (state_.held() < kind_.chunk_size) return state_.start;
  return state_.offset - kind_.chunk_size;
}

void ChunkedLayer::TrimFront() {
  const uint32_t p = geometry_.page_tokens;
  const uint64_t old_start = state_.start;
  state_.start = TrimmedStart();
  for (uint64_t index = old_start / p; index < state_.start / p; ++index) {
    table_.Set(index, gpu::kNoPage);
  }
}

// The write lands at offset, above every page TrimFront releases, so writing
// first keeps a failed update from changing anything.
absl::Status ChunkedLayer::Update(const KvInput& kv) {
  RETURN_IF_ERROR(Stage(0, kv));
  Adopt(kv.tokens);
  return absl::OkStatus();
}

absl::Status ChunkedLayer::Stage(uint64_t staged, const KvInput& kv) {
  writes_.ClaimBeforeWrite(table_, geometry_, state_.offset + staged);
  if (staged == 0) {
    staged_into_new_page_ =
        table_.Get(state_.offset / geometry_.page_tokens) == gpu::kNoPage;
  }
  return WriteTokens(table_, geometry_, state_.offset + staged, kv, &writes_.right);
}

LayerSnapshotPtr ChunkedLayer::FreezeStaged(uint64_t staged) const {
  ChunkedState next = state_;
  if (staged > 0) next = {.offset = state_.offset + staged, .start = TrimmedStart()};
  if (next.offset == 0) return nullptr;
  const uint32_t p = geometry_.page_tokens;
  return std::make_shared<ChunkedSnapshot>(table_.Slice(next.start / p, PagesFor(next.offset, p)),
                                           geometry_, next, 0);
}

void ChunkedLayer::Adopt(uint64_t tokens) {
  TrimFront();
  state_.offset += tokens;
  staged_into_new_page_ = false;
}

// The pages up to the offset stay, but the one holding the offset only if the
// layer held it before the first staged token: an empty chunk (start ==
// offset) need not hold that page, and then it holds staged positions only.
void ChunkedLayer::DropStaged() {
  const uint32_t p = geometry_.page_tokens;
  table_.Truncate(staged_into_new_page_ ? state_.offset / p : PagesFor(state_.offset, p));
  staged_into_new_page_ = false;
}

std::vector<TokenRange> ChunkedLayer::Ranges() const {
  if (state_.held() == 0) return {};
  return {{state_.start, state_.offset}};
}

absl::Status ChunkedLayer::Read(TokenRange range, const KvOutput& out) const {
  return ReadHeld(table_, geometry_, Ranges(), range, out);
}

uint64_t ChunkedLayer::Trim(uint64_t n) {
  n = std::min(n, state_.held());
  state_.offset -= n;
  table_.Truncate(PagesFor(state_.offset, geometry_.page_tokens));
  writes_.right = {};
  return n;
}

absl::StatusOr<LayerSnapshotPtr> ChunkedLayer::Snapshot(uint64_t from_offset) const {
  if (state_.offset <= from_offset) return nullptr;
  writes_.ClaimBeforeSharing(table_, geometry_, state_.offset);
  const uint32_t p = geometry_.page_tokens;
  const uint64_t begin = std::max(from_offset, state_.start);
  return std::make_shared<ChunkedSnapshot>(table_.Slice(begin / p, PagesFor(state_.offset, p)),
                                           geometry_, state_, from_offset);
}

std::unique_ptr<Layer> ChunkedLayer::Make(const PageTable& table, ChunkedState state,
                                          uint64_t target) const {
  const uint32_t p = geometry_.page_tokens;
  state.offset = target;
  return std::unique_ptr<Layer>(
      new ChunkedLayer(table.Slice(state.start / p, PagesFor(target, p)), geometry_, kind_, state));
}

absl::StatusOr<std::unique_ptr<Layer>> ChunkedLayer::Restored(const LayerSnapshot* snapshot,
                                                              uint64_t target) const {
  if (snapshot == nullptr) {
    if (target > state_.offset) {
      return absl::FailedPreconditionError(
          absl::StrFormat("target %d is beyond the live offset %d; rewinding cannot go forward",
                          target, state_.offset));
    }
    if (target < state_.start) return BelowStart(target, state_.start);
    return Make(table_, state_, target);
  }
  const auto* snap = dynamic_cast<const ChunkedSnapshot*>(snapshot);
  if (snap == nullptr) return absl::FailedPreconditionError("snapshot is not of a chunked layer");
  return RestoredFrom(*snap, target);
}

// The snapshot's state, trimmed to target; the tokens below its first held
// one come from the live layer unless it holds its whole chunk.
absl::StatusOr<std::unique_ptr<Layer>> ChunkedLayer::RestoredFrom(const ChunkedSnapshot& snap,
                                                                  uint64_t target) const {
  const ChunkedState& state = snap.state();
  if (target > snap.to()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("target %d is beyond the snapshot's end %d", target, snap.to()));
  }
  if (target < state.start) return BelowStart(target, state.start);
  if (state.start >= snap.from()) return RestoredLayer(snap, Make(snap.table(), state, target));
  if (state_.start > state.start) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the snapshot needs the cache's tokens from its start position %d, but the cache's "
        "front was trimmed to %d",
        state.start, state_.start));
  }
  if (state_.offset < snap.from()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("the cache holds %d tokens, fewer than the snapshot's start %d",
                        state_.offset, snap.from()));
  }
  if (target <= snap.from()) return Make(table_, state, target);
  const uint32_t p = geometry_.page_tokens;
  ASSIGN_OR_RETURN(PageTable joined, JoinAt(geometry_, table_.Slice(0, PagesFor(snap.from(), p)),
                                            snap.table(), snap.from()));
  return RestoredLayer(snap, Make(joined, state, target));
}

std::unique_ptr<Layer> ChunkedLayer::RestoredLayer(const ChunkedSnapshot& snap,
                                                   std::unique_ptr<Layer> layer) {
  static_cast<ChunkedLayer&>(*layer).writes_.restored_from = SourceOf(snap);
  return layer;
}

absl::Status ChunkedLayer::Load(const LayerContents& contents) {
  if (state_.offset != 0) return absl::FailedPreconditionError("only an empty layer can be loaded");
  const ChunkedState loaded_state{.offset = contents.offset, .start = contents.start_position};
  if (loaded_state.start > loaded_state.offset || contents.held.tokens != loaded_state.held()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("chunked state (offset %d, start_position %d) with %d tokens",
                        loaded_state.offset, loaded_state.start, contents.held.tokens));
  }
  PageTable loaded(table_.pool());
  if (loaded_state.held() > 0) {
    RETURN_IF_ERROR(CheckInput(geometry_, contents.held));
    RETURN_IF_ERROR(WriteTokens(loaded, geometry_, loaded_state.start, contents.held));
  }
  table_ = std::move(loaded);
  state_ = loaded_state;
  writes_ = {};
  return absl::OkStatus();
}

void ChunkedLayer::Free() {
  table_.Clear();
  state_ = ChunkedState{};
  writes_.right = {};
}

uint64_t ChunkedLayer::size_bytes() const { return PoolBytes(table_); }

}  // namespace kvcache::engine
