#include "engine/files/safetensors_header.h"

#include <algorithm>
#include <array>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/client_text.h"
#include "core/status_macros.h"
#include "engine/files/safetensors.h"
#include "nlohmann/json.hpp"

namespace kvcache::engine {
namespace {

struct DTypeInfo {
  FileDType dtype;
  absl::string_view name;
  size_t size;
};
constexpr std::array<DTypeInfo, 8> kDTypes = {{
    {FileDType::kF32, "F32", 4},
    {FileDType::kF16, "F16", 2},
    {FileDType::kBF16, "BF16", 2},
    {FileDType::kU32, "U32", 4},
    {FileDType::kI32, "I32", 4},
    {FileDType::kI64, "I64", 8},
    {FileDType::kU8, "U8", 1},
    {FileDType::kBool, "BOOL", 1},
}};

const DTypeInfo& InfoOf(FileDType dtype) { return kDTypes[static_cast<size_t>(dtype)]; }

}  // namespace

size_t FileDTypeSize(FileDType dtype) { return InfoOf(dtype).size; }
absl::string_view FileDTypeName(FileDType dtype) { return InfoOf(dtype).name; }

namespace safetensors_internal {
namespace {

using Json = nlohmann::json;

// Parses JSON, refusing duplicate keys (nlohmann would silently keep the last).
// A safetensors header is three levels deep ({"name": {"shape": [...]}});
// nlohmann's dump() recurses once per level, and a hostile 100 MB header of
// nested brackets would overflow the stack when an error message prints it.
constexpr int kMaxHeaderDepth = 4;

// The deepest nesting of arrays and objects in `text`, brackets inside
// strings aside; stops counting past kMaxHeaderDepth.
int NestingDepth(absl::string_view text) {
  int depth = 0;
  int deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size() && deepest <= kMaxHeaderDepth; ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;  // the escaped character cannot end the string
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

absl::StatusOr<Json> ParseWithoutDuplicates(absl::string_view text) {
  if (NestingDepth(text) > kMaxHeaderDepth) {
    return absl::InvalidArgumentError(absl::StrCat(
        "safetensors header nests arrays or objects more than ", kMaxHeaderDepth, " deep"));
  }
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  auto on_event = [&](int, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start) open_objects.emplace_back();
    if (event == Json::parse_event_t::object_end) open_objects.pop_back();
    if (event == Json::parse_event_t::key &&
        !open_objects.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  Json parsed;
  try {
    parsed = Json::parse(text.begin(), text.end(), on_event);
  } catch (const Json::exception& error) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors header is not valid JSON: ", error.what()));
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors header has the key ", Quoted(duplicate), " twice"));
  }
  return parsed;
}

absl::StatusOr<std::vector<uint64_t>> UnsignedArray(const Json& value, absl::string_view what) {
  if (!value.is_array()) return absl::InvalidArgumentError(absl::StrCat(what, " is not an array"));
  std::vector<uint64_t> numbers;
  for (const Json& element : value) {
    if (!element.is_number_unsigned()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " holds ", element.dump(), ", not an unsigned integer"));
    }
    numbers.push_back(element.get<uint64_t>());
  }
  return numbers;
}

// Bytes the shape holds; refuses zero elements (mlx rejects empty arrays) and overflow.
absl::StatusOr<uint64_t> ShapeBytes(const std::vector<uint64_t>& shape, FileDType dtype,
                                    absl::string_view what) {
  uint64_t bytes = FileDTypeSize(dtype);
  for (uint64_t extent : shape) {
    if (extent == 0) return absl::InvalidArgumentError(absl::StrCat(what, " has no elements"));
    if (__builtin_mul_overflow(bytes, extent, &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(what, " is too large"));
    }
  }
  return bytes;
}

absl::StatusOr<TensorEntry> ParseTensorEntry(const std::string& name, const Json& value) {
  const std::string what = absl::StrCat("tensor ", Quoted(name), "");
  if (!value.is_object() || value.size() != 3 || !value.contains("dtype") ||
      !value.contains("shape") || !value.contains("data_offsets")) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is not exactly {dtype, shape, data_offsets}: ", value.dump()));
  }
  TensorEntry entry{.name = name};
  const Json& dtype = value["dtype"];
  std::optional<FileDType> known =
      dtype.is_string() ? FileDTypeFromName(dtype.get<std::string>()) : std::nullopt;
  if (!known) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has unknown dtype ", dtype.dump()));
  }
  entry.dtype = *known;
  ASSIGN_OR_RETURN(entry.shape, UnsignedArray(value["shape"], what + " shape"));
  ASSIGN_OR_RETURN(std::vector<uint64_t> offsets,
                   UnsignedArray(value["data_offsets"], what + " data_offsets"));
  if (offsets.size() != 2 || offsets[0] > offsets[1]) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " data_offsets ", value["data_offsets"].dump(), " is not [begin, end]"));
  }
  entry.begin = offsets[0];
  entry.end = offsets[1];
  ASSIGN_OR_RETURN(uint64_t bytes, ShapeBytes(entry.shape, entry.dtype, what));
  if (bytes != entry.end - entry.begin) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " shape ", value["shape"].dump(), " × ", FileDTypeName(entry.dtype),
                     " is ", bytes, " bytes but data_offsets span ", entry.end - entry.begin));
  }
  return entry;
}

absl::StatusOr<std::map<std::string, std::string>> ParseMetadata(const Json& value) {
  if (!value.is_object()) {
    return absl::InvalidArgumentError("safetensors __metadata__ is not an object");
  }
  std::map<std::string, std::string> metadata;
  for (const auto& [key, entry] : value.items()) {
    if (!entry.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors __metadata__ ", Quoted(key),
                                                     " is ", entry.dump(), ", not a string"));
    }
    metadata.emplace(key, entry.get<std::string>());
  }
  return metadata;
}

// A bit flip in the checksum's key would turn a kvcached file into one without
// a checksum, loading unverified: refuse a metadata key one bit away from it.
absl::Status RefuseDamagedChecksumKey(const Json& metadata) {
  for (const auto& [key, value] : metadata.items()) {
    if (key.size() != kSafetensorsChecksumKey.size()) continue;
    int differing_bits = 0;
    for (size_t i = 0; i < key.size(); ++i) {
      differing_bits +=
          __builtin_popcount(static_cast<unsigned char>(key[i] ^ kSafetensorsChecksumKey[i]));
    }
    if (differing_bits == 1) {
      return absl::DataLossError(absl::StrCat("safetensors metadata key \"", key,
                                              "\" is a damaged ", kSafetensorsChecksumKey));
    }
  }
  return absl::OkStatus();
}

// Takes the checksum out of `header` and records what it covers. A checksummed
// header must be its own canonical dump: then any change to its bytes either
// breaks the parse, breaks the canonical form, or changes what is hashed.
absl::Status ExtractChecksum(Json& header, absl::string_view raw, ParsedHeader& parsed) {
  if (!header.contains("__metadata__")) return absl::OkStatus();
  Json& metadata = header["__metadata__"];
  const std::string key(kSafetensorsChecksumKey);
  if (!metadata.is_object()) return absl::OkStatus();
  if (!metadata.contains(key)) return RefuseDamagedChecksumKey(metadata);
  if (header.dump() != raw) {
    return absl::DataLossError(
        absl::StrCat("safetensors header carries ", key, " but is not in canonical form"));
  }
  if (!metadata[key].is_string()) {
    return absl::DataLossError(absl::StrCat("safetensors ", key, " is not a string"));
  }
  parsed.checksum_hex = metadata[key].get<std::string>();
  metadata.erase(key);
  parsed.canonical_without_checksum = header.dump();
  return absl::OkStatus();
}

}  // namespace

std::optional<FileDType> FileDTypeFromName(absl::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

absl::StatusOr<ParsedHeader> ParseHeader(absl::string_view header_json) {
  ASSIGN_OR_RETURN(Json header, ParseWithoutDuplicates(header_json));
  if (!header.is_object()) {
    return absl::InvalidArgumentError("safetensors header is not a JSON object");
  }
  ParsedHeader parsed;
  RETURN_IF_ERROR(ExtractChecksum(header, header_json, parsed));
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      ASSIGN_OR_RETURN(parsed.metadata, ParseMetadata(value));
    } else {
      ASSIGN_OR_RETURN(TensorEntry entry, ParseTensorEntry(key, value));
      parsed.tensors.push_back(std::move(entry));
    }
  }
  return parsed;
}

absl::Status CheckDataLayout(const std::vector<TensorEntry>& tensors, uint64_t data_bytes) {
  std::vector<const TensorEntry*> by_offset;
  for (const TensorEntry& entry : tensors) by_offset.push_back(&entry);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorEntry* a, const TensorEntry* b) { return a->begin < b->begin; });
  uint64_t covered = 0;  // every tensor has bytes, so begins are distinct unless they overlap
  for (const TensorEntry* entry : by_offset) {
    if (entry->begin != covered) {
      return absl::InvalidArgumentError(absl::StrCat(
          "safetensors tensor ", Quoted(entry->name), " data_offsets begin at ", entry->begin,
          entry->begin < covered ? ", overlapping" : ", leaving a gap after", " byte ", covered));
    }
    covered = entry->end;
  }
  if (covered > data_bytes) {
    return absl::DataLossError(absl::StrCat("safetensors file is truncated: its tensors need ",
                                            covered, " data bytes, it holds ", data_bytes));
  }
  if (covered < data_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors data section holds ",
                                                   data_bytes - covered,
                                                   " bytes after the last tensor's data_offsets"));
  }
  return absl::OkStatus();
}

}  // namespace safetensors_internal
}  // namespace kvcache::engine
