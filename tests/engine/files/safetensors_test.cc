// safetensors bytes of prompt-cache files: round trips, the exact header mlx
// writes, every refusal with its status, and damage (bit flips, truncation)
// caught by the checksum kvcached writes into user metadata.
#include "engine/files/safetensors.h"

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"

namespace kvcache::engine {
namespace {

FileTensor PatternTensor(FileDType dtype, std::vector<uint64_t> shape, int seed) {
  uint64_t bytes = FileDTypeSize(dtype);
  for (uint64_t extent : shape) bytes *= extent;
  FileTensor tensor{.dtype = dtype, .shape = std::move(shape), .data = {}};
  for (uint64_t i = 0; i < bytes; ++i) tensor.data.push_back(std::byte((seed + i * 31) & 0xff));
  return tensor;
}

// A small prompt cache: one standard layer, one quantized layer's packed keys.
PromptCacheFile SmallFile() {
  PromptCacheFile file;
  file.tensors["0.0"] = PatternTensor(FileDType::kF16, {1, 2, 3, 4}, 1);
  file.tensors["0.1"] = PatternTensor(FileDType::kF16, {1, 2, 3, 4}, 2);
  file.tensors["1.0.0"] = PatternTensor(FileDType::kU32, {2, 8}, 3);
  file.metadata = {{"0.0", ""}, {"0.1.0", "3"}, {"1.model", "qwen"}, {"2.0", "KVCache"}};
  return file;
}

std::string RawFile(const std::string& header, const std::string& data) {
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xff));
  return bytes + header + data;
}

std::string DataOf(const FileTensor& tensor) {
  return std::string(reinterpret_cast<const char*>(tensor.data.data()), tensor.data.size());
}

void ExpectSameFile(const PromptCacheFile& actual, const PromptCacheFile& expected) {
  EXPECT_EQ(actual.metadata, expected.metadata);
  ASSERT_EQ(actual.tensors.size(), expected.tensors.size());
  for (const auto& [name, tensor] : expected.tensors) {
    auto found = actual.tensors.find(name);
    ASSERT_NE(found, actual.tensors.end()) << name;
    EXPECT_EQ(found->second.dtype, tensor.dtype) << name;
    EXPECT_EQ(found->second.shape, tensor.shape) << name;
    EXPECT_EQ(found->second.data, tensor.data) << name;
  }
}

void ExpectRefused(const std::string& bytes, absl::StatusCode code, const std::string& message) {
  absl::StatusOr<DecodedSafetensors> decoded = DecodeSafetensors(bytes);
  ASSERT_FALSE(decoded.ok()) << "accepted: " << message;
  EXPECT_EQ(decoded.status().code(), code) << decoded.status();
  EXPECT_NE(decoded.status().message().find(message), absl::string_view::npos)
      << decoded.status() << " does not name " << message;
  EXPECT_EQ(VerifySafetensors(bytes).status(), decoded.status());
}

TEST(SafetensorsTest, RoundTripsEveryDtype) {
  const std::vector<FileDType> dtypes = {FileDType::kF32, FileDType::kF16, FileDType::kBF16,
                                         FileDType::kU32, FileDType::kI32, FileDType::kI64,
                                         FileDType::kU8,  FileDType::kBool};
  PromptCacheFile file;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    file.tensors[absl::StrCat(i, ".0")] = PatternTensor(dtypes[i], {1, 2, i + 1, 3}, i);
  }
  file.tensors["8.0"] = PatternTensor(FileDType::kI64, {}, 9);  // a scalar: one element
  file.metadata = {{"1.tokenizer_config", "{\"a\": [1, \"é\"]}"}, {"2.0", "KVCache"}};
  absl::StatusOr<std::string> bytes = EncodeSafetensorsBytes(file);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<DecodedSafetensors> decoded = DecodeSafetensors(*bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(decoded->checksum_verified);
  ExpectSameFile(decoded->file, file);
}

TEST(SafetensorsTest, EmptyFileRoundTrips) {
  absl::StatusOr<std::string> bytes = EncodeSafetensorsBytes(PromptCacheFile{});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<DecodedSafetensors> decoded = DecodeSafetensors(*bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(decoded->file.tensors.empty());
  EXPECT_TRUE(decoded->file.metadata.empty());
}

std::string CanonicalDigest(absl::string_view bytes) {
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, XXH3_128bits(bytes.data(), bytes.size()));
  return std::string(reinterpret_cast<const char*>(canonical.digest), sizeof(canonical.digest));
}

// Computes the checksum with xxhash directly, one chunk after another, so the
// test trusts neither the codec's chunking nor its threads.
std::string ExpectedChecksum(const std::string& canonical_header, const std::string& data) {
  std::string covered = canonical_header;
  for (size_t at = 0; at < data.size(); at += 4 << 20) {
    covered += CanonicalDigest(absl::string_view(data).substr(at, 4 << 20));
  }
  return "xxh3-128/4MiB:" + absl::BytesToHexString(CanonicalDigest(covered));
}

// The form kvcached wrote before chunking: one stream over header and data.
std::string LegacyChecksum(const std::string& canonical_header, const std::string& data) {
  return absl::BytesToHexString(CanonicalDigest(canonical_header + data));
}

TEST(SafetensorsTest, HeaderIsSortedCanonicalJsonWithTheChecksum) {
  PromptCacheFile file;
  file.tensors["0.1"] = PatternTensor(FileDType::kF16, {1, 2}, 5);
  file.tensors["0.0"] = PatternTensor(FileDType::kU8, {3}, 7);
  file.metadata = {{"2.0", "KVCache"}, {"1.model", "m"}};
  const std::string tensors = R"("0.0":{"data_offsets":[0,3],"dtype":"U8","shape":[3]},)"
                              R"("0.1":{"data_offsets":[3,7],"dtype":"F16","shape":[1,2]})";
  const std::string data = DataOf(file.tensors["0.0"]) + DataOf(file.tensors["0.1"]);
  const std::string checksum = ExpectedChecksum(
      absl::StrCat("{", tensors, R"(,"__metadata__":{"1.model":"m","2.0":"KVCache"}})"), data);
  const std::string header =
      absl::StrCat("{", tensors, R"(,"__metadata__":{"1.kvcached_checksum":")", checksum,
                   R"(","1.model":"m","2.0":"KVCache"}})");

  absl::StatusOr<EncodedSafetensors> encoded = EncodeSafetensors(file);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  EXPECT_EQ(encoded->checksum_hex, checksum);
  EXPECT_EQ(encoded->ToBytes(), RawFile(header, data));
  EXPECT_EQ(encoded->size_bytes, 8 + header.size() + data.size());
}

TEST(SafetensorsTest, FileWithoutChecksumIsAccepted) {
  // As mlx-lm writes it: no kvcached checksum; and as Python's safetensors
  // writes it, with the header padded by spaces and tensors in another order.
  const PromptCacheFile file = SmallFile();
  const std::string tensors =
      R"({"1.0.0":{"dtype":"U32","shape":[2,8],"data_offsets":[0,64]},)"
      R"("0.0":{"dtype":"F16","shape":[1,2,3,4],"data_offsets":[64,112]},)"
      R"("0.1":{"dtype":"F16","shape":[1,2,3,4],"data_offsets":[112,160]},)"
      R"("__metadata__":{"0.0":"","0.1.0":"3","1.model":"qwen","2.0":"KVCache"}}    )";
  const std::string data = DataOf(file.tensors.at("1.0.0")) + DataOf(file.tensors.at("0.0")) +
                           DataOf(file.tensors.at("0.1"));
  absl::StatusOr<DecodedSafetensors> decoded = DecodeSafetensors(RawFile(tensors, data));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_FALSE(decoded->checksum_verified);
  ExpectSameFile(decoded->file, file);
  EXPECT_EQ(VerifySafetensors(RawFile(tensors, data)).value_or(true), false);
}

TEST(SafetensorsTest, EncodeRefusesInconsistentFiles) {
  const auto refused = [](const PromptCacheFile& file, const std::string& message) {
    absl::StatusOr<EncodedSafetensors> encoded = EncodeSafetensors(file);
    ASSERT_FALSE(encoded.ok()) << message;
    EXPECT_EQ(encoded.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(encoded.status().message().find(message), absl::string_view::npos)
        << encoded.status();
  };
  PromptCacheFile file = SmallFile();
  file.tensors["0.0"].data.pop_back();
  refused(file, "tensor \"0.0\" data holds 47 bytes");
  file = SmallFile();
  file.tensors["0.0"].shape = {1, 0, 3};
  refused(file, "tensor \"0.0\" shape has no elements");
  file = SmallFile();
  file.tensors["__metadata__"] = PatternTensor(FileDType::kU8, {1}, 0);
  refused(file, "\"__metadata__\" is reserved");
  file = SmallFile();
  file.metadata[std::string(kSafetensorsChecksumKey)] = "0";
  refused(file, "1.kvcached_checksum is reserved");
  file = SmallFile();
  file.metadata["1.model"] = "\xff\xfe";
  refused(file, "must be UTF-8");
}

struct Refusal {
  std::string what;
  std::string header;
  std::string data;
  absl::StatusCode code;
  std::string message;
};

TEST(SafetensorsTest, DecodeRefusesMalformedFiles) {
  const absl::StatusCode invalid = absl::StatusCode::kInvalidArgument;
  const absl::StatusCode loss = absl::StatusCode::kDataLoss;
  const std::string d8(8, 'x');
  const std::vector<Refusal> refusals = {
      {"not json", "{not json", "", invalid, "not valid JSON"},
      {"not an object", "[1,2]", "", invalid, "not a JSON object"},
      {"unknown dtype", R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", d8, invalid,
       "tensor \"a\" has unknown dtype \"F64\""},
      {"dtype not a string", R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", d8, invalid,
       "unknown dtype 4"},
      {"span", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", d8, invalid,
       "tensor \"a\" shape [3] × F32 is 12 bytes but data_offsets span 8"},
      {"zero elements", R"({"a":{"dtype":"F32","shape":[2,0],"data_offsets":[0,0]}})", "", invalid,
       "tensor \"a\" has no elements"},
      {"negative extent", R"({"a":{"dtype":"U8","shape":[-8],"data_offsets":[0,8]}})", d8, invalid,
       "shape holds -8, not an unsigned integer"},
      {"shape not array", R"({"a":{"dtype":"U8","shape":8,"data_offsets":[0,8]}})", d8, invalid,
       "tensor \"a\" shape is not an array"},
      {"reversed offsets", R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[8,0]}})", d8, invalid,
       "data_offsets [8,0] is not [begin, end]"},
      {"three offsets", R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8,8]}})", d8, invalid,
       "is not [begin, end]"},
      {"extra field", R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8],"x":1}})", d8, invalid,
       "tensor \"a\" is not exactly {dtype, shape, data_offsets}"},
      {"missing field", R"({"a":{"dtype":"U8","shape":[8]}})", d8, invalid, "is not exactly"},
      {"overlap",
       R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
       R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
       d8, invalid, "tensor \"b\" data_offsets begin at 2, overlapping byte 4"},
      {"gap",
       R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
       R"("b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
       d8, invalid, "tensor \"b\" data_offsets begin at 4, leaving a gap after byte 2"},
      {"not from zero", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", d8, invalid,
       "leaving a gap after byte 0"},
      {"trailing data", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", d8, invalid,
       "holds 4 bytes after the last tensor"},
      {"out of bounds", R"({"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}})", d8, loss,
       "truncated: its tensors need 16 data bytes, it holds 8"},
      {"metadata value", R"({"__metadata__":{"k":1}})", "", invalid,
       "__metadata__ \"k\" is 1, not a string"},
      {"metadata not object", R"({"__metadata__":["k"]})", "", invalid,
       "__metadata__ is not an object"},
      {"duplicate tensor",
       R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
       R"("a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})",
       d8, invalid, "has the key \"a\" twice"},
      {"duplicate metadata", R"({"__metadata__":{"k":"1","k":"2"}})", "", invalid,
       "has the key \"k\" twice"},
      {"checksum mismatch", R"({"__metadata__":{"1.kvcached_checksum":"00"}})", "", loss,
       "1.kvcached_checksum mismatch: the file says 00"},
      {"checksum not canonical", R"({"__metadata__": {"1.kvcached_checksum":"00"}})", "", loss,
       "carries 1.kvcached_checksum but is not in canonical form"},
      {"damaged checksum key", R"({"__metadata__":{"1.kvcached_checksuo":"00"}})", "", loss,
       "\"1.kvcached_checksuo\" is a damaged 1.kvcached_checksum"},
  };
  for (const Refusal& refusal : refusals) {
    SCOPED_TRACE(refusal.what);
    ExpectRefused(RawFile(refusal.header, refusal.data), refusal.code, refusal.message);
  }
}

TEST(SafetensorsTest, DecodeRefusesImpossibleHeaderLengths) {
  ExpectRefused("", absl::StatusCode::kDataLoss, "truncated: 0 bytes");
  std::string beyond = RawFile("{}", "");
  beyond[0] = 3;  // header length 3, file holds 2 header bytes
  ExpectRefused(beyond, absl::StatusCode::kDataLoss, "header length 3 runs past its end at 10");
  std::string huge = RawFile("{}", "");
  const uint64_t above_cap = kSafetensorsMaxHeaderBytes + 1;
  for (int i = 0; i < 8; ++i) huge[i] = static_cast<char>((above_cap >> (8 * i)) & 0xff);
  ExpectRefused(huge, absl::StatusCode::kInvalidArgument,
                "header length 100000001 is above mlx's limit of 100000000");
}

// A header of nested brackets deep enough to overflow the stack of a
// recursive printer is refused before anything walks it; brackets inside
// strings (a tokenizer's chat template) do not count.
TEST(SafetensorsTest, DeeplyNestedHeadersAreRefusedWithoutRecursion) {
  constexpr size_t kDepth = 1'000'000;
  const std::string nested = R"({"a":)" + std::string(kDepth, '[') + std::string(kDepth, ']') + "}";
  ExpectRefused(RawFile(nested, ""), absl::StatusCode::kInvalidArgument,
                "nests arrays or objects more than 4 deep");
  ExpectRefused(RawFile(R"({"__metadata__":{"k":[[["x"]]]}})", ""),
                absl::StatusCode::kInvalidArgument, "more than 4 deep");
  PromptCacheFile file = SmallFile();
  file.metadata["1.chat_template"] = std::string(64, '[') + "{{ \"]\" }}" + std::string(64, '{');
  absl::StatusOr<std::string> bytes = EncodeSafetensorsBytes(file);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<DecodedSafetensors> decoded = DecodeSafetensors(*bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->file.metadata.at("1.chat_template"), file.metadata.at("1.chat_template"));
}

TEST(SafetensorsTest, EveryBitFlipIsRefused) {
  absl::StatusOr<std::string> bytes = EncodeSafetensorsBytes(SmallFile());
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  ASSERT_TRUE(DecodeSafetensors(*bytes).ok());
  for (size_t position = 0; position < bytes->size(); ++position) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string damaged = *bytes;
      damaged[position] = static_cast<char>(damaged[position] ^ (1 << bit));
      absl::StatusOr<DecodedSafetensors> decoded = DecodeSafetensors(damaged);
      ASSERT_FALSE(decoded.ok()) << "flip of bit " << bit << " at byte " << position;
      EXPECT_TRUE(decoded.status().code() == absl::StatusCode::kDataLoss ||
                  decoded.status().code() == absl::StatusCode::kInvalidArgument)
          << decoded.status();
    }
  }
}

TEST(SafetensorsTest, TruncationAtEveryLengthIsDataLoss) {
  absl::StatusOr<std::string> bytes = EncodeSafetensorsBytes(SmallFile());
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  for (size_t length = 0; length < bytes->size(); ++length) {
    absl::StatusOr<DecodedSafetensors> decoded = DecodeSafetensors(bytes->substr(0, length));
    ASSERT_FALSE(decoded.ok()) << "truncated to " << length;
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss) << decoded.status();
    EXPECT_NE(decoded.status().message().find("truncated"), absl::string_view::npos);
  }
}

// Tensors that straddle 4 MiB chunk boundaries, hashed on several threads:
// the checksum is the serial one, and damage in any chunk is caught.
TEST(SafetensorsTest, ChunkedChecksumCoversEveryChunk) {
  PromptCacheFile file;
  file.tensors["0.0"] = PatternTensor(FileDType::kU8, {(9 << 20) + 7}, 3);
  file.tensors["0.1"] = PatternTensor(FileDType::kU8, {(15 << 20) + 1}, 4);
  file.tensors["0.2"] = PatternTensor(FileDType::kU8, {5}, 6);
  absl::StatusOr<EncodedSafetensors> encoded = EncodeSafetensors(file);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  const std::string data =
      DataOf(file.tensors["0.0"]) + DataOf(file.tensors["0.1"]) + DataOf(file.tensors["0.2"]);
  const std::string canonical = absl::StrCat(
      R"({"0.0":{"data_offsets":[0,)", (9 << 20) + 7, R"(],"dtype":"U8","shape":[)", (9 << 20) + 7,
      R"(]},"0.1":{"data_offsets":[)", (9 << 20) + 7, ",", (24 << 20) + 8,
      R"(],"dtype":"U8","shape":[)", (15 << 20) + 1, R"(]},"0.2":{"data_offsets":[)",
      (24 << 20) + 8, ",", (24 << 20) + 13, R"(],"dtype":"U8","shape":[5]},"__metadata__":{}})");
  EXPECT_EQ(encoded->checksum_hex, ExpectedChecksum(canonical, data));
  const std::string bytes = encoded->ToBytes();
  ASSERT_TRUE(DecodeSafetensors(bytes).ok());
  const size_t data_begin = bytes.size() - data.size();
  for (size_t at :
       {size_t{0}, size_t{4 << 20} - 1, size_t{4 << 20}, size_t{13 << 20}, data.size() - 1}) {
    std::string damaged = bytes;
    damaged[data_begin + at] = static_cast<char>(damaged[data_begin + at] ^ 0x01);
    ExpectRefused(damaged, absl::StatusCode::kDataLoss, "1.kvcached_checksum mismatch");
  }
}

// Files kvcached wrote before the chunked form still load, and still catch damage.
TEST(SafetensorsTest, LegacyChecksumStillVerifies) {
  const std::string tensors = R"({"0.0":{"data_offsets":[0,4],"dtype":"U8","shape":[4]},)";
  const std::string data = "\x01\x02\x03\x04";
  const std::string checksum =
      LegacyChecksum(tensors + R"("__metadata__":{"2.0":"KVCache"}})", data);
  const std::string header =
      tensors + R"("__metadata__":{"1.kvcached_checksum":")" + checksum + R"(","2.0":"KVCache"}})";
  absl::StatusOr<DecodedSafetensors> decoded = DecodeSafetensors(RawFile(header, data));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(decoded->checksum_verified);
  ExpectRefused(RawFile(header, "\x01\x02\x03\x05"), absl::StatusCode::kDataLoss,
                "1.kvcached_checksum mismatch");
}

TEST(SafetensorsTest, ChecksumCoversTheDataSection) {
  absl::StatusOr<std::string> bytes = EncodeSafetensorsBytes(SmallFile());
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  std::string damaged = *bytes;
  damaged.back() = static_cast<char>(damaged.back() ^ 0x10);
  ExpectRefused(damaged, absl::StatusCode::kDataLoss, "1.kvcached_checksum mismatch");
}

}  // namespace
}  // namespace kvcache::engine
