// CacheFromPromptCache (mlx_state.h): the file's layers parsed one by one
// (mlx_layer_parsers.h), then checked together (dtype, batch, one offset, one
// left padding) into a spec, and a cache loaded from them.
#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "engine/files/mlx_file_util.h"
#include "engine/files/mlx_layer_parsers.h"
#include "engine/files/mlx_state.h"

namespace kvcache::engine {
namespace {

using mlx_file::BadMeta;
using mlx_file::BadTensor;
using mlx_file::FileReader;
using mlx_file::Key;
using mlx_file::ParsedLayer;

// dtype and batch size agree across the file's layers.
absl::Status CheckUniform(const std::vector<ParsedLayer>& layers) {
  const ParsedLayer& first = layers.front();
  for (const ParsedLayer& layer : layers) {
    if (layer.dtype != first.dtype) {
      return BadTensor(layer.shape_key,
                       absl::StrFormat("dtype differs from \"%s\"'s", first.shape_key));
    }
    if (layer.batch != first.batch) {
      return BadTensor(layer.shape_key, absl::StrFormat("batch %d differs from \"%s\"'s %d",
                                                        layer.batch, first.shape_key, first.batch));
    }
  }
  return absl::OkStatus();
}

// The attention layers' common offset, or 1 where there is none (mlx_state.h),
// which the recurrent layers take.
absl::StatusOr<uint64_t> CommonOffset(const std::vector<ParsedLayer>& layers) {
  const ParsedLayer* first = nullptr;
  for (const ParsedLayer& layer : layers) {
    if (!layer.offset.has_value()) continue;
    if (first == nullptr) first = &layer;
    if (*layer.offset != *first->offset) {
      const std::string why =
          absl::StrFormat("offset %d differs from %d (\"%s\"): a cache's layers step together",
                          *layer.offset, *first->offset, first->offset_key);
      return layer.offset_key.front() == '0' ? BadMeta(layer.offset_key, why)
                                             : BadTensor(layer.offset_key, why);
    }
  }
  return first == nullptr ? 1 : *first->offset;
}

// One left padding for the whole cache, from its BatchKVCache layers.
absl::StatusOr<std::vector<uint32_t>> LeftPadding(const std::vector<ParsedLayer>& layers) {
  const ParsedLayer* first = nullptr;
  for (const ParsedLayer& layer : layers) {
    if (layer.left_padding.has_value() && first == nullptr) first = &layer;
  }
  if (first == nullptr) return std::vector<uint32_t>{};
  for (uint32_t index = 0; index < layers.size(); ++index) {
    const ParsedLayer& layer = layers[index];
    if (IsRecurrent(layer.spec)) continue;
    if (!layer.left_padding.has_value()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "metadata \"%s\": a %s beside batch layers; a cache here has one left padding",
          Key(2, index), layer.mlx_class));
    }
    if (*layer.left_padding != *first->left_padding) {
      return BadTensor(Key(index, 2),
                       "the padding it implies differs from the other batch layers'");
    }
  }
  return *first->left_padding;
}

absl::StatusOr<CacheSpec> SpecOf(std::vector<ParsedLayer>& layers, const FileReader& reader,
                                 const SpecLimits& limits) {
  RETURN_IF_ERROR(CheckUniform(layers));
  ASSIGN_OR_RETURN(const uint64_t offset, CommonOffset(layers));
  CacheSpec spec;
  spec.dtype = layers.front().dtype;
  spec.batch_size = static_cast<uint32_t>(layers.front().batch);
  spec.model = reader.UserMeta("model");
  ASSIGN_OR_RETURN(spec.left_padding, LeftPadding(layers));
  for (ParsedLayer& layer : layers) {
    spec.layers.push_back(layer.spec);
    layer.contents.offset = offset;
  }
  if (absl::Status valid = ValidateSpec(spec, limits); !valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the prompt cache describes a cache this server refuses: ", valid.message()));
  }
  return NormalizeSpec(std::move(spec));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Cache>> CacheFromPromptCache(const PromptCacheFile& file,
                                                            const SpecLimits& limits,
                                                            gpu::PagePool& pool,
                                                            uint32_t page_tokens) {
  FileReader reader(file);
  ASSIGN_OR_RETURN(const uint32_t count, reader.CountLayers(limits.max_layers));
  std::vector<ParsedLayer> layers;
  std::vector<std::string> classes;
  for (uint32_t index = 0; index < count; ++index) {
    ASSIGN_OR_RETURN(ParsedLayer layer, mlx_file::ParseLayer(reader, index, limits));
    classes.push_back(layer.mlx_class);
    layers.push_back(std::move(layer));
  }
  RETURN_IF_ERROR(reader.CheckAllRead(classes));
  ASSIGN_OR_RETURN(const CacheSpec spec, SpecOf(layers, reader, limits));
  // Dropped on error: its layers' page tables give back every page they took.
  ASSIGN_OR_RETURN(std::unique_ptr<Cache> cache, Cache::Create(spec, pool, page_tokens));
  for (uint32_t index = 0; index < count; ++index) {
    ParsedLayer& layer = layers[index];
    layer.contents.packed =
        std::holds_alternative<QuantizedKind>(layer.spec.kind) ? &layer.packed : nullptr;
    layer.contents.state = IsRecurrent(layer.spec) ? &layer.state : nullptr;
    if (absl::Status loaded = cache->mutable_layer(index).Load(layer.contents); !loaded.ok()) {
      return absl::Status(loaded.code(), absl::StrCat("layer ", index, ": ", loaded.message()));
    }
  }
  return cache;
}

}  // namespace kvcache::engine
