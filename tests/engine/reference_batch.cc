#include "reference_batch.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <utility>
#include <variant>

#include "reference_quantized.h"
#include "reference_recurrent.h"

namespace kvcache::testing {
namespace {

using engine::CacheSpec;

// What one new row holds, in new positions, ascending: a port of the slicing
// and padding each mlx-lm operation does to that row's buffer.
struct RowList {
  std::vector<std::pair<uint64_t, RefRowBytes>> entries;
  // The row's source window starts after its own first token: it has lost
  // tokens of its own to a rotating layer's ring.
  bool cut = false;
};

// How one new row is taken from a source row: positions p >= first move to
// p + shift. `padding` is the row's padding in the source.
struct RowPick {
  const RefCache* source;
  uint32_t row;
  int64_t shift;
  uint64_t first;
  uint64_t padding;
};

struct Plan {
  CacheSpec spec;
  uint64_t offset = 0;
  std::vector<RowPick> picks;
};

// A broken invariant here is a bug in this file, not in the engine.
void RefBatchCheck(bool condition, const char* what) {
  if (!condition) {
    std::cerr << "reference batch invariant violated: " << what << "\n";
    std::abort();
  }
}

uint64_t PaddingOf(const CacheSpec& spec, uint32_t row) {
  return spec.left_padding.empty() ? 0 : spec.left_padding[row];
}

uint64_t OffsetOf(const RefCache& cache) { return cache.CommonOffset().value(); }

bool SameLayoutApartFromBatch(const CacheSpec& a, const CacheSpec& b) {
  if (a.dtype != b.dtype || a.layers.size() != b.layers.size()) return false;
  for (size_t i = 0; i < a.layers.size(); ++i) {
    const engine::LayerSpec& x = a.layers[i];
    const engine::LayerSpec& y = b.layers[i];
    const uint32_t xv = x.v_head_dim == 0 ? x.k_head_dim : x.v_head_dim;
    const uint32_t yv = y.v_head_dim == 0 ? y.k_head_dim : y.v_head_dim;
    if (x.num_kv_heads != y.num_kv_heads || x.k_head_dim != y.k_head_dim || xv != yv ||
        !(x.kind == y.kind)) {
      return false;
    }
  }
  return true;
}

CacheSpec WithRows(CacheSpec spec, const std::vector<uint64_t>& padding) {
  spec.batch_size = static_cast<uint32_t>(padding.size());
  spec.left_padding.clear();
  if (std::any_of(padding.begin(), padding.end(), [](uint64_t p) { return p != 0; })) {
    for (uint64_t p : padding) spec.left_padding.push_back(static_cast<uint32_t>(p));
  }
  return spec;
}

// The shape of a layer's tokens as the reference stores them: quantized
// layers hold each (row, head) as its packed row (wq, scales, biases), so a
// row of a token is heads packed rows; zero bytes are a zero packed row.
RefShape StoredShape(const CacheSpec& spec, size_t layer) {
  RefShape shape = ShapeOf(spec, layer);
  RefQuantFormat format;
  if (QuantFormatOf(spec, layer, format)) {
    shape = RefShape{.batch = shape.batch, .heads = shape.heads,
                     .k_dim = static_cast<uint32_t>(PackedRowBytes(format, shape.k_dim)),
                     .v_dim = static_cast<uint32_t>(PackedRowBytes(format, shape.v_dim)),
                     .elem_bytes = 1};
  }
  return shape;
}

RefRowBytes ZeroRow(const RefShape& shape) {
  return {std::vector<std::byte>(uint64_t{shape.heads} * shape.KRowBytes()),
          std::vector<std::byte>(uint64_t{shape.heads} * shape.VRowBytes())};
}

// The sink count of a layer (0 unless rotating with keep).
uint64_t KeepOf(const engine::LayerSpec& layer) {
  const auto* rotating = std::get_if<engine::RotatingKind>(&layer.kind);
  return rotating == nullptr ? 0 : rotating->keep;
}

// Recurrent layers: every new row's conv and delta rows from its source row
// (zeros where that has no state yet); no state when no source has one.
std::optional<RefState> PickStates(const Plan& plan, size_t layer) {
  RefState state;
  bool any = false;
  for (const RowPick& pick : plan.picks) {
    const CacheSpec& spec = pick.source->spec();
    std::optional<RefState> source = pick.source->layer(layer).FetchState();
    any |= source.has_value();
    if (!source.has_value()) source = ZeroState(spec, layer);
    const uint64_t conv = ConvStateBytes(spec, layer) / spec.batch_size;
    const uint64_t delta = DeltaStateBytes(spec, layer) / spec.batch_size;
    state.conv.insert(state.conv.end(), source->conv.begin() + pick.row * conv,
                      source->conv.begin() + (pick.row + 1) * conv);
    state.delta.insert(state.delta.end(), source->delta.begin() + pick.row * delta,
                       source->delta.begin() + (pick.row + 1) * delta);
  }
  if (!any) return std::nullopt;
  return state;
}

RowList PickRow(const RowPick& pick, size_t layer) {
  const RefShape shape = StoredShape(pick.source->spec(), layer);
  const std::vector<RefToken> tokens = pick.source->layer(layer).Fetch();
  RowList list;
  const uint64_t sink_end =
      std::min(KeepOf(pick.source->spec().layers[layer]), pick.source->layer(layer).offset());
  for (const RefToken& token : tokens) {
    if (token.position >= sink_end) {  // the first token of the window
      list.cut = token.position > std::max(pick.padding, sink_end);
      break;
    }
  }
  for (const RefToken& token : tokens) {
    const int64_t moved = static_cast<int64_t>(token.position) + pick.shift;
    if (token.position < pick.first || moved < 0) continue;
    list.entries.emplace_back(static_cast<uint64_t>(moved), RowOf(shape, token, pick.row));
  }
  return list;
}

bool HoldsSuffix(const engine::LayerSpec& layer) {
  return std::holds_alternative<engine::RotatingKind>(layer.kind) ||
         std::holds_alternative<engine::ChunkedKind>(layer.kind);
}

// Where a layer that holds a suffix (rotating: the window after the sinks;
// chunked: from its start position) starts: where the earliest row's lands,
// but no earlier than that of a row which lost tokens of its own.
uint64_t SuffixStart(const std::vector<RowList>& rows, uint64_t sinks, uint64_t offset) {
  uint64_t earliest = offset;
  uint64_t latest_cut = 0;
  for (const RowList& row : rows) {
    auto first = std::find_if(row.entries.begin(), row.entries.end(),
                              [&](const auto& entry) { return entry.first >= sinks; });
    if (first == row.entries.end() || first->first >= offset) continue;
    earliest = std::min(earliest, first->first);
    if (row.cut) latest_cut = std::max(latest_cut, first->first);
  }
  return std::max({earliest, latest_cut, sinks});
}

// The positions a new layer holds: standard all of [0, offset); the others
// their sinks and the suffix from `start` on.
std::vector<uint64_t> HeldPositions(uint64_t sinks, uint64_t start, uint64_t offset) {
  std::vector<uint64_t> positions;
  for (uint64_t p = 0; p < sinks; ++p) positions.push_back(p);
  for (uint64_t p = std::max(start, sinks); p < offset; ++p) positions.push_back(p);
  return positions;
}

// The tokens a new attention layer holds, each row's from its list or zeros.
std::vector<RefToken> StackedTokens(const RefShape& shape, const std::vector<uint64_t>& positions,
                                    const std::vector<RowList>& rows) {
  std::vector<RefToken> tokens;
  for (uint64_t position : positions) {
    std::vector<RefRowBytes> stacked;
    for (const RowList& row : rows) {
      auto it = std::find_if(row.entries.begin(), row.entries.end(),
                             [&](const auto& entry) { return entry.first == position; });
      stacked.push_back(it == row.entries.end() ? ZeroRow(shape) : it->second);
    }
    tokens.push_back(StackRows(stacked, position));
  }
  return tokens;
}

// The new layer as a snapshot of it [0, offset) would hold it (restored into
// a fresh cache by Execute): standard the tokens; rotating its buffer in
// temporal order with _idx its length, as mlx-lm leaves a buffer it rebuilt;
// chunked the tokens from its start position.
RefLayerSnapshotPtr BuildLayer(const Plan& plan, size_t layer) {
  const engine::LayerSpec& spec = plan.spec.layers[layer];
  auto snapshot = std::make_shared<RefLayerSnapshot>();
  snapshot->to = plan.offset;
  if (engine::IsRecurrent(spec)) {
    snapshot->state = PickStates(plan, layer);
    return snapshot;
  }
  std::vector<RowList> rows;
  for (const RowPick& pick : plan.picks) rows.push_back(PickRow(pick, layer));
  const uint64_t sinks = std::min(KeepOf(spec), plan.offset);
  const uint64_t start = HoldsSuffix(spec) ? SuffixStart(rows, sinks, plan.offset) : 0;
  snapshot->tokens =
      StackedTokens(StoredShape(plan.spec, layer), HeldPositions(sinks, start, plan.offset), rows);
  snapshot->idx = snapshot->tokens.size();
  if (std::holds_alternative<engine::ChunkedKind>(spec.kind))
    snapshot->from = snapshot->start = start;
  return snapshot;
}

// mlx-lm BatchRotatingKVCache has no sinks: padding or a moved row would
// displace them.
bool DisplacesSinks(const Plan& plan) {
  const bool moves = !plan.spec.left_padding.empty() ||
                     std::any_of(plan.picks.begin(), plan.picks.end(),
                                 [](const RowPick& pick) { return pick.shift != 0; });
  return moves && std::any_of(plan.spec.layers.begin(), plan.spec.layers.end(),
                              [](const engine::LayerSpec& l) { return KeepOf(l) > 0; });
}

RefBatchResult Execute(const Plan& plan) {
  if (DisplacesSinks(plan)) return {absl::StatusCode::kFailedPrecondition, nullptr};
  RefCacheSnapshot built{.spec = plan.spec, .from = 0, .to = plan.offset};
  for (size_t layer = 0; layer < plan.spec.layers.size(); ++layer) {
    built.layers.push_back(BuildLayer(plan, layer));
  }
  auto cache = std::make_unique<RefCache>(plan.spec);
  RefBatchCheck(cache->Restore(&built, plan.offset), "a built cache restores");
  return {absl::StatusCode::kOk, std::move(cache)};
}

RefBatchResult Refused(absl::StatusCode code) { return {code, nullptr}; }

// mlx-lm extend's pad(c): every row of `cache` right-aligned at `target`,
// zeros in front, its padding grown by as much.
void AppendAligned(const RefCache& cache, uint64_t target, Plan& plan,
                   std::vector<uint64_t>& padding) {
  const uint64_t left = target - OffsetOf(cache);
  for (uint32_t r = 0; r < cache.spec().batch_size; ++r) {
    const uint64_t pad = PaddingOf(cache.spec(), r);
    plan.picks.push_back({&cache, r, static_cast<int64_t>(left), 0, pad});
    padding.push_back(pad + left);
  }
}

}  // namespace

RefRowBytes RowOf(const RefShape& shape, const RefToken& token, uint32_t row) {
  const uint64_t k_row = uint64_t{shape.heads} * shape.KRowBytes();
  const uint64_t v_row = uint64_t{shape.heads} * shape.VRowBytes();
  RefRowBytes out;
  out.keys.assign(token.keys.begin() + row * k_row, token.keys.begin() + (row + 1) * k_row);
  out.values.assign(token.values.begin() + row * v_row, token.values.begin() + (row + 1) * v_row);
  return out;
}

RefToken StackRows(const std::vector<RefRowBytes>& rows, uint64_t position) {
  RefToken token;
  token.position = position;
  for (const RefRowBytes& row : rows) {
    token.keys.insert(token.keys.end(), row.keys.begin(), row.keys.end());
    token.values.insert(token.values.end(), row.values.begin(), row.values.end());
  }
  return token;
}

RefBatchResult RefExtractRow(const RefCache& cache, uint32_t row) {
  if (!cache.CommonOffset().has_value()) return Refused(absl::StatusCode::kFailedPrecondition);
  if (row >= cache.spec().batch_size) return Refused(absl::StatusCode::kInvalidArgument);
  // mlx: keys[idx:idx+1, :, padding:_idx]
  const uint64_t pad = std::min(PaddingOf(cache.spec(), row), OffsetOf(cache));
  Plan plan{WithRows(cache.spec(), {0}), OffsetOf(cache) - pad, {}};
  plan.picks.push_back(
      {&cache, row, -static_cast<int64_t>(pad), pad, PaddingOf(cache.spec(), row)});
  return Execute(plan);
}

RefBatchResult RefFilterRows(const RefCache& cache, const std::vector<uint32_t>& keep_rows) {
  if (!cache.CommonOffset().has_value()) return Refused(absl::StatusCode::kFailedPrecondition);
  if (keep_rows.empty()) return Refused(absl::StatusCode::kInvalidArgument);
  uint64_t min_left_pad = UINT64_MAX;
  for (uint32_t row : keep_rows) {
    if (row >= cache.spec().batch_size) return Refused(absl::StatusCode::kInvalidArgument);
    min_left_pad = std::min(min_left_pad, PaddingOf(cache.spec(), row));
  }
  // mlx: keys[batch_indices][..., min_left_pad:, :]; _idx -= min_left_pad
  const uint64_t d = std::min(min_left_pad, OffsetOf(cache));
  Plan plan{{}, OffsetOf(cache) - d, {}};
  std::vector<uint64_t> padding;
  for (uint32_t row : keep_rows) {
    const uint64_t pad = PaddingOf(cache.spec(), row);
    plan.picks.push_back({&cache, row, -static_cast<int64_t>(d), 0, pad});
    padding.push_back(pad - d);
  }
  plan.spec = WithRows(cache.spec(), padding);
  return Execute(plan);
}

RefBatchResult RefExtend(const RefCache& cache, const RefCache& other) {
  if (!cache.CommonOffset().has_value() || !other.CommonOffset().has_value()) {
    return Refused(absl::StatusCode::kFailedPrecondition);
  }
  if (!SameLayoutApartFromBatch(cache.spec(), other.spec())) {
    return Refused(absl::StatusCode::kInvalidArgument);
  }
  Plan plan{{}, std::max(OffsetOf(cache), OffsetOf(other)), {}};
  std::vector<uint64_t> padding;
  AppendAligned(cache, plan.offset, plan, padding);
  AppendAligned(other, plan.offset, plan, padding);
  plan.spec = WithRows(cache.spec(), padding);
  return Execute(plan);
}

RefBatchResult RefMerge(const std::vector<const RefCache*>& caches) {
  for (const RefCache* cache : caches) {
    if (!cache->CommonOffset().has_value()) return Refused(absl::StatusCode::kFailedPrecondition);
  }
  if (caches.empty()) return Refused(absl::StatusCode::kInvalidArgument);
  // mlx: lengths = [c.offset ...]; padding = [max_length - l ...]
  std::vector<uint64_t> lengths;
  for (const RefCache* cache : caches) {
    if (!SameLayoutApartFromBatch(caches[0]->spec(), cache->spec())) {
      return Refused(absl::StatusCode::kInvalidArgument);
    }
    for (uint32_t r = 0; r < cache->spec().batch_size; ++r) {
      const uint64_t pad = PaddingOf(cache->spec(), r);
      lengths.push_back(OffsetOf(*cache) - std::min(pad, OffsetOf(*cache)));
    }
  }
  const uint64_t max_length = *std::max_element(lengths.begin(), lengths.end());
  Plan plan{{}, max_length, {}};
  std::vector<uint64_t> padding;
  for (const RefCache* cache : caches) {
    for (uint32_t r = 0; r < cache->spec().batch_size; ++r) {
      const uint64_t pad = PaddingOf(cache->spec(), r);
      const uint64_t new_pad = max_length - lengths[padding.size()];
      plan.picks.push_back(
          {cache, r, static_cast<int64_t>(new_pad) - static_cast<int64_t>(pad), pad, pad});
      padding.push_back(new_pad);
    }
  }
  plan.spec = WithRows(caches[0]->spec(), padding);
  return Execute(plan);
}

}  // namespace kvcache::testing
