// The one place a layer kind is named: a CacheSpec layer's kind picks the
// Layer that implements it. Everything else asks the Layer (and its
// snapshots) through their virtuals (engine/layers/layer.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/layers/cache_spec.h"
#include "engine/layers/layer.h"
#include "gpu/page_pool.h"

namespace kvcache::engine {

// An empty layer for `spec.layers[index]` (spec validated and normalised),
// its tokens in pages of `pool` of up to `page_tokens` each.
// FAILED_PRECONDITION when this pool cannot hold the kind.
absl::StatusOr<std::unique_ptr<Layer>> MakeLayer(const CacheSpec& spec, size_t index,
                                                 gpu::PagePool& pool, uint32_t page_tokens);

// Host memory, at most, of one layer object of any kind and of one of its
// snapshots, allocation overhead included, without their page tables' chunks
// (engine/metadata_budget.h counts those).
uint64_t MaxLayerHostBytes();
uint64_t MaxLayerSnapshotHostBytes();

}  // namespace kvcache::engine
