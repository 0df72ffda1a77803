#include "engine/layers/quantized_store.h"

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "engine/layers/token_store.h"

namespace kvcache::engine {
namespace {

using gpu::kNoPage;
using gpu::PageId;
using gpu::QuantRun;

// The runs of one side for positions [first, last): one per (row, head) per
// page touched, rows numbered as in the [B, H, last - first, D] tensor.
// page_of(span, ordinal) names the page of the ordinal-th span.
template <typename PageOf>
std::vector<QuantRun> SideRuns(const PageGeometry& g, bool values, uint64_t first, uint64_t last,
                               PageOf&& page_of) {
  const uint32_t plane = values ? g.first_v_plane() : 0;
  const uint64_t length = last - first;
  std::vector<QuantRun> runs;
  size_t ordinal = 0;
  ForEachPage(first, last, g.page_tokens, [&](const PageSpan& span) {
    const PageId page = page_of(span, ordinal++);
    const uint64_t token = span.index * g.page_tokens + span.begin - first;
    for (uint32_t rh = 0; rh < g.batch * g.heads; ++rh) {
      runs.push_back({.page = page,
                      .wq_offset = g.PlaneOffset(plane, rh, span.begin),
                      .scales_offset = g.PlaneOffset(plane + 1, rh, span.begin),
                      .biases_offset = g.PlaneOffset(plane + 2, rh, span.begin),
                      .first_row = uint64_t{rh} * length + token,
                      .rows = span.end - span.begin});
    }
  });
  return runs;
}

// Runs over the table's pages; INTERNAL if a page of the range is missing.
absl::StatusOr<std::vector<QuantRun>> TableRuns(const PageTable& table, const PageGeometry& g,
                                                bool values, TokenRange range) {
  bool missing = false;
  std::vector<QuantRun> runs =
      SideRuns(g, values, range.begin, range.end, [&](const PageSpan& span, size_t) {
        const PageId page = table.Get(span.index);
        missing |= page == kNoPage;
        return page;
      });
  if (missing) {
    return absl::InternalError(
        absl::StrFormat("no page holds part of tokens [%d, %d)", range.begin, range.end));
  }
  return runs;
}

absl::Status CheckSize(const char* name, uint64_t actual, uint64_t expected) {
  if (actual == expected) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: %d bytes, but the range takes %d", name, actual, expected));
}

// Runs moving each plane of `runs` between the pages and the side's packed
// buffers: ReadRuns out of the pages (PackedOutput), WriteRuns into them
// (PackedInput). INVALID_ARGUMENT naming a buffer of the wrong size.
template <typename Side, typename Run>
absl::Status AddPackedRuns(const PageGeometry& g, bool values, const std::vector<QuantRun>& runs,
                           const Side& side, uint64_t tokens, std::vector<Run>& out) {
  const gpu::QuantFormat f = SideFormat(g, values);
  const uint64_t rows = tokens * g.batch * g.heads;
  const char* names[3] = {values ? "values.wq" : "keys.wq",
                          values ? "values.scales" : "keys.scales",
                          values ? "values.biases" : "keys.biases"};
  RETURN_IF_ERROR(CheckSize(names[0], side.wq.size(), rows * f.wq_row_bytes()));
  RETURN_IF_ERROR(CheckSize(names[1], side.scales.size(), rows * f.scale_row_bytes()));
  RETURN_IF_ERROR(CheckSize(names[2], side.biases.size(), rows * f.scale_row_bytes()));
  for (const QuantRun& run : runs) {
    out.push_back({run.page, run.wq_offset, side.wq.data() + run.first_row * f.wq_row_bytes(),
                   run.rows * f.wq_row_bytes()});
    out.push_back({run.page, run.scales_offset,
                   side.scales.data() + run.first_row * f.scale_row_bytes(),
                   run.rows * f.scale_row_bytes()});
    out.push_back({run.page, run.biases_offset,
                   side.biases.data() + run.first_row * f.scale_row_bytes(),
                   run.rows * f.scale_row_bytes()});
  }
  return absl::OkStatus();
}

}  // namespace

gpu::QuantFormat SideFormat(const PageGeometry& g, bool values) {
  return {.dtype = g.dtype,
          .dim = values ? g.v_dim : g.k_dim,
          .group_size = g.group_size,
          .bits = g.bits};
}

absl::Status QuantizeTokens(gpu::PagePool& pool, const PageGeometry& g, uint64_t offset,
                            const KvInput& kv, const std::vector<PageId>& targets) {
  const auto target = [&](const PageSpan&, size_t ordinal) { return targets[ordinal]; };
  const std::vector<QuantRun> k_runs = SideRuns(g, false, offset, offset + kv.tokens, target);
  const std::vector<QuantRun> v_runs = SideRuns(g, true, offset, offset + kv.tokens, target);
  const gpu::QuantizeJob jobs[] = {{SideFormat(g, false), kv.keys.pieces(), k_runs},
                                   {SideFormat(g, true), kv.values.pieces(), v_runs}};
  return pool.Quantize(jobs);
}

absl::Status DequantizeTokens(const PageTable& table, const PageGeometry& g, TokenRange range,
                              const KvOutput& out) {
  ASSIGN_OR_RETURN(const std::vector<QuantRun> k_runs, TableRuns(table, g, false, range));
  ASSIGN_OR_RETURN(const std::vector<QuantRun> v_runs, TableRuns(table, g, true, range));
  const gpu::DequantizeJob jobs[] = {{SideFormat(g, false), k_runs, out.keys},
                                     {SideFormat(g, true), v_runs, out.values}};
  return table.pool()->Dequantize(jobs);
}

absl::Status ReadPackedTokens(const PageTable& table, const PageGeometry& g, TokenRange range,
                              const PackedOutput& out) {
  ASSIGN_OR_RETURN(const std::vector<QuantRun> k_runs, TableRuns(table, g, false, range));
  ASSIGN_OR_RETURN(const std::vector<QuantRun> v_runs, TableRuns(table, g, true, range));
  std::vector<gpu::ReadRun> reads;
  RETURN_IF_ERROR(AddPackedRuns(g, false, k_runs, out.keys, range.size(), reads));
  RETURN_IF_ERROR(AddPackedRuns(g, true, v_runs, out.values, range.size(), reads));
  return table.pool()->Read(reads);
}

absl::Status WritePackedTokens(PageTable& table, const PageGeometry& g, uint64_t tokens,
                               const PackedInput& in) {
  std::vector<PageId> pages;
  RETURN_IF_ERROR(
      table.pool()->Allocate(static_cast<uint32_t>(PagesFor(tokens, g.page_tokens)), pages));
  for (size_t index = 0; index < pages.size(); ++index) table.Set(index, pages[index]);
  const auto page_of = [&](const PageSpan& span, size_t) { return pages[span.index]; };
  const std::vector<QuantRun> k_runs = SideRuns(g, false, 0, tokens, page_of);
  const std::vector<QuantRun> v_runs = SideRuns(g, true, 0, tokens, page_of);
  std::vector<gpu::WriteRun> writes;
  RETURN_IF_ERROR(AddPackedRuns(g, false, k_runs, in.keys, tokens, writes));
  RETURN_IF_ERROR(AddPackedRuns(g, true, v_runs, in.values, tokens, writes));
  return table.pool()->Write(writes);
}

}  // namespace kvcache::engine
