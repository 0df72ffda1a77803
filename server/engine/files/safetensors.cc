#include "engine/files/safetensors.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/client_text.h"
#include "core/status_macros.h"
#include "engine/files/file_checksum.h"
#include "engine/files/fresh_memory.h"
#include "engine/files/safetensors_header.h"
#include "nlohmann/json.hpp"

namespace kvcache::engine {
namespace {

using Json = nlohmann::json;
using safetensors_internal::ParsedHeader;

constexpr size_t kLengthBytes = 8;  // the header length, u64 little-endian

absl::Status CheckTensorForEncoding(const std::string& name, const FileTensor& tensor) {
  if (name == "__metadata__") {
    return absl::InvalidArgumentError("tensor name \"__metadata__\" is reserved by safetensors");
  }
  uint64_t bytes = FileDTypeSize(tensor.dtype);
  for (uint64_t extent : tensor.shape) {
    if (extent == 0 || __builtin_mul_overflow(bytes, extent, &bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", Quoted(name), " shape has no elements or is too large"));
    }
  }
  if (bytes != tensor.data.size()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", Quoted(name), " data holds ",
                                                   tensor.data.size(), " bytes, its shape × ",
                                                   FileDTypeName(tensor.dtype), " needs ", bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> DumpHeader(const Json& header) {
  try {
    return header.dump();
  } catch (const Json::exception& error) {  // a name or value that is not UTF-8
    return absl::InvalidArgumentError(
        absl::StrCat("prompt-cache names and metadata must be UTF-8: ", error.what()));
  }
}

std::string LengthPrefixed(absl::string_view header_json) {
  std::string prefix(kLengthBytes, '\0');
  for (size_t i = 0; i < kLengthBytes; ++i) {
    prefix[i] = static_cast<char>((uint64_t{header_json.size()} >> (8 * i)) & 0xff);
  }
  prefix.append(header_json.data(), header_json.size());
  return prefix;
}

uint64_t ReadLength(absl::string_view bytes) {
  uint64_t length = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) {
    length |= uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  }
  return length;
}

// A file whose every check has passed: its parsed header and its data section.
struct CheckedFile {
  ParsedHeader header;
  absl::string_view data;
  bool checksum_verified = false;
};

absl::Status VerifyChecksum(const ParsedHeader& header, absl::string_view data) {
  const absl::Span<const std::byte> data_span(reinterpret_cast<const std::byte*>(data.data()),
                                              data.size());
  const std::optional<std::string> actual =
      RecomputeFileChecksum(*header.checksum_hex, header.canonical_without_checksum, {data_span});
  if (!actual.has_value()) {
    return absl::DataLossError(absl::StrCat("safetensors ", kSafetensorsChecksumKey,
                                            " mismatch: the file says ", *header.checksum_hex,
                                            ", which is no checksum kvcached writes"));
  }
  if (*actual != *header.checksum_hex) {
    return absl::DataLossError(absl::StrCat("safetensors ", kSafetensorsChecksumKey,
                                            " mismatch: the file says ", *header.checksum_hex,
                                            ", its bytes hash to ", *actual));
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckedFile> CheckFile(absl::string_view bytes) {
  if (bytes.size() < kLengthBytes) {
    return absl::DataLossError(absl::StrCat("safetensors file is truncated: ", bytes.size(),
                                            " bytes, shorter than its 8-byte header length"));
  }
  const uint64_t header_bytes = ReadLength(bytes);
  if (header_bytes > kSafetensorsMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors header length ", header_bytes,
                                                   " is above mlx's limit of ",
                                                   kSafetensorsMaxHeaderBytes));
  }
  if (header_bytes > bytes.size() - kLengthBytes) {
    return absl::DataLossError(absl::StrCat("safetensors file is truncated: header length ",
                                            header_bytes, " runs past its end at ", bytes.size()));
  }
  CheckedFile checked;
  ASSIGN_OR_RETURN(checked.header,
                   safetensors_internal::ParseHeader(bytes.substr(kLengthBytes, header_bytes)));
  checked.data = bytes.substr(kLengthBytes + header_bytes);
  RETURN_IF_ERROR(
      safetensors_internal::CheckDataLayout(checked.header.tensors, checked.data.size()));
  if (checked.header.checksum_hex) {
    RETURN_IF_ERROR(VerifyChecksum(checked.header, checked.data));
    checked.checksum_verified = true;
  }
  return checked;
}

}  // namespace

std::string EncodedSafetensors::ToBytes() const {
  std::string bytes;
  bytes.reserve(size_bytes);
  bytes.append(prefix);
  for (absl::Span<const std::byte> piece : tensor_data) {
    bytes.append(reinterpret_cast<const char*>(piece.data()), piece.size());
  }
  return bytes;
}

absl::StatusOr<EncodedSafetensors> EncodeSafetensors(const PromptCacheFile& file) {
  const std::string checksum_key(kSafetensorsChecksumKey);
  if (file.metadata.contains(checksum_key)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata key ", checksum_key, " is reserved for kvcached's checksum"));
  }
  Json header = Json::object();
  header["__metadata__"] = Json(file.metadata);
  EncodedSafetensors encoded;
  uint64_t offset = 0;  // tensors follow each other in key order
  for (const auto& [name, tensor] : file.tensors) {
    RETURN_IF_ERROR(CheckTensorForEncoding(name, tensor));
    header[name] = {{"dtype", std::string(FileDTypeName(tensor.dtype))},
                    {"shape", tensor.shape},
                    {"data_offsets", Json::array({offset, offset + tensor.data.size()})}};
    encoded.tensor_data.emplace_back(tensor.data.data(), tensor.data.size());
    offset += tensor.data.size();
  }
  ASSIGN_OR_RETURN(std::string canonical, DumpHeader(header));
  encoded.checksum_hex = FileChecksum(canonical, encoded.tensor_data);
  header["__metadata__"][checksum_key] = encoded.checksum_hex;
  encoded.prefix = LengthPrefixed(header.dump());
  encoded.size_bytes = encoded.prefix.size() + offset;
  return encoded;
}

absl::StatusOr<std::string> EncodeSafetensorsBytes(const PromptCacheFile& file) {
  ASSIGN_OR_RETURN(EncodedSafetensors encoded, EncodeSafetensors(file));
  return encoded.ToBytes();
}

namespace {

// Every check, then each tensor copied out of `bytes`, or borrowed from them
// when `backing` (which holds them) is given.
absl::StatusOr<DecodedSafetensors> Decode(absl::string_view bytes,
                                          std::shared_ptr<const void> backing) {
  ASSIGN_OR_RETURN(CheckedFile checked, CheckFile(bytes));
  DecodedSafetensors decoded;
  decoded.checksum_verified = checked.checksum_verified;
  decoded.file.metadata = std::move(checked.header.metadata);
  for (safetensors_internal::TensorEntry& entry : checked.header.tensors) {
    const auto* begin = reinterpret_cast<const std::byte*>(checked.data.data()) + entry.begin;
    const absl::Span<const std::byte> tensor_bytes(begin, entry.end - entry.begin);
    FileTensor tensor{.dtype = entry.dtype, .shape = std::move(entry.shape), .data = {}};
    if (backing != nullptr) {
      tensor.data = FileBytes::Borrow(tensor_bytes);
    } else {
      std::vector<std::byte> copy;
      copy.reserve(tensor_bytes.size());  // then one copy, no zero fill
      PrepareFreshBuffer(copy.data(), copy.capacity());
      copy.insert(copy.end(), tensor_bytes.begin(), tensor_bytes.end());
      tensor.data = std::move(copy);
    }
    decoded.file.tensors.emplace(std::move(entry.name), std::move(tensor));
  }
  decoded.file.backing = std::move(backing);
  return decoded;
}

}  // namespace

absl::StatusOr<DecodedSafetensors> DecodeSafetensors(absl::string_view bytes) {
  return Decode(bytes, nullptr);
}

absl::StatusOr<DecodedSafetensors> DecodeSafetensorsInPlace(absl::string_view bytes,
                                                            std::shared_ptr<const void> backing) {
  return Decode(bytes, std::move(backing));
}

absl::StatusOr<bool> VerifySafetensors(absl::string_view bytes) {
  ASSIGN_OR_RETURN(CheckedFile checked, CheckFile(bytes));
  return checked.checksum_verified;
}

}  // namespace kvcache::engine
