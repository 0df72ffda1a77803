#include "engine/layers/token_store.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "engine/layers/quantized_store.h"

namespace kvcache::engine {
namespace {

using gpu::kNoPage;
using gpu::PageId;

struct WritePlan {
  std::vector<std::pair<uint64_t, PageId>> fresh;  // (index, new page) to install
  std::vector<gpu::PageCopy> cow_copies;
  std::vector<gpu::WriteRun> runs;
};

// Whether the span may be written in the page the table holds there: no one
// else holds that page, or the layer's append right covers the span.
bool WritableInPlace(const PageTable& table, const PageGeometry& g, const PageSpan& span,
                     const AppendRight* right) {
  const PageId page = table.Get(span.index);
  if (page == kNoPage) return false;
  if (table.Exclusive(span.index)) return true;
  return right != nullptr && right->index == span.index && right->page == page &&
         span.index * g.page_tokens + span.begin >= right->from;
}

// Picks the page each touched index is written in: the existing one when it is
// writable in place, else a fresh page (a copy of the old one when it has
// tokens before `offset` that must survive).
absl::Status PlanTargets(const PageTable& table, const PageGeometry& g, uint64_t offset,
                         uint64_t tokens, const AppendRight* right, WritePlan& plan,
                         std::vector<PageId>& targets) {
  std::vector<uint64_t> needs_fresh;
  ForEachPage(offset, offset + tokens, g.page_tokens, [&](const PageSpan& span) {
    targets.push_back(table.Get(span.index));
    if (!WritableInPlace(table, g, span, right)) needs_fresh.push_back(targets.size() - 1);
  });
  std::vector<PageId> fresh;
  RETURN_IF_ERROR(table.pool()->Allocate(static_cast<uint32_t>(needs_fresh.size()), fresh));
  const uint64_t first_index = offset / g.page_tokens;
  for (size_t i = 0; i < needs_fresh.size(); ++i) {
    const size_t t = needs_fresh[i];
    const uint64_t index = first_index + t;
    if (targets[t] != kNoPage && index * g.page_tokens < offset) {
      plan.cow_copies.push_back({targets[t], fresh[i], 0, g.used_bytes()});
    }
    targets[t] = fresh[i];
    plan.fresh.emplace_back(index, fresh[i]);
  }
  return absl::OkStatus();
}

// Appends runs writing `bytes` bytes of `source` from `src_offset` into `page`
// at `dst_offset`: one run per piece of the source that the range touches.
void AddRuns(PageId page, uint64_t dst_offset, const TensorBytes& source, uint64_t src_offset,
             uint64_t bytes, std::vector<gpu::WriteRun>& runs) {
  source.ForEachPart(src_offset, bytes, [&](absl::Span<const std::byte> part) {
    runs.push_back({page, dst_offset, part.data(), part.size()});
    dst_offset += part.size();
  });
}

void PlanRuns(const PageGeometry& g, uint64_t offset, const KvInput& kv,
              const std::vector<PageId>& targets, WritePlan& plan) {
  const uint32_t row_heads = g.batch * g.heads;
  const uint64_t k_token = uint64_t{g.k_dim} * g.elem_bytes;
  const uint64_t v_token = uint64_t{g.v_dim} * g.elem_bytes;
  size_t t = 0;
  ForEachPage(offset, offset + kv.tokens, g.page_tokens, [&](const PageSpan& span) {
    const uint64_t token = span.index * g.page_tokens + span.begin - offset;
    const uint64_t count = span.end - span.begin;
    for (uint32_t rh = 0; rh < row_heads; ++rh) {
      const uint64_t src = uint64_t{rh} * kv.tokens + token;
      AddRuns(targets[t], g.KOffset(rh, span.begin), kv.keys, src * k_token, count * k_token,
              plan.runs);
      AddRuns(targets[t], g.VOffset(rh, span.begin), kv.values, src * v_token, count * v_token,
              plan.runs);
    }
    ++t;
  });
}

}  // namespace

KvInput SliceTokens(const PageGeometry& g, const KvInput& kv, uint64_t first, uint64_t count) {
  KvInput slice;
  slice.tokens = count;
  const uint64_t k_token = uint64_t{g.k_dim} * g.elem_bytes;
  const uint64_t v_token = uint64_t{g.v_dim} * g.elem_bytes;
  for (uint64_t rh = 0; rh < uint64_t{g.batch} * g.heads; ++rh) {
    const uint64_t token = rh * kv.tokens + first;
    kv.keys.ForEachPart(token * k_token, count * k_token,
                        [&](absl::Span<const std::byte> part) { slice.keys.Append(part); });
    kv.values.ForEachPart(token * v_token, count * v_token,
                          [&](absl::Span<const std::byte> part) { slice.values.Append(part); });
  }
  return slice;
}

absl::Status CheckInput(const PageGeometry& g, const KvInput& kv) {
  if (kv.tokens == 0) return absl::InvalidArgumentError("tokens: an update needs at least one token");
  if (kv.keys.size() != g.KBytes(kv.tokens)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "keys: %d bytes, but [B=%d, H=%d, L=%d, D=%d] of %d-byte elements is %d bytes",
        kv.keys.size(), g.batch, g.heads, kv.tokens, g.k_dim, g.elem_bytes, g.KBytes(kv.tokens)));
  }
  if (kv.values.size() != g.VBytes(kv.tokens)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "values: %d bytes, but [B=%d, H=%d, L=%d, D=%d] of %d-byte elements is %d bytes",
        kv.values.size(), g.batch, g.heads, kv.tokens, g.v_dim, g.elem_bytes,
        g.VBytes(kv.tokens)));
  }
  return absl::OkStatus();
}

// A right still valid on this page or a later one stays: the layer wrote up to
// its `from` (staged tokens of an open speculation, read through its frozen
// snapshots later) and a claim from `offset` would forget those positions.
void ClaimRight(const PageTable& table, const PageGeometry& g, uint64_t offset,
                AppendRight& right, const RestoreSource* source) {
  const uint64_t index = offset / g.page_tokens;
  if (offset % g.page_tokens == 0) return;  // the next write starts a page of its own
  const bool valid = right.page != kNoPage && table.Get(right.index) == right.page;
  if (valid && right.index >= index) return;
  bool alone = table.Exclusive(index);
  if (!alone && source != nullptr && offset >= source->end) {
    const std::shared_ptr<const LayerSnapshot> alive = source->snapshot.lock();
    alone = alive != nullptr && table.SharedOnlyWith(index, *source->table);
  }
  if (alone) right = {.index = index, .page = table.Get(index), .from = offset};
}

void InPlaceWrites::ClaimBeforeWrite(const PageTable& table, const PageGeometry& geometry,
                                     uint64_t position) {
  if (restored_from.snapshot.expired()) return;
  ClaimRight(table, geometry, position, right, &restored_from);
  restored_from = {};
}

absl::Status WriteTokens(PageTable& table, const PageGeometry& g, uint64_t offset,
                         const KvInput& kv, AppendRight* right) {
  RETURN_IF_ERROR(CheckInput(g, kv));
  WritePlan plan;
  std::vector<PageId> targets;
  RETURN_IF_ERROR(PlanTargets(table, g, offset, kv.tokens, right, plan, targets));
  gpu::PagePool& pool = *table.pool();
  absl::Status status = pool.Copy(plan.cow_copies);
  if (status.ok() && g.quantized()) {
    status = QuantizeTokens(pool, g, offset, kv, targets);
  } else if (status.ok()) {
    PlanRuns(g, offset, kv, targets, plan);
    status = pool.Write(plan.runs);
  }
  if (!status.ok()) {
    for (const auto& [index, page] : plan.fresh) pool.Release(page);
    return status;
  }
  for (const auto& [index, page] : plan.fresh) table.Set(index, page);
  if (right != nullptr) {
    *right = {.index = (offset + kv.tokens - 1) / g.page_tokens, .page = targets.back(),
              .from = offset + kv.tokens};
  }
  return absl::OkStatus();
}

namespace {

// Where positions `range` lie in pages, per (row, head) and page, in
// [B, H, L, D] order: keys' runs and values' runs, each run's dst the byte
// offset in the output (not a pointer yet). INTERNAL if a page is missing.
absl::Status TokenRuns(const PageTable& table, const PageGeometry& g, TokenRange range,
                       std::vector<gpu::ReadRun>& keys, std::vector<gpu::ReadRun>& values) {
  const uint64_t length = range.size();
  const uint32_t row_heads = g.batch * g.heads;
  const uint64_t k_token = uint64_t{g.k_dim} * g.elem_bytes;
  const uint64_t v_token = uint64_t{g.v_dim} * g.elem_bytes;
  const auto at = [](uint64_t offset) { return reinterpret_cast<void*>(offset); };
  bool missing = false;
  for (uint32_t rh = 0; rh < row_heads; ++rh) {
    ForEachPage(range.begin, range.end, g.page_tokens, [&](const PageSpan& span) {
      const PageId page = table.Get(span.index);
      missing |= page == kNoPage;
      const uint64_t token = span.index * g.page_tokens + span.begin - range.begin;
      const uint64_t count = span.end - span.begin;
      const uint64_t dst = uint64_t{rh} * length + token;
      keys.push_back({page, g.KOffset(rh, span.begin), at(dst * k_token), count * k_token});
      values.push_back({page, g.VOffset(rh, span.begin), at(dst * v_token), count * v_token});
    });
  }
  if (missing) {
    return absl::InternalError(absl::StrFormat("no page holds part of tokens [%d, %d)",
                                               range.begin, range.end));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadTokens(const PageTable& table, const PageGeometry& g, TokenRange range,
                        const KvOutput& out) {
  const uint64_t length = range.size();
  if (out.keys.size() != g.KBytes(length) || out.values.size() != g.VBytes(length)) {
    return absl::InvalidArgumentError("read buffers do not match the range's [B, H, L, D] size");
  }
  if (g.quantized()) return DequantizeTokens(table, g, range, out);
  std::vector<gpu::ReadRun> runs, value_runs;
  RETURN_IF_ERROR(TokenRuns(table, g, range, runs, value_runs));
  for (gpu::ReadRun& run : runs) run.dst = out.keys.data() + reinterpret_cast<uint64_t>(run.dst);
  for (gpu::ReadRun& run : value_runs) {
    run.dst = out.values.data() + reinterpret_cast<uint64_t>(run.dst);
    runs.push_back(run);
  }
  return table.pool()->Read(runs);
}

absl::Status MappedHeld(const PageTable& table, const PageGeometry& geometry,
                        const std::vector<TokenRange>& held, TokenRange range,
                        KvMappedPieces& out) {
  RETURN_IF_ERROR(CheckHeld(held, range));
  if (geometry.quantized()) {
    return absl::FailedPreconditionError("a quantized layer's tokens are read by dequantizing");
  }
  std::vector<gpu::ReadRun> key_runs, value_runs;
  RETURN_IF_ERROR(TokenRuns(table, geometry, range, key_runs, value_runs));
  out.keys.clear();
  out.values.clear();
  RETURN_IF_ERROR(table.pool()->Mapped(key_runs, out.keys));
  return table.pool()->Mapped(value_runs, out.values);
}

absl::Status CheckHeld(const std::vector<TokenRange>& held, TokenRange range) {
  for (const TokenRange& h : held) {
    if (range.begin >= h.begin && range.end <= h.end && range.begin < range.end) {
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("tokens [%d, %d) are not held", range.begin, range.end));
}

absl::Status ReadHeld(const PageTable& table, const PageGeometry& geometry,
                      const std::vector<TokenRange>& held, TokenRange range, const KvOutput& out) {
  RETURN_IF_ERROR(CheckHeld(held, range));
  return ReadTokens(table, geometry, range, out);
}

absl::Status ReadPackedHeld(const PageTable& table, const PageGeometry& geometry,
                            const std::vector<TokenRange>& held, TokenRange range,
                            const PackedOutput& out) {
  if (!geometry.quantized()) {
    return absl::InvalidArgumentError("packed: only quantized layers have a packed form");
  }
  RETURN_IF_ERROR(CheckHeld(held, range));
  return ReadPackedTokens(table, geometry, range, out);
}

uint64_t PoolBytes(const PageTable& table) {
  return table.CountPages() * table.pool()->page_bytes();
}

absl::StatusOr<PageId> JoinBoundaryPage(gpu::PagePool& pool, const PageGeometry& g, PageId lower,
                                        PageId upper, uint32_t split_slot) {
  if (lower == upper) {
    pool.Retain(lower);
    return lower;
  }
  std::vector<PageId> fresh;
  RETURN_IF_ERROR(pool.Allocate(1, fresh));
  // Per (row, head): slots [0, split) from `lower`, [split, P) from `upper`;
  // disjoint runs, so the copies may run in any order.
  std::vector<gpu::PageCopy> copies;
  const uint32_t tail = g.page_tokens - split_slot;
  for (uint32_t rh = 0; rh < g.batch * g.heads; ++rh) {
    for (uint32_t plane = 0; plane < g.num_planes(); ++plane) {
      const uint64_t row_bytes = g.PlaneRowBytes(plane);
      if (split_slot > 0) {
        copies.push_back({lower, fresh[0], g.PlaneOffset(plane, rh, 0), split_slot * row_bytes});
      }
      copies.push_back({upper, fresh[0], g.PlaneOffset(plane, rh, split_slot), tail * row_bytes});
    }
  }
  if (absl::Status status = pool.Copy(copies); !status.ok()) {
    pool.Release(fresh[0]);
    return status;
  }
  return fresh[0];
}

absl::StatusOr<PageTable> JoinAt(const PageGeometry& geometry, const PageTable& lower,
                                 const PageTable& upper, uint64_t split) {
  const uint32_t p = geometry.page_tokens;
  const uint64_t index = split / p;
  PageTable joined = PageTable::Join(lower, upper, index);
  if (split % p != 0) {
    ASSIGN_OR_RETURN(PageId page,
                     JoinBoundaryPage(*lower.pool(), geometry, lower.Get(index), upper.Get(index),
                                      static_cast<uint32_t>(split % p)));
    joined.Set(index, page);
  }
  return joined;
}

}  // namespace kvcache::engine

