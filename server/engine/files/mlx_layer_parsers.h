// The per-class half of CacheFromPromptCache (mlx_state.h): each mlx-lm
// class's `state` and `meta_state` read back into a layer spec and the
// contents a fresh layer loads (Layer::Load), every check naming its key.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/files/mlx_file_reader.h"
#include "engine/layers/cache_spec.h"
#include "engine/layers/layer.h"

namespace kvcache::engine::mlx_file {

// Offsets and dims past this are no cache's.
constexpr uint64_t kMaxOffset = uint64_t{1} << 48;

// One layer as the file describes it.
struct ParsedLayer {
  std::string mlx_class;
  LayerSpec spec;
  DType dtype = DType::kFloat16;
  uint64_t batch = 0;
  std::string shape_key;  // the tensor that fixed dtype and batch, for messages
  // Attention layers: the offset and the key it was read from. ArraysCache has none.
  std::optional<uint64_t> offset;
  std::string offset_key;
  std::optional<std::vector<uint32_t>> left_padding;  // BatchKVCache
  LayerContents contents;
  PackedInput packed;  // quantized
  StateInput state;    // recurrent
};

// Layer `layer` of the file as its class ("2.<layer>") describes it.
absl::StatusOr<ParsedLayer> ParseLayer(FileReader& reader, uint32_t layer,
                                       const SpecLimits& limits);

}  // namespace kvcache::engine::mlx_file
