#include "engine/layers/row_assembly.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "engine/layers/token_store.h"

namespace kvcache::engine {
namespace {

using gpu::kNoPage;
using gpu::PageId;

// Slots [slot, slot + count) of one new row in one page: from the source at
// (src_page, src_slot), or zeros when src_page is kNoPage.
struct Piece {
  uint32_t slot;
  uint32_t count;
  PageId src_page;
  uint32_t src_slot;
};

struct AssemblyPlan {
  std::vector<std::pair<uint64_t, PageId>> pages;  // (index, fresh page), ascending
  std::vector<gpu::PageMove> moves;
  std::vector<gpu::WriteRun> zeros;
  std::vector<std::byte> zero_bytes;  // what the zero runs write from
};

absl::Status CheckSourceGeometry(const PageGeometry& g, const RowCopy& copy) {
  const PageGeometry& s = *copy.geometry;
  if (s.heads != g.heads || s.k_dim != g.k_dim || s.v_dim != g.v_dim ||
      s.elem_bytes != g.elem_bytes || s.bits != g.bits || s.group_size != g.group_size) {
    return absl::FailedPreconditionError(
        "a source row's layer has other dims, dtype or quantization");
  }
  if (copy.row >= s.batch) {
    return absl::InternalError(
        absl::StrFormat("source row %d of a %d-row layer", copy.row, s.batch));
  }
  return absl::OkStatus();
}

// The pieces of `copy` for new positions [begin, end), which lie in one page.
absl::Status PiecesOf(const RowCopy& copy, uint64_t begin, uint64_t end, uint32_t page_tokens,
                      std::vector<Piece>& out) {
  const auto slot = [&](uint64_t p) { return static_cast<uint32_t>(p % page_tokens); };
  uint64_t cursor = begin;
  const auto zero_until = [&](uint64_t stop) {
    if (stop > cursor)
      out.push_back({slot(cursor), static_cast<uint32_t>(stop - cursor), kNoPage, 0});
    cursor = std::max(cursor, stop);
  };
  for (const TokenRange& range : copy.ranges) {
    const int64_t land_begin = static_cast<int64_t>(range.begin) + copy.shift;
    const int64_t land_end = static_cast<int64_t>(range.end) + copy.shift;
    const int64_t lo = std::max<int64_t>(land_begin, static_cast<int64_t>(cursor));
    const int64_t hi64 = std::min<int64_t>(land_end, static_cast<int64_t>(end));
    if (lo >= hi64) continue;
    const uint64_t hi = static_cast<uint64_t>(hi64);
    zero_until(static_cast<uint64_t>(lo));
    const uint32_t src_tokens = copy.geometry->page_tokens;
    while (cursor < hi) {  // split where the source's page ends
      const uint64_t src = cursor - copy.shift;
      const uint64_t take = std::min<uint64_t>(hi - cursor, src_tokens - src % src_tokens);
      const PageId src_page = copy.table->Get(src / src_tokens);
      if (src_page == kNoPage) {
        return absl::InternalError(absl::StrFormat("no source page holds position %d", src));
      }
      out.push_back({slot(cursor), static_cast<uint32_t>(take), src_page,
                     static_cast<uint32_t>(src % src_tokens)});
      cursor += take;
    }
  }
  zero_until(end);
  return absl::OkStatus();
}

// Every (head, plane) run of one piece of new row `row` in `page`.
void AddRuns(const PageGeometry& g, uint32_t row, const RowCopy& copy, PageId page,
             const Piece& piece, AssemblyPlan& plan) {
  for (uint32_t h = 0; h < g.heads; ++h) {
    for (uint32_t plane = 0; plane < g.num_planes(); ++plane) {
      const uint64_t bytes = piece.count * g.PlaneRowBytes(plane);
      const uint64_t dst = g.PlaneOffset(plane, row * g.heads + h, piece.slot);
      if (piece.src_page == kNoPage) {
        plan.zeros.push_back({page, dst, plan.zero_bytes.data(), bytes});
      } else {
        const uint64_t src =
            copy.geometry->PlaneOffset(plane, copy.row * g.heads + h, piece.src_slot);
        plan.moves.push_back({piece.src_page, src, page, dst, bytes});
      }
    }
  }
}

// The page indices `held` touches, each once, ascending.
std::vector<uint64_t> PageIndices(const std::vector<TokenRange>& held, uint32_t page_tokens) {
  std::vector<uint64_t> indices;
  for (const TokenRange& range : held) {
    if (range.begin >= range.end) continue;
    for (uint64_t i = range.begin / page_tokens; i < PagesFor(range.end, page_tokens); ++i) {
      if (indices.empty() || indices.back() < i) indices.push_back(i);
    }
  }
  return indices;
}

absl::Status PlanPage(const PageGeometry& g, const std::vector<TokenRange>& held,
                      absl::Span<const RowCopy> rows, uint64_t index, PageId page,
                      AssemblyPlan& plan) {
  const uint64_t page_begin = index * g.page_tokens;
  const uint64_t page_end = page_begin + g.page_tokens;
  std::vector<Piece> pieces;
  for (const TokenRange& range : held) {
    const uint64_t begin = std::max(range.begin, page_begin);
    const uint64_t end = std::min(range.end, page_end);
    if (begin >= end) continue;
    for (uint32_t r = 0; r < rows.size(); ++r) {
      pieces.clear();
      if (rows[r].table == nullptr) {
        pieces.push_back({static_cast<uint32_t>(begin - page_begin),
                          static_cast<uint32_t>(end - begin), kNoPage, 0});
      } else {
        RETURN_IF_ERROR(PiecesOf(rows[r], begin, end, g.page_tokens, pieces));
      }
      for (const Piece& piece : pieces) AddRuns(g, r, rows[r], page, piece, plan);
    }
  }
  return absl::OkStatus();
}

absl::Status PlanAssembly(const PageGeometry& g, const std::vector<TokenRange>& held,
                          absl::Span<const RowCopy> rows, AssemblyPlan& plan) {
  uint64_t widest_plane = 0;
  for (uint32_t plane = 0; plane < g.num_planes(); ++plane) {
    widest_plane = std::max(widest_plane, g.PlaneRowBytes(plane));
  }
  plan.zero_bytes.assign(widest_plane * g.page_tokens, std::byte{0});
  for (const auto& [index, page] : plan.pages) {
    RETURN_IF_ERROR(PlanPage(g, held, rows, index, page, plan));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<TokenRange> LandingRanges(const std::vector<TokenRange>& source_held, uint64_t first,
                                      int64_t shift, const std::vector<TokenRange>& target_held) {
  std::vector<TokenRange> out;
  for (const TokenRange& source : source_held) {
    const int64_t begin = static_cast<int64_t>(std::max(source.begin, first));
    const int64_t end = static_cast<int64_t>(source.end);
    for (const TokenRange& target : target_held) {
      const int64_t lo = std::max(begin + shift, static_cast<int64_t>(target.begin));
      const int64_t hi = std::min(end + shift, static_cast<int64_t>(target.end));
      if (lo < hi)
        out.push_back({static_cast<uint64_t>(lo - shift), static_cast<uint64_t>(hi - shift)});
    }
  }
  return out;
}

uint64_t SharedWindowStart(absl::Span<const RowSource> rows, absl::Span<const RowWindow> windows,
                           uint64_t floor, uint64_t offset) {
  int64_t earliest = static_cast<int64_t>(offset);
  int64_t latest_cut = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!windows[i].present) continue;
    const TokenRange& held = windows[i].held;
    const int64_t first = static_cast<int64_t>(std::max(held.begin, FirstCopied(rows[i])));
    const int64_t lands = std::max<int64_t>(first + rows[i].shift, static_cast<int64_t>(floor));
    const int64_t ends = std::min<int64_t>(static_cast<int64_t>(held.end) + rows[i].shift,
                                           static_cast<int64_t>(offset));
    if (lands >= ends) continue;  // none of it lands
    earliest = std::min(earliest, lands);
    if (held.begin > windows[i].own_start) latest_cut = std::max(latest_cut, lands);
  }
  return static_cast<uint64_t>(std::max(earliest, latest_cut));
}

absl::Status AssembleRowsInto(PageTable& table, const PageGeometry& g,
                              const std::vector<TokenRange>& held, absl::Span<const RowCopy> rows) {
  if (rows.size() != g.batch) {
    return absl::InternalError(
        absl::StrFormat("%d rows assembled into a layer of batch %d", rows.size(), g.batch));
  }
  for (const RowCopy& copy : rows) {
    if (copy.table != nullptr) RETURN_IF_ERROR(CheckSourceGeometry(g, copy));
  }
  const std::vector<uint64_t> indices = PageIndices(held, g.page_tokens);
  gpu::PagePool& pool = *table.pool();
  std::vector<PageId> fresh;
  RETURN_IF_ERROR(pool.Allocate(static_cast<uint32_t>(indices.size()), fresh));
  AssemblyPlan plan;
  for (size_t i = 0; i < indices.size(); ++i) plan.pages.emplace_back(indices[i], fresh[i]);
  absl::Status status = PlanAssembly(g, held, rows, plan);
  if (status.ok()) status = pool.Move(plan.moves);
  if (status.ok()) status = pool.Write(plan.zeros);
  if (!status.ok()) {
    for (PageId page : fresh) pool.Release(page);
    return status;
  }
  for (const auto& [index, page] : plan.pages) table.Set(index, page);
  return absl::OkStatus();
}

}  // namespace kvcache::engine
