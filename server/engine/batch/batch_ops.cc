#include "engine/batch/batch_ops.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"

namespace kvcache::engine {
namespace {

uint64_t PaddingOf(const CacheSpec& spec, uint32_t row) {
  return spec.left_padding.empty() ? 0 : spec.left_padding[row];
}

// Layers, kinds, dims and dtype; batch sizes and padding may differ.
bool SameLayoutApartFromBatch(const CacheSpec& a, CacheSpec b) {
  b.batch_size = a.batch_size;
  return SameLayout(a, b);
}

absl::Status LayoutDiffers(const std::string& field, const std::string& than) {
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": its layout (layers, kinds, heads, dims, dtype) differs from ", than, "'s"));
}

// The plan's spec with `padding` per row (none when all are zero).
CacheSpec BatchSpec(const CacheSpec& base, const std::vector<uint64_t>& padding) {
  CacheSpec spec = base;
  spec.batch_size = static_cast<uint32_t>(padding.size());
  spec.left_padding.clear();
  for (uint64_t pad : padding) {
    // Beyond uint32 the spec validation refuses it (max_window), not a wrap.
    spec.left_padding.push_back(static_cast<uint32_t>(std::min<uint64_t>(pad, UINT32_MAX)));
  }
  return NormalizeSpec(std::move(spec));
}

// Right-aligns every row of `frozen` at `target`: the row moves by
// target - frozen.to and keeps its padding's contents (mlx-lm extend's mx.pad).
void AppendAligned(const CacheSnapshot& frozen, uint64_t target, BatchPlan& plan,
                   std::vector<uint64_t>& padding) {
  const int64_t shift = static_cast<int64_t>(target - frozen.to);
  for (uint32_t r = 0; r < frozen.spec.batch_size; ++r) {
    const uint64_t pad = PaddingOf(frozen.spec, r);
    plan.rows.push_back({.source = &frozen, .row = r, .shift = shift, .padding = pad});
    padding.push_back(pad + (target - frozen.to));
  }
}

// mlx-lm BatchRotatingKVCache keeps no sinks: padding would displace them.
absl::Status CheckSinks(const BatchPlan& plan) {
  const bool moves = !plan.spec.left_padding.empty() ||
                     std::any_of(plan.rows.begin(), plan.rows.end(),
                                 [](const BatchRow& row) { return row.shift != 0; });
  if (!moves) return absl::OkStatus();
  for (size_t i = 0; i < plan.spec.layers.size(); ++i) {
    const auto* rotating = std::get_if<RotatingKind>(&plan.spec.layers[i].kind);
    if (rotating != nullptr && rotating->keep > 0) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: layer %d keeps %d attention sinks (rotating keep > 0), which left padding would "
          "displace; its rows can only be batched at equal lengths, without padding",
          plan.field, i, rotating->keep));
    }
  }
  return absl::OkStatus();
}

absl::Status AsField(const std::string& field, const absl::Status& status) {
  return absl::Status(
      status.code(),
      absl::StrCat(field, ": the resulting batch is not a valid cache: ", status.message()));
}

}  // namespace

absl::StatusOr<BatchPlan> PlanExtractRow(const CacheSnapshot& frozen, uint32_t row) {
  if (row >= frozen.spec.batch_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "row: %d is out of range; the cache has %d rows", row, frozen.spec.batch_size));
  }
  const uint64_t dropped = std::min(PaddingOf(frozen.spec, row), frozen.to);
  BatchPlan plan{
      .field = "row", .spec = BatchSpec(frozen.spec, {0}), .offset = frozen.to - dropped};
  plan.rows.push_back({.source = &frozen,
                       .row = row,
                       .shift = -static_cast<int64_t>(dropped),
                       .padding = PaddingOf(frozen.spec, row),
                       .copy_padding = false});
  return plan;
}

absl::StatusOr<BatchPlan> PlanFilterRows(const CacheSnapshot& frozen,
                                         absl::Span<const uint32_t> keep_rows) {
  if (keep_rows.empty()) {
    return absl::InvalidArgumentError("keep_rows: a batch needs at least one row");
  }
  uint64_t common = UINT64_MAX;
  for (size_t i = 0; i < keep_rows.size(); ++i) {
    if (keep_rows[i] >= frozen.spec.batch_size) {
      return absl::InvalidArgumentError(
          absl::StrFormat("keep_rows[%d]: row %d is out of range; the cache has %d rows", i,
                          keep_rows[i], frozen.spec.batch_size));
    }
    common = std::min(common, PaddingOf(frozen.spec, keep_rows[i]));
  }
  const uint64_t dropped = std::min(common, frozen.to);
  BatchPlan plan{.field = "keep_rows", .offset = frozen.to - dropped};
  std::vector<uint64_t> padding;
  for (uint32_t row : keep_rows) {
    const uint64_t pad = PaddingOf(frozen.spec, row);
    plan.rows.push_back(
        {.source = &frozen, .row = row, .shift = -static_cast<int64_t>(dropped), .padding = pad});
    padding.push_back(pad - dropped);
  }
  plan.spec = BatchSpec(frozen.spec, padding);
  return plan;
}

absl::StatusOr<BatchPlan> PlanExtend(const CacheSnapshot& frozen, const CacheSnapshot& other) {
  if (!SameLayoutApartFromBatch(frozen.spec, other.spec))
    return LayoutDiffers("other_id", "cache_id");
  BatchPlan plan{.field = "other_id", .offset = std::max(frozen.to, other.to)};
  std::vector<uint64_t> padding;
  AppendAligned(frozen, plan.offset, plan, padding);
  AppendAligned(other, plan.offset, plan, padding);
  plan.spec = BatchSpec(frozen.spec, padding);
  return plan;
}

absl::StatusOr<BatchPlan> PlanMerge(absl::Span<const CacheSnapshot* const> frozen_caches) {
  if (frozen_caches.empty())
    return absl::InvalidArgumentError("cache_ids: a merge needs at least one cache");
  uint64_t longest = 0;
  for (size_t i = 0; i < frozen_caches.size(); ++i) {
    if (!SameLayoutApartFromBatch(frozen_caches[0]->spec, frozen_caches[i]->spec)) {
      return LayoutDiffers(absl::StrCat("cache_ids[", i, "]"), "cache_ids[0]");
    }
    for (uint32_t r = 0; r < frozen_caches[i]->spec.batch_size; ++r) {
      const uint64_t pad = PaddingOf(frozen_caches[i]->spec, r);
      longest = std::max(longest, frozen_caches[i]->to - std::min(pad, frozen_caches[i]->to));
    }
  }
  BatchPlan plan{.field = "cache_ids", .offset = longest};
  std::vector<uint64_t> padding;
  for (const CacheSnapshot* frozen : frozen_caches) {
    for (uint32_t r = 0; r < frozen->spec.batch_size; ++r) {
      const uint64_t pad = PaddingOf(frozen->spec, r);
      const uint64_t length = frozen->to - std::min(pad, frozen->to);
      const uint64_t new_pad = longest - length;
      plan.rows.push_back({.source = frozen,
                           .row = r,
                           .shift = static_cast<int64_t>(new_pad) - static_cast<int64_t>(pad),
                           .padding = pad,
                           .copy_padding = false});
      padding.push_back(new_pad);
    }
  }
  plan.spec = BatchSpec(frozen_caches[0]->spec, padding);
  return plan;
}

absl::StatusOr<std::unique_ptr<Cache>> AssembleBatch(const BatchPlan& plan, gpu::PagePool& pool,
                                                     uint32_t page_tokens,
                                                     const SpecLimits& limits) {
  RETURN_IF_ERROR(CheckSinks(plan));
  if (absl::Status valid = ValidateSpec(plan.spec, limits); !valid.ok()) {
    return AsField(plan.field, valid);
  }
  absl::StatusOr<std::unique_ptr<Cache>> cache = Cache::Create(plan.spec, pool, page_tokens);
  if (!cache.ok()) return AsField(plan.field, cache.status());
  std::vector<RowSource> rows;
  for (size_t layer = 0; layer < plan.spec.layers.size(); ++layer) {
    rows.clear();
    for (const BatchRow& row : plan.rows) {
      rows.push_back({.source = row.source->layers[layer].get(),
                      .row = row.row,
                      .shift = row.shift,
                      .padding = row.padding,
                      .copy_padding = row.copy_padding});
    }
    if (absl::Status status = (*cache)->AssembleRows(layer, rows, plan.offset); !status.ok()) {
      (*cache)->Free();
      return absl::Status(status.code(), absl::StrCat("layer ", layer, ": ", status.message()));
    }
  }
  return cache;
}

}  // namespace kvcache::engine
