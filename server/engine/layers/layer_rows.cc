// Layer::AssembleRows of the chunked and recurrent layers (the batch
// operations, engine/batch/batch_ops.h), kept apart from those layers' own rules.
#include <algorithm>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "engine/layers/chunked_layer.h"
#include "engine/layers/recurrent_layer.h"
#include "engine/layers/row_assembly.h"

namespace kvcache::engine {
namespace {

absl::Status NotEmpty() {
  return absl::InternalError("rows can only be assembled into an empty layer");
}

// A state stream (conv, then delta) spread over pages of `page_bytes`.
struct StreamPart {
  uint64_t offset;  // byte offset in the stream
  uint64_t bytes;
};

// Copies `bytes` from `src` (stream offset `from`) to `dst` (stream offset
// `to`), split wherever either side's page ends.
void AddStreamMoves(const PageTable& src, uint64_t from, const std::vector<gpu::PageId>& dst,
                    uint64_t to, uint64_t bytes, uint64_t page_bytes,
                    std::vector<gpu::PageMove>& moves) {
  for (uint64_t done = 0; done < bytes;) {
    const uint64_t s = from + done;
    const uint64_t d = to + done;
    const uint64_t take =
        std::min({bytes - done, page_bytes - s % page_bytes, page_bytes - d % page_bytes});
    moves.push_back(
        {src.Get(s / page_bytes), s % page_bytes, dst[d / page_bytes], d % page_bytes, take});
    done += take;
  }
}

void AddStreamZeros(const std::vector<gpu::PageId>& dst, uint64_t to, uint64_t bytes,
                    uint64_t page_bytes, const std::byte* zeros, std::vector<gpu::WriteRun>& runs) {
  for (uint64_t done = 0; done < bytes;) {
    const uint64_t d = to + done;
    const uint64_t take = std::min(bytes - done, page_bytes - d % page_bytes);
    runs.push_back({dst[d / page_bytes], d % page_bytes, zeros, take});
    done += take;
  }
}

// The moves and zero writes that fill `fresh` (a whole state) with each new
// row's conv and delta rows: from its source row, or zeros without a source.
void PlanStateRows(const StateGeometry& g, absl::Span<const RowSource> rows,
                   const std::vector<const RecurrentSnapshot*>& sources,
                   const std::vector<gpu::PageId>& fresh, const std::byte* zeros,
                   std::vector<gpu::PageMove>& moves, std::vector<gpu::WriteRun>& runs) {
  const uint64_t page = g.page_bytes;
  const uint64_t conv_row = g.conv_bytes() / g.batch;
  const uint64_t delta_row = g.delta_bytes() / g.batch;
  for (uint32_t r = 0; r < rows.size(); ++r) {
    const StreamPart conv{r * conv_row, conv_row};
    const StreamPart delta{g.conv_bytes() + r * delta_row, delta_row};
    if (sources[r] == nullptr) {
      for (const StreamPart& part : {conv, delta}) {
        AddStreamZeros(fresh, part.offset, part.bytes, page, zeros, runs);
      }
      continue;
    }
    const PageTable& src = sources[r]->pages();
    const uint64_t src_delta = sources[r]->geometry().conv_bytes();
    AddStreamMoves(src, rows[r].row * conv_row, fresh, conv.offset, conv_row, page, moves);
    AddStreamMoves(src, src_delta + rows[r].row * delta_row, fresh, delta.offset, delta_row, page,
                   moves);
  }
}

bool SameState(const StateGeometry& a, const StateGeometry& b) {
  return a.kind == b.kind && a.elem_bytes == b.elem_bytes && a.page_bytes == b.page_bytes;
}

}  // namespace

// mlx-lm has no batched ChunkedKVCache: rows are right-aligned as in
// BatchKVCache, and the shared start position is where SharedWindowStart puts
// it (no zeros where a row's own tokens were trimmed from the front).
absl::Status ChunkedLayer::AssembleRows(absl::Span<const RowSource> rows, uint64_t offset) {
  if (state_.offset != 0 || table_.CountPages() != 0) return NotEmpty();
  std::vector<const ChunkedSnapshot*> sources;
  std::vector<RowWindow> windows(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto* snap = dynamic_cast<const ChunkedSnapshot*>(rows[i].source);
    if (rows[i].source != nullptr && snap == nullptr) {
      return absl::FailedPreconditionError("a source row is not of a chunked layer");
    }
    sources.push_back(snap);
    if (snap != nullptr && snap->held_begin() < snap->to()) {
      windows[i] = {
          .present = true, .held = {snap->held_begin(), snap->to()}, .own_start = rows[i].padding};
    }
  }
  const uint64_t start = SharedWindowStart(rows, windows, 0, offset);
  std::vector<TokenRange> held;
  if (start < offset) held.push_back({start, offset});
  std::vector<RowCopy> copies;
  for (size_t i = 0; i < rows.size(); ++i) {
    RowCopy& copy = copies.emplace_back(RowCopy{.row = rows[i].row, .shift = rows[i].shift});
    if (sources[i] == nullptr) continue;
    copy.table = &sources[i]->table();
    copy.geometry = &sources[i]->geometry();
    copy.ranges = LandingRanges(sources[i]->Ranges(), FirstCopied(rows[i]), rows[i].shift, held);
  }
  RETURN_IF_ERROR(AssembleRowsInto(table_, geometry_, held, copies));
  state_ = ChunkedState{.offset = offset, .start = start};
  return absl::OkStatus();
}

// mlx-lm ArraysCache states batch by row: each new row's conv and delta rows
// are its source row's, zeros where the source has no state yet. A state has
// no positions, so shifts and padding do not apply; the layer takes the
// batch's offset. No source with a state: no state (reads as zeros).
absl::Status RecurrentLayer::AssembleRows(absl::Span<const RowSource> rows, uint64_t offset) {
  if (offset_ != 0 || pages_.CountPages() != 0) return NotEmpty();
  std::vector<const RecurrentSnapshot*> sources;
  for (const RowSource& row : rows) {
    const auto* snap = dynamic_cast<const RecurrentSnapshot*>(row.source);
    if (row.source != nullptr && (snap == nullptr || !SameState(snap->geometry(), geometry_))) {
      return absl::FailedPreconditionError(
          "a source row is not of a recurrent layer like this one");
    }
    sources.push_back(snap != nullptr && snap->pages().CountPages() > 0 ? snap : nullptr);
  }
  if (std::all_of(sources.begin(), sources.end(), [](auto* s) { return s == nullptr; })) {
    offset_ = offset;
    return absl::OkStatus();
  }
  gpu::PagePool& pool = *pages_.pool();
  std::vector<gpu::PageId> fresh;
  RETURN_IF_ERROR(pool.Allocate(static_cast<uint32_t>(geometry_.pages()), fresh));
  const std::vector<std::byte> zeros(geometry_.page_bytes);
  std::vector<gpu::PageMove> moves;
  std::vector<gpu::WriteRun> runs;
  PlanStateRows(geometry_, rows, sources, fresh, zeros.data(), moves, runs);
  absl::Status status = pool.Move(moves);
  if (status.ok()) status = pool.Write(runs);
  if (!status.ok()) {
    for (gpu::PageId id : fresh) pool.Release(id);
    return status;
  }
  for (uint64_t i = 0; i < fresh.size(); ++i) pages_.Set(i, fresh[i]);
  offset_ = offset;
  return absl::OkStatus();
}

}  // namespace kvcache::engine
