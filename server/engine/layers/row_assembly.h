// Building a layer's pages for a batch operation (mlx-lm BatchKVCache merge /
// extend / filter / extract): each row of the new table takes some token
// ranges of one row of a source table, moved by a fixed shift; every other
// position the new table holds is zeros (padding).
//
//   source table (batch Bs, Ps tokens a page)       new table (batch B, P tokens a page)
//   row s, positions [a, b)  ------ + shift ----->  row r, positions [a + shift, b + shift)
//
// Rows are interleaved inside a page ([B][H][P][row bytes] per plane, see
// PageGeometry), so a token moves as one run per (head, plane), and a run
// splits wherever the source's or the new table's page ends. The bytes move
// page to page on the device (PagePool::Move); only zeros come from the host.
// Plane-generic: quantized planes (wq, scales, biases) move exactly like plain
// K and V, and zero bytes dequantize to 0.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/layers/cache_spec.h"
#include "engine/layers/layer.h"
#include "engine/layers/page_table.h"

namespace kvcache::engine {

// Where one row of a new table takes its tokens from.
struct RowCopy {
  const PageTable* table = nullptr;        // null: the row is all padding
  const PageGeometry* geometry = nullptr;  // the source's (its batch and page size)
  uint32_t row = 0;                        // the row within the source
  std::vector<TokenRange> ranges;          // source positions, ascending and disjoint
  int64_t shift = 0;                       // source position p lands at p + shift
};

// The first source position of `row` whose contents travel (RowSource).
inline uint64_t FirstCopied(const RowSource& row) { return row.copy_padding ? 0 : row.padding; }

// The parts of `source_held` at or after `first` that land (p + shift) inside
// `target_held`, in source positions. Both inputs ascending and disjoint.
std::vector<TokenRange> LandingRanges(const std::vector<TokenRange>& source_held, uint64_t first,
                                      int64_t shift, const std::vector<TokenRange>& target_held);

// What a layer that holds a suffix of positions (rotating: its window after
// the sinks; chunked: from its start position) holds of one row's source.
struct RowWindow {
  bool present = false;    // false: no source, or nothing held
  TokenRange held;         // the source's suffix
  uint64_t own_start = 0;  // where the row's own history starts in the source:
                           // after its padding (and a rotating layer's sinks)
};

// Where the suffix shared by every row of a batch at `offset` begins: where
// the earliest row's lands, but no earlier than that of a row which has lost
// tokens of its own (held.begin > own_start), so that no zeros stand where a
// row's own tokens were; never below `floor`. `offset` when nothing lands.
uint64_t SharedWindowStart(absl::Span<const RowSource> rows, absl::Span<const RowWindow> windows,
                           uint64_t floor, uint64_t offset);

// Fills the empty `table` (geometry `g`, one row per entry of `rows`) at every
// position of `held` (ascending, disjoint): row r's ranges land shifted, every
// other held position is zeros. Slots of the new pages outside `held` are left
// undefined, as a fresh page's are. All or nothing: on error `table` is
// unchanged and no page is leaked.
absl::Status AssembleRowsInto(PageTable& table, const PageGeometry& g,
                              const std::vector<TokenRange>& held, absl::Span<const RowCopy> rows);

}  // namespace kvcache::engine
