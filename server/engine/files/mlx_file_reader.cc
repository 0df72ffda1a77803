#include "engine/files/mlx_file_reader.h"

#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/client_text.h"
#include "core/status_macros.h"
#include "engine/files/mlx_file_util.h"

namespace kvcache::engine::mlx_file {
namespace {

// The layer index a tensor key ("3.0", "3.1.2") or metadata key ("0.3.1",
// "2.3") belongs to; nullopt if it has none.
std::optional<uint64_t> LayerOf(absl::string_view key) {
  const size_t dot = key.find('.');
  return ParseDecimal(key.substr(0, dot));
}

// Element count of `shape`, or nullopt past 2^62 (no real file is that big).
std::optional<uint64_t> Elements(const std::vector<uint64_t>& shape) {
  uint64_t count = 1;
  for (uint64_t dim : shape) {
    if (dim != 0 && count > (uint64_t{1} << 62) / dim) return std::nullopt;
    count *= dim;
  }
  return count;
}

}  // namespace

std::optional<uint64_t> ParseDecimal(absl::string_view text) {
  if (text.empty() || text.size() > 18) return std::nullopt;
  uint64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + static_cast<uint64_t>(c - '0');
  }
  return value;
}

absl::Status BadTensor(const std::string& key, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("tensor ", Quoted(key), ": ", why));
}

absl::Status BadMeta(const std::string& key, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("metadata ", Quoted(key), ": ", why));
}

absl::StatusOr<const FileTensor*> FileReader::Tensor(const std::string& key, size_t rank) {
  const auto it = file_.tensors.find(key);
  if (it == file_.tensors.end()) return BadTensor(key, "missing");
  read_tensors_.insert(key);
  const FileTensor& tensor = it->second;
  if (tensor.shape.size() != rank) {
    return BadTensor(key,
                     absl::StrFormat("has %d dimensions, expected %d", tensor.shape.size(), rank));
  }
  const std::optional<uint64_t> elements = Elements(tensor.shape);
  if (!elements.has_value() || *elements == 0) {
    return BadTensor(key, absl::StrCat("shape [", absl::StrJoin(tensor.shape, ","),
                                       "] holds no elements or too many"));
  }
  if (*elements * ElementBytes(tensor.dtype) != tensor.data.size()) {
    return BadTensor(key, absl::StrFormat("%d bytes for shape [%s]", tensor.data.size(),
                                          absl::StrJoin(tensor.shape, ",")));
  }
  return &tensor;
}

absl::StatusOr<std::string> FileReader::Meta(const std::string& key) {
  const auto it = file_.metadata.find(key);
  if (it == file_.metadata.end()) return BadMeta(key, "missing");
  read_meta_.insert(key);
  return it->second;
}

absl::StatusOr<uint64_t> FileReader::MetaNumber(const std::string& key, uint64_t max) {
  ASSIGN_OR_RETURN(const std::string text, Meta(key));
  const std::optional<uint64_t> value = ParseDecimal(text);
  if (!value.has_value()) {
    return BadMeta(key, absl::StrCat(Quoted(text), " is not a non-negative decimal"));
  }
  if (*value > max) return BadMeta(key, absl::StrFormat("%d is above %d", *value, max));
  return *value;
}

absl::Status FileReader::NoMeta(uint32_t layer, const std::string& mlx_class) {
  const std::string key = Key(0, layer);
  const auto it = file_.metadata.find(key);
  if (it != file_.metadata.end()) {
    read_meta_.insert(key);
    if (!it->second.empty()) {
      return BadMeta(key, absl::StrCat(mlx_class, " has no meta_state, but it holds ",
                                       Quoted(it->second), ""));
    }
  }
  return absl::OkStatus();  // any "0.<layer>.*" is refused by CheckAllRead
}

std::string FileReader::UserMeta(const std::string& key) const {
  const auto it = file_.metadata.find(Key(1, key));
  return it == file_.metadata.end() ? "" : it->second;
}

absl::StatusOr<uint32_t> FileReader::CountLayers(uint32_t max_layers) {
  uint32_t layers = 0;
  for (const auto& [key, value] : file_.metadata) {
    if (absl::StartsWith(key, "2.")) ++layers;
  }
  if (layers == 0) return BadMeta("2.0", "missing: the file holds no cache layer");
  if (layers > max_layers) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the file holds %d layers; this server allows %d", layers, max_layers));
  }
  for (uint32_t layer = 0; layer < layers; ++layer) {
    if (file_.metadata.count(Key(2, layer)) == 0) {
      return BadMeta(Key(2, layer), "missing: layer indices must run from 0 without gaps");
    }
  }
  return layers;
}

absl::Status FileReader::CheckAllRead(const std::vector<std::string>& classes) const {
  const auto owner = [&](absl::string_view key) -> std::string {
    const std::optional<uint64_t> layer = LayerOf(key);
    if (!layer.has_value() || *layer >= classes.size()) return "no layer of the file";
    return absl::StrCat("layer ", *layer, "'s ", classes[*layer]);
  };
  for (const auto& [key, tensor] : file_.tensors) {
    if (read_tensors_.count(key) == 0) return BadTensor(key, "not part of " + owner(key));
  }
  for (const auto& [key, value] : file_.metadata) {
    if (absl::StartsWith(key, "1.") || read_meta_.count(key) > 0) continue;
    if (absl::StartsWith(key, "2.")) continue;  // CountLayers saw them all
    if (!absl::StartsWith(key, "0.")) return BadMeta(key, "not a prompt-cache metadata key");
    return BadMeta(key, "not part of " + owner(key.substr(2)) + "'s meta_state");
  }
  return absl::OkStatus();
}

}  // namespace kvcache::engine::mlx_file
