#include "engine/layers/layer_factory.h"

#include <algorithm>
#include <variant>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "engine/layers/chunked_layer.h"
#include "engine/layers/host_bytes.h"
#include "engine/layers/recurrent_layer.h"
#include "engine/layers/rotating_layer.h"
#include "engine/layers/standard_layer.h"

namespace kvcache::engine {

absl::StatusOr<std::unique_ptr<Layer>> MakeLayer(const CacheSpec& spec, size_t index,
                                                 gpu::PagePool& pool, uint32_t page_tokens) {
  const LayerSpec& layer = spec.layers[index];
  if (const auto* recurrent = std::get_if<RecurrentKind>(&layer.kind)) {
    const StateGeometry state{.kind = *recurrent, .batch = spec.batch_size,
                              .elem_bytes = DTypeSize(spec.dtype), .page_bytes = pool.page_bytes()};
    return std::make_unique<RecurrentLayer>(pool, state, static_cast<uint32_t>(index));
  }
  ASSIGN_OR_RETURN(PageGeometry geometry, GeometryFor(spec, index, pool.page_bytes(), page_tokens));
  if (const auto* chunked = std::get_if<ChunkedKind>(&layer.kind)) {
    return std::make_unique<ChunkedLayer>(pool, geometry, *chunked);
  }
  if (const auto* rotating = std::get_if<RotatingKind>(&layer.kind)) {
    return std::make_unique<RotatingLayer>(pool, geometry, *rotating);
  }
  if (geometry.quantized() && pool.page_bytes() % 4 != 0) {
    // The shaders write packed words: planes must start 4-byte aligned.
    return absl::FailedPreconditionError(absl::StrFormat(
        "quantized layers need pool pages of a multiple of 4 bytes; this server's pages are %d "
        "bytes",
        pool.page_bytes()));
  }
  // Standard and quantized (mlx-lm QuantizedKVCache: a standard layer over
  // quantized planes; see standard_layer.h).
  return std::make_unique<StandardLayer>(pool, geometry);
}

uint64_t MaxLayerHostBytes() {
  // Held by unique_ptr in the cache's vector.
  return HeapBlockBytes(std::max({sizeof(StandardLayer), sizeof(RotatingLayer),
                                  sizeof(ChunkedLayer), sizeof(RecurrentLayer)})) +
         sizeof(std::unique_ptr<Layer>);
}

uint64_t MaxLayerSnapshotHostBytes() {
  // Made by make_shared (object and count in one block) and held by
  // shared_ptr in the snapshot's vector.
  return HeapBlockBytes(kSharedCountBytes +
                        std::max({sizeof(StandardSnapshot), sizeof(RotatingSnapshot),
                                  sizeof(ChunkedSnapshot), sizeof(RecurrentSnapshot)})) +
         sizeof(LayerSnapshotPtr);
}

}  // namespace kvcache::engine
