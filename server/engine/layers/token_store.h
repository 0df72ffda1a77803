// Moving tokens between [B, H, L, D] host tensors and the pages of a PageTable,
// shared by every attention layer kind. Token position t lives in page t / P at
// slot t % P (PageGeometry has the byte layout inside a page).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/layers/cache_spec.h"
#include "engine/layers/layer.h"
#include "engine/layers/page_table.h"

namespace kvcache::engine {

// The slots [begin, end) of page `index` that positions [first, last) cover.
struct PageSpan {
  uint64_t index;
  uint32_t begin;
  uint32_t end;
};

// Calls visit(PageSpan) for each page that positions [first, last) touch, in order.
template <typename Visit>
void ForEachPage(uint64_t first, uint64_t last, uint32_t page_tokens, Visit&& visit) {
  for (uint64_t index = first / page_tokens; index * page_tokens < last; ++index) {
    const uint64_t base = index * page_tokens;
    visit(PageSpan{index, static_cast<uint32_t>(std::max(first, base) - base),
                   static_cast<uint32_t>(std::min(last, base + page_tokens) - base)});
  }
}

// The one page a layer may go on appending to in place while others share it
// (snapshots, registered or frozen for a Fetch): without it, each snapshot taken
// between two decode steps would cost the next step a copy of the page it
// ends in.
//
//   page `page` at `index`:  [ read by holders: < from | unread by anyone else: >= from ]
//
// Every other holder took the page from this layer while the layer's offset was
// at most `from`, and reads only below its own end; and only the holder of the
// right writes it. So writing positions >= from there changes nothing anyone else
// sees. A write grants the right on the last page it touched (from = its end);
// the right lapses once the table no longer holds `page` at `index`. A layer
// built from pages it did not write (restore, a copy) starts without one, and
// positions below `from` (after a trim or an abandoned draft) are written only
// where the page is exclusive, as before.
struct AppendRight {
  uint64_t index = 0;
  gpu::PageId page = gpu::kNoPage;
  uint64_t from = 0;
};

// Claims the right on the page holding position `offset` (the next write's)
// when no one else holds that page and the layer wrote nothing past `offset`
// that it may still show (a valid right there): called as a layer is about to
// share its pages (a snapshot, registered or frozen for a Fetch), whose
// readers stop at `offset`. A restored layer starts without a right; without
// this, its first snapshot would cost the next write a copy of the page,
// however soon the snapshots it was restored among are released.
//
// A restored layer also claims it where the one other holder of the page is
// the snapshot it was restored from (`source`), whose readers stop at its end:
// else, with that snapshot kept (it is the committed state the next round may
// go back to), every first write after a restore would copy the page.
struct RestoreSource {
  std::weak_ptr<const LayerSnapshot> snapshot;
  const PageTable* table = nullptr;  // the snapshot's pages: read only while it is locked
  uint64_t end = 0;                  // where its readers stop
};
template <typename Snapshot>
RestoreSource SourceOf(const Snapshot& snapshot) {
  return {.snapshot = snapshot.weak_from_this(), .table = &snapshot.table(), .end = snapshot.to()};
}
void ClaimRight(const PageTable& table, const PageGeometry& geometry, uint64_t offset,
                AppendRight& right, const RestoreSource* source = nullptr);

// What an attention layer keeps to append in place while others share its
// pages: its AppendRight and, until its first write after a restore, the
// snapshot it was restored from.
struct InPlaceWrites {
  AppendRight right;
  RestoreSource restored_from;

  // Before a write at `position`: the first write after a restore claims the
  // right through the snapshot (while it lives), which is then forgotten.
  void ClaimBeforeWrite(const PageTable& table, const PageGeometry& geometry, uint64_t position);
  // Before readers share the pages below `offset` (a snapshot of any kind).
  void ClaimBeforeSharing(const PageTable& table, const PageGeometry& geometry, uint64_t offset) {
    ClaimRight(table, geometry, offset, right, &restored_from);
  }
};

// INVALID_ARGUMENT naming keys / values / tokens unless `kv` holds L >= 1
// tokens of exactly this geometry.
absl::Status CheckInput(const PageGeometry& geometry, const KvInput& kv);

// Writes kv's tokens at positions [offset, offset + L) (quantized layers:
// quantized on the device). Pages are allocated as needed and shared pages
// copied first (copy-on-write), except where `right` (may be null) allows
// writing in place; on success `right` moves to the last page written. All or
// nothing: on error `table` and `right` are unchanged and no page is leaked.
absl::Status WriteTokens(PageTable& table, const PageGeometry& geometry, uint64_t offset,
                         const KvInput& kv, AppendRight* right = nullptr);

// Tokens [first, first + count) of `kv` (a [B, H, L, D] input of this
// geometry) as an input of their own: B*H pieces per side, no copy. `kv` must
// outlive the result and hold at least first + count tokens.
KvInput SliceTokens(const PageGeometry& geometry, const KvInput& kv, uint64_t first,
                    uint64_t count);

// Copies positions `range` (every page present) into `out` as [B, H, L, D].
absl::Status ReadTokens(const PageTable& table, const PageGeometry& geometry, TokenRange range,
                        const KvOutput& out);

// INVALID_ARGUMENT unless `range` is non-empty and lies inside one of `held`.
absl::Status CheckHeld(const std::vector<TokenRange>& held, TokenRange range);

// ReadTokens for a layer or snapshot that holds `held` (CheckHeld first).
// Quantized layers dequantize on the device.
absl::Status ReadHeld(const PageTable& table, const PageGeometry& geometry,
                      const std::vector<TokenRange>& held, TokenRange range, const KvOutput& out);

// Where a layer's or snapshot's `range` lies, as pieces of host-mapped pages
// in [B, H, L, D] order (LayerSnapshot::Mapped). FAILED_PRECONDITION for
// quantized layers and on the staging path.
absl::Status MappedHeld(const PageTable& table, const PageGeometry& geometry,
                        const std::vector<TokenRange>& held, TokenRange range, KvMappedPieces& out);

// A quantized layer's `range` as stored (quantized_store.h); INVALID_ARGUMENT
// for other layers, or unless CheckHeld passes.
absl::Status ReadPackedHeld(const PageTable& table, const PageGeometry& geometry,
                            const std::vector<TokenRange>& held, TokenRange range,
                            const PackedOutput& out);

// Pool bytes the table's pages take.
uint64_t PoolBytes(const PageTable& table);

// A page holding `lower`'s slots [0, split_slot) and `upper`'s from split_slot
// on: the one boundary page a restore or merge may have to copy. Returns a new
// reference (to `lower` itself when both are the same page).
absl::StatusOr<gpu::PageId> JoinBoundaryPage(gpu::PagePool& pool, const PageGeometry& geometry,
                                             gpu::PageId lower, gpu::PageId upper,
                                             uint32_t split_slot);

// `lower` below position `split`, `upper` from it on; copies at most the one
// page that straddles `split` (what restore and merge cost).
absl::StatusOr<PageTable> JoinAt(const PageGeometry& geometry, const PageTable& lower,
                                 const PageTable& upper, uint64_t split);

// Pages needed to hold positions [0, end).
inline uint64_t PagesFor(uint64_t end, uint32_t page_tokens) {
  return (end + page_tokens - 1) / page_tokens;
}

}  // namespace kvcache::engine
