#include "engine/layers/cache.h"

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "engine/layers/layer_factory.h"
#include "engine/layers/page_table.h"

namespace kvcache::engine {
namespace {

absl::Status InLayer(size_t layer, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("layer ", layer, ": ", status.message()));
}

}  // namespace

uint64_t CacheSnapshot::size_bytes() const {
  uint64_t total = 0;
  for (const LayerSnapshotPtr& layer : layers) total += layer ? layer->size_bytes() : 0;
  return total;
}

void CacheSnapshot::ForEachPage(absl::FunctionRef<void(gpu::PageId)> visit) const {
  for (const LayerSnapshotPtr& layer : layers) {
    if (layer == nullptr) continue;
    layer->held_pages().ForEachChunk([&](const void*, long, absl::Span<const gpu::PageId> pages) {
      for (const gpu::PageId page : pages) {
        if (page != gpu::kNoPage) visit(page);
      }
    });
  }
}

TierBytes CacheSnapshot::Tiers() const {
  TierBytes bytes;
  for (const LayerSnapshotPtr& layer : layers) {
    if (layer == nullptr) continue;
    const gpu::PagePool& pool = *layer->held_pages().pool();
    const uint64_t page_bytes = pool.page_bytes();
    layer->held_pages().ForEachChunk([&](const void*, long, absl::Span<const gpu::PageId> pages) {
      for (const gpu::PageId page : pages) {
        if (page == gpu::kNoPage) continue;
        switch (pool.Where(page)) {
          case gpu::Tier::kDevice:
            bytes.device += page_bytes;
            break;
          case gpu::Tier::kHost:
            bytes.host += page_bytes;
            break;
          case gpu::Tier::kDisk:
            bytes.disk += page_bytes;
            break;
        }
      }
    });
  }
  return bytes;
}

std::vector<TokenRange> CacheSnapshot::Ranges(uint32_t layer, TokenRange window) const {
  std::vector<TokenRange> clipped;
  if (layer >= layers.size() || !layers[layer]) return clipped;
  for (const TokenRange& range : layers[layer]->Ranges()) {
    const TokenRange part{std::max(range.begin, window.begin), std::min(range.end, window.end)};
    if (part.begin < part.end) clipped.push_back(part);
  }
  return clipped;
}

absl::StatusOr<const LayerSnapshot*> CacheSnapshot::HeldLayer(uint32_t layer) const {
  if (layer >= layers.size()) {
    return absl::InvalidArgumentError(absl::StrFormat("layer %d: the cache has %d layers", layer,
                                                      layers.size()));
  }
  if (!layers[layer]) {
    return absl::InvalidArgumentError(absl::StrFormat("layer %d holds nothing", layer));
  }
  return layers[layer].get();
}

absl::Status CacheSnapshot::Read(uint32_t layer, TokenRange range, const KvOutput& out) const {
  ASSIGN_OR_RETURN(const LayerSnapshot* held, HeldLayer(layer));
  return held->Read(range, out);
}

absl::Status CacheSnapshot::Mapped(uint32_t layer, TokenRange range, KvMappedPieces& out) const {
  ASSIGN_OR_RETURN(const LayerSnapshot* held, HeldLayer(layer));
  return held->Mapped(range, out);
}

absl::Status CacheSnapshot::ReadPacked(uint32_t layer, TokenRange range,
                                       const PackedOutput& out) const {
  ASSIGN_OR_RETURN(const LayerSnapshot* held, HeldLayer(layer));
  return held->ReadPacked(range, out);
}

absl::Status CacheSnapshot::ReadState(uint32_t layer, const StateOutput& out) const {
  ASSIGN_OR_RETURN(const LayerSnapshot* held, HeldLayer(layer));
  return held->ReadState(out);
}

absl::StatusOr<std::unique_ptr<Cache>> Cache::Create(const CacheSpec& spec, gpu::PagePool& pool,
                                                     uint32_t page_tokens) {
  std::vector<std::unique_ptr<Layer>> layers;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    auto layer = MakeLayer(spec, i, pool, page_tokens);
    if (!layer.ok()) return InLayer(i, layer.status());
    layers.push_back(*std::move(layer));
  }
  return std::unique_ptr<Cache>(new Cache(spec, std::move(layers)));
}

namespace {
uint64_t NextLayoutId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

Cache::Cache(CacheSpec spec, std::vector<std::unique_ptr<Layer>> layers)
    : spec_(std::move(spec)), layers_(std::move(layers)), layout_id_(NextLayoutId()) {}

std::vector<uint64_t> Cache::layer_offsets() const {
  std::vector<uint64_t> offsets;
  for (const auto& layer : layers_) offsets.push_back(layer->offset());
  return offsets;
}

absl::StatusOr<uint64_t> Cache::CommonOffset() const {
  const uint64_t first = layers_[0]->offset();
  for (size_t i = 1; i < layers_.size(); ++i) {
    if (layers_[i]->offset() != first) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "layers are out of step: layer 0 is at offset %d, layer %d at %d; finish the step "
          "(update every layer) or restore first",
          first, i, layers_[i]->offset()));
    }
  }
  return first;
}

uint64_t Cache::size_bytes() const {
  uint64_t total = 0;
  for (const auto& layer : layers_) total += layer->size_bytes();
  return total;
}

absl::Status Cache::Update(uint32_t layer, const KvInput& kv) {
  NoteChanged();
  return layers_[layer]->Update(kv);
}

absl::Status Cache::UpdateState(uint32_t layer, const StateInput& state) {
  NoteChanged();
  return layers_[layer]->UpdateState(state);
}

// mlx-lm trim_prompt_cache: every layer must be trimmable (mlx-lm answers 0
// where one is not; this refuses, saying why). Unlike mlx-lm, which lets each
// layer trim what it can, all layers trim the least any can (a chunked layer
// stops at its start position), so they stay in step.
absl::StatusOr<uint64_t> Cache::Trim(uint64_t n) {
  RETURN_IF_ERROR(CommonOffset().status());
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (absl::Status why = layers_[i]->CheckTrimmable(); !why.ok()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "layer %d cannot be trimmed: %s (offset %d); restore from a snapshot instead", i,
          why.message(), layers_[i]->offset()));
    }
  }
  for (const auto& layer : layers_) n = std::min(n, layer->TrimmableTokens());
  NoteChanged();
  for (auto& layer : layers_) layer->Trim(n);
  return n;
}

absl::StatusOr<CacheSnapshotPtr> Cache::Snapshot(const std::string& cache_id,
                                                 uint64_t from_offset) const {
  ASSIGN_OR_RETURN(const uint64_t offset, CommonOffset());
  if (from_offset >= offset) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "nothing to snapshot: from_offset %d is not below the cache's offset %d", from_offset,
        offset));
  }
  auto snapshot = std::make_shared<CacheSnapshot>();
  snapshot->cache_id = cache_id;
  snapshot->spec = spec_;
  snapshot->from = from_offset;
  snapshot->to = offset;
  snapshot->source_layout_id = layout_id_;
  snapshot->source_generation = generation_;
  for (const auto& layer : layers_) {
    ASSIGN_OR_RETURN(LayerSnapshotPtr part, layer->Snapshot(from_offset));
    snapshot->layers.push_back(std::move(part));
  }
  return snapshot;
}

absl::StatusOr<CacheSnapshotPtr> Cache::Freeze(const std::string& cache_id) const {
  auto frozen = std::make_shared<CacheSnapshot>();
  frozen->cache_id = cache_id;
  frozen->spec = spec_;
  for (const auto& layer : layers_) {
    ASSIGN_OR_RETURN(LayerSnapshotPtr part, layer->Snapshot(0));
    frozen->to = std::max(frozen->to, layer->offset());
    frozen->layers.push_back(std::move(part));
  }
  return frozen;
}

// Works out every layer's restored state first (each at `target`, or refused)
// and swaps them in only when all succeeded, so a refused layer leaves the
// whole cache as it was. Layers out of
// step are allowed here: restoring is how a worker recovers from a torn step.
absl::Status Cache::Restore(const CacheSnapshot* snapshot, uint64_t target) {
  if (snapshot != nullptr && !SameLayout(spec_, snapshot->spec)) {
    return absl::FailedPreconditionError(
        "the snapshot's layout (layers, kinds, heads, dims, dtype, batch) differs from this "
        "cache's");
  }
  // After a FilterRows the same positions hold other tokens: refuse, as mlx-lm
  // would hand back rows at the wrong offsets.
  if (snapshot != nullptr && snapshot->spec.left_padding != spec_.left_padding) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the snapshot's left_padding [%s] differs from this cache's [%s]",
        absl::StrJoin(snapshot->spec.left_padding, ","), absl::StrJoin(spec_.left_padding, ",")));
  }
  // Restoring a snapshot of the cache as it still is, to its end: already
  // there. The snapshot way of speculation ends every fully accepted round so.
  if (snapshot != nullptr && snapshot->source_layout_id == layout_id_ &&
      snapshot->source_generation == generation_ && target == snapshot->to) {
    return absl::OkStatus();
  }
  std::vector<std::unique_ptr<Layer>> restored;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerSnapshot* part = snapshot ? snapshot->layers[i].get() : nullptr;
    auto layer = layers_[i]->Restored(part, target);
    if (!layer.ok()) return InLayer(i, layer.status());
    restored.push_back(*std::move(layer));
  }
  layers_ = std::move(restored);
  NoteChanged();
  return absl::OkStatus();
}

absl::Status Cache::AssembleRows(size_t layer, absl::Span<const RowSource> rows,
                                 uint64_t offset) {
  NoteChanged();
  return layers_[layer]->AssembleRows(rows, offset);
}

void Cache::Free() {
  NoteChanged();
  for (auto& layer : layers_) layer->Free();
}

absl::StatusOr<CacheSnapshotPtr> MergeSnapshots(const CacheSnapshot& parent,
                                                const CacheSnapshot& child) {
  if (!SameLayout(parent.spec, child.spec)) {
    return absl::FailedPreconditionError("the snapshots' layouts differ");
  }
  if (parent.spec.left_padding != child.spec.left_padding) {
    return absl::FailedPreconditionError("the snapshots' left_padding differs");
  }
  if (parent.to != child.from) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "snapshots are not adjacent: the parent ends at %d, the child starts at %d", parent.to,
        child.from));
  }
  auto merged = std::make_shared<CacheSnapshot>();
  merged->cache_id = parent.cache_id;
  merged->spec = parent.spec;
  merged->from = parent.from;
  merged->to = child.to;
  for (size_t i = 0; i < parent.layers.size(); ++i) {
    const LayerSnapshotPtr& p = parent.layers[i];
    const LayerSnapshotPtr& c = child.layers[i];
    if (p && c) {
      auto part = p->MergedWith(*c);
      if (!part.ok()) return InLayer(i, part.status());
      merged->layers.push_back(*std::move(part));
    } else if (p == nullptr && c == nullptr) {
      merged->layers.push_back(nullptr);  // neither holds anything, nor does the merge
    } else if ((p ? p : c)->ChildSupersedes()) {
      merged->layers.push_back(c);  // the child's window or state supersedes the parent's
    } else {
      return InLayer(i, absl::FailedPreconditionError("a snapshot holds nothing for this layer"));
    }
  }
  return merged;
}

absl::StatusOr<std::pair<CacheSnapshotPtr, CacheSnapshotPtr>> SplitSnapshot(
    const CacheSnapshot& snapshot, uint64_t at) {
  if (at <= snapshot.from || at >= snapshot.to) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cannot split [%d, %d) at %d: the split point must lie strictly inside", snapshot.from,
        snapshot.to, at));
  }
  auto parent = std::make_shared<CacheSnapshot>();
  auto child = std::make_shared<CacheSnapshot>();
  for (CacheSnapshot* half : {parent.get(), child.get()}) {
    half->cache_id = snapshot.cache_id;
    half->spec = snapshot.spec;
  }
  parent->from = snapshot.from;
  parent->to = child->from = at;
  child->to = snapshot.to;
  for (size_t i = 0; i < snapshot.layers.size(); ++i) {
    LayerSnapshotPtr p, c;
    if (snapshot.layers[i]) {
      auto halves = snapshot.layers[i]->SplitAt(at);
      if (!halves.ok()) return InLayer(i, halves.status());
      std::tie(p, c) = *std::move(halves);
    }
    parent->layers.push_back(std::move(p));
    child->layers.push_back(std::move(c));
  }
  return std::make_pair(CacheSnapshotPtr(std::move(parent)), CacheSnapshotPtr(std::move(child)));
}

}  // namespace kvcache::engine
