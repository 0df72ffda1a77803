#include "engine/layers/standard_layer.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "engine/layers/quantized_store.h"
#include "engine/layers/row_assembly.h"
#include "engine/layers/token_store.h"

namespace kvcache::engine {

absl::Status StandardSnapshot::Read(TokenRange range, const KvOutput& out) const {
  return ReadHeld(table_, geometry_, Ranges(), range, out);
}

absl::Status StandardSnapshot::Mapped(TokenRange range, KvMappedPieces& out) const {
  return MappedHeld(table_, geometry_, Ranges(), range, out);
}

absl::Status StandardSnapshot::ReadPacked(TokenRange range, const PackedOutput& out) const {
  return ReadPackedHeld(table_, geometry_, Ranges(), range, out);
}

uint64_t StandardSnapshot::size_bytes() const { return PoolBytes(table_); }

absl::Status StandardLayer::Update(const KvInput& kv) {
  RETURN_IF_ERROR(Stage(0, kv));
  Adopt(kv.tokens);
  return absl::OkStatus();
}

absl::Status StandardLayer::Stage(uint64_t staged, const KvInput& kv) {
  writes_.ClaimBeforeWrite(table_, geometry_, offset_ + staged);
  return WriteTokens(table_, geometry_, offset_ + staged, kv, &writes_.right);
}

LayerSnapshotPtr StandardLayer::FreezeStaged(uint64_t staged) const {
  const uint64_t end = offset_ + staged;
  if (end == 0) return nullptr;
  return std::make_shared<StandardSnapshot>(table_.Slice(0, PagesFor(end, geometry_.page_tokens)),
                                            geometry_, 0, end);
}

void StandardLayer::DropStaged() { table_.Truncate(PagesFor(offset_, geometry_.page_tokens)); }

std::vector<TokenRange> StandardLayer::Ranges() const {
  if (offset_ == 0) return {};
  return {{0, offset_}};
}

absl::Status StandardLayer::Read(TokenRange range, const KvOutput& out) const {
  return ReadHeld(table_, geometry_, Ranges(), range, out);
}

uint64_t StandardLayer::Trim(uint64_t n) {
  n = std::min(n, offset_);
  offset_ -= n;
  table_.Truncate(PagesFor(offset_, geometry_.page_tokens));
  writes_.right = {};
  return n;
}

absl::StatusOr<LayerSnapshotPtr> StandardLayer::Snapshot(uint64_t from_offset) const {
  if (offset_ <= from_offset) return nullptr;
  writes_.ClaimBeforeSharing(table_, geometry_, offset_);
  const uint32_t p = geometry_.page_tokens;
  return std::make_shared<StandardSnapshot>(table_.Slice(from_offset / p, PagesFor(offset_, p)),
                                            geometry_, from_offset, offset_);
}

// ollama KVCache.Restore: a null snapshot rewinds the live state; a snapshot
// [from, to) needs the live cache to hold its prefix [0, from), then replaces
// [from, ...) with the snapshot and clamps to target.
absl::StatusOr<std::unique_ptr<Layer>> StandardLayer::Restored(const LayerSnapshot* snapshot,
                                                               uint64_t target) const {
  const uint32_t p = geometry_.page_tokens;
  const auto rewound = [&](uint64_t to) {
    return std::unique_ptr<Layer>(new StandardLayer(table_.Slice(0, PagesFor(to, p)), geometry_, to));
  };
  if (snapshot == nullptr) {
    if (target > offset_) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "target %d is beyond the live offset %d; rewinding cannot go forward", target, offset_));
    }
    return rewound(target);
  }
  const auto* snap = dynamic_cast<const StandardSnapshot*>(snapshot);
  if (snap == nullptr) return absl::FailedPreconditionError("snapshot is not of a standard layer");
  if (target > snap->to()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("target %d is beyond the snapshot's end %d", target, snap->to()));
  }
  if (offset_ < snap->from()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the cache holds %d tokens, fewer than the snapshot's start %d", offset_, snap->from()));
  }
  if (target <= snap->from()) return rewound(target);
  ASSIGN_OR_RETURN(PageTable joined, JoinAt(geometry_, table_.Slice(0, PagesFor(snap->from(), p)),
                                            snap->table(), snap->from()));
  joined.Truncate(PagesFor(target, p));
  auto layer = std::unique_ptr<StandardLayer>(new StandardLayer(std::move(joined), geometry_, target));
  layer->writes_.restored_from = SourceOf(*snap);
  return std::unique_ptr<Layer>(std::move(layer));
}

absl::StatusOr<LayerSnapshotPtr> StandardSnapshot::MergedWith(const LayerSnapshot& child) const {
  const auto* c = dynamic_cast<const StandardSnapshot*>(&child);
  if (c == nullptr) return absl::FailedPreconditionError("child is not a standard-layer snapshot");
  if (to_ != c->from()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "snapshots are not adjacent: parent ends at %d, child starts at %d", to_, c->from()));
  }
  ASSIGN_OR_RETURN(PageTable joined, JoinAt(geometry_, table_, c->table(), to_));
  return std::make_shared<StandardSnapshot>(std::move(joined), geometry_, from_, c->to());
}

absl::StatusOr<std::pair<LayerSnapshotPtr, LayerSnapshotPtr>> StandardSnapshot::SplitAt(
    uint64_t at) const {
  if (at <= from_) return std::make_pair(LayerSnapshotPtr(), shared_from_this());
  if (at >= to_) return std::make_pair(shared_from_this(), LayerSnapshotPtr());
  const uint32_t p = geometry_.page_tokens;
  auto parent = std::make_shared<StandardSnapshot>(table_.Slice(from_ / p, PagesFor(at, p)),
                                                   geometry_, from_, at);
  auto child = std::make_shared<StandardSnapshot>(table_.Slice(at / p, PagesFor(to_, p)),
                                                  geometry_, at, to_);
  return std::make_pair(LayerSnapshotPtr(std::move(parent)), LayerSnapshotPtr(std::move(child)));
}

// mlx-lm BatchKVCache keeps every position [0, _idx) of every row; padding
// is zeros unless a row's padding travels with it.
absl::Status StandardLayer::AssembleRows(absl::Span<const RowSource> rows, uint64_t offset) {
  if (offset_ != 0 || table_.CountPages() != 0) {
    return absl::InternalError("rows can only be assembled into an empty layer");
  }
  std::vector<TokenRange> held;
  if (offset > 0) held.push_back({0, offset});
  std::vector<RowCopy> copies;
  for (const RowSource& row : rows) {
    RowCopy& copy = copies.emplace_back(RowCopy{.row = row.row, .shift = row.shift});
    if (row.source == nullptr) continue;
    const auto* snap = dynamic_cast<const StandardSnapshot*>(row.source);
    if (snap == nullptr) {
      return absl::FailedPreconditionError("a source row is not of a standard layer");
    }
    copy.table = &snap->table();
    copy.geometry = &snap->geometry();
    copy.ranges = LandingRanges(snap->Ranges(), FirstCopied(row), row.shift, held);
  }
  RETURN_IF_ERROR(AssembleRowsInto(table_, geometry_, held, copies));
  offset_ = offset;
  return absl::OkStatus();
}

absl::Status StandardLayer::Load(const LayerContents& contents) {
  if (offset_ != 0) return absl::FailedPreconditionError("only an empty layer can be loaded");
  PageTable loaded(table_.pool());
  if (geometry_.quantized()) {
    if (contents.packed == nullptr || contents.packed_tokens != contents.offset) {
      return absl::InvalidArgumentError(
          absl::StrFormat("a quantized layer at offset %d needs its %d tokens packed",
                          contents.offset, contents.offset));
    }
    if (contents.offset > 0) {
      RETURN_IF_ERROR(WritePackedTokens(loaded, geometry_, contents.offset, *contents.packed));
    }
  } else {
    if (contents.held.tokens != contents.offset) {
      return absl::InvalidArgumentError(absl::StrFormat("keys: %d tokens for a layer at offset %d",
                                                        contents.held.tokens, contents.offset));
    }
    if (contents.offset > 0) {
      RETURN_IF_ERROR(CheckInput(geometry_, contents.held));
      RETURN_IF_ERROR(WriteTokens(loaded, geometry_, 0, contents.held));
    }
  }
  table_ = std::move(loaded);
  offset_ = contents.offset;
  writes_ = {};
  return absl::OkStatus();
}

void StandardLayer::Free() {
  table_.Clear();
  offset_ = 0;
  writes_.right = {};
}

uint64_t StandardLayer::size_bytes() const { return PoolBytes(table_); }

}  // namespace kvcache::engine
