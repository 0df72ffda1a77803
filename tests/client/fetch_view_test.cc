// The data lane's Fetch chunks read as views (fetch_view.h): for every chunk
// of keys and values protobuf would parse, the same fields and the same
// bytes, in place; anything else (packed or recurrent chunks, malformed or
// unusual encodings, fields it does not read) is left to protobuf; and its
// lists of the fields it reads and leaves match the schema.
#include "fetch_view.h"

#include <random>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "support/schema_fields.h"

namespace kvcache {
namespace {

using testing::FieldsByMessage;
using testing::Numbers;
using ::testing::IsEmpty;

std::string Random(size_t size, std::mt19937_64& rng) {
  std::string bytes(size, '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  return bytes;
}

v1::FetchResponse RandomChunk(std::mt19937_64& rng) {
  v1::FetchResponse chunk;
  chunk.set_layer(static_cast<uint32_t>(rng() % 70));
  chunk.set_start(rng() % 2 ? rng() : rng() % 300);
  for (v1::Tensor* tensor : {chunk.mutable_keys(), chunk.mutable_values()}) {
    tensor->set_dtype(static_cast<v1::DType>(rng() % 4));
    for (int d = 0; d < 4; ++d) tensor->add_shape(rng() % 9);
    tensor->set_data(Random(rng() % 5000, rng));
  }
  return chunk;
}

absl::Span<const std::byte> Bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

std::string AsString(absl::Span<const std::byte> bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

TEST(FetchViewTest, ReadsWhatProtobufReadsWithoutCopyingTheData) {
  std::mt19937_64 rng(5);
  for (int i = 0; i < 2000; ++i) {
    const v1::FetchResponse chunk = RandomChunk(rng);
    const std::string wire = chunk.SerializeAsString();
    v1::FetchResponse header;
    absl::Span<const std::byte> keys, values;
    ASSERT_TRUE(internal::ParseTokenChunk(Bytes(wire), header, keys, values)) << i;
    EXPECT_EQ(AsString(keys), chunk.keys().data());
    EXPECT_EQ(AsString(values), chunk.values().data());
    if (!keys.empty()) {
      EXPECT_GE(keys.data(), reinterpret_cast<const std::byte*>(wire.data()));  // a view
      EXPECT_LE(keys.data() + keys.size(), reinterpret_cast<const std::byte*>(wire.data()) + wire.size());
    }
    v1::FetchResponse expected = chunk;
    expected.mutable_keys()->clear_data();
    expected.mutable_values()->clear_data();
    EXPECT_EQ(header.SerializeAsString(), expected.SerializeAsString()) << i;
  }
}

TEST(FetchViewTest, TakesUnpackedShapesAndFieldsInAnyOrder) {
  // values before keys, the keys' shape unpacked, layer last.
  const std::string keys = std::string("\x08\x02", 2) + "\x10\x01\x10\x02\x10\x03\x10\x04" +
                           "\x1a\x03" + "KKK";
  const std::string values = std::string("\x08\x02\x12\x04\x01\x02\x03\x05\x1a\x02VV", 12);
  const std::string wire = "\x22" + std::string(1, char(values.size())) + values + "\x1a" +
                           std::string(1, char(keys.size())) + keys + "\x08\x07";
  v1::FetchResponse protobuf;
  ASSERT_TRUE(protobuf.ParseFromString(wire));
  v1::FetchResponse header;
  absl::Span<const std::byte> k, v;
  ASSERT_TRUE(internal::ParseTokenChunk(Bytes(wire), header, k, v));
  EXPECT_EQ(AsString(k), protobuf.keys().data());
  EXPECT_EQ(AsString(v), protobuf.values().data());
  EXPECT_EQ(header.layer(), 7u);
  EXPECT_EQ(header.keys().shape_size(), 4);
  EXPECT_EQ(header.values().shape(3), 5u);
}

TEST(FetchViewTest, LeavesEverythingElseToProtobuf) {
  std::mt19937_64 rng(6);
  v1::FetchResponse header;
  absl::Span<const std::byte> k, v;
  v1::FetchResponse packed = RandomChunk(rng);
  packed.mutable_packed_keys()->set_bits(4);
  EXPECT_FALSE(internal::ParseTokenChunk(Bytes(packed.SerializeAsString()), header, k, v));
  v1::FetchResponse state;
  state.set_layer(1);
  state.mutable_state()->set_advance(3);
  EXPECT_FALSE(internal::ParseTokenChunk(Bytes(state.SerializeAsString()), header, k, v));
  const std::string whole = RandomChunk(rng).SerializeAsString();
  for (size_t cut : {size_t{1}, whole.size() / 2, whole.size() - 1}) {
    EXPECT_FALSE(internal::ParseTokenChunk(Bytes(whole.substr(0, cut)), header, k, v)) << cut;
  }
  // Keys sent twice (protobuf would merge them).
  v1::FetchResponse once = RandomChunk(rng);
  const std::string twice = once.SerializeAsString() + "\x1a\x00";
  EXPECT_FALSE(internal::ParseTokenChunk(Bytes(twice), header, k, v));
  // A varint longer than ten bytes.
  EXPECT_FALSE(internal::ParseTokenChunk(Bytes(std::string(11, '\xff')), header, k, v));
}

FieldsByMessage ParsedFields() {
  return {{v1::FetchResponse::descriptor()->full_name(),
           Numbers(internal::kParsedTokenChunkFields)},
          {v1::Tensor::descriptor()->full_name(), Numbers(internal::kParsedTensorFields)}};
}

// Every field of FetchResponse, and of the Tensors it reads, is either read
// here or makes the chunk protobuf's: a field added to the schema fails here
// until it is one or the other.
TEST(FetchViewSchemaTest, EveryFieldTheSchemaHasIsReadOrLeftToProtobuf) {
  const FieldsByMessage left = {{v1::FetchResponse::descriptor()->full_name(),
                                 Numbers(internal::kTokenChunkFieldsLeftToProtobuf)}};
  EXPECT_THAT(testing::UndeclaredFields(*v1::FetchResponse::descriptor(), ParsedFields(), left),
              IsEmpty());
}

// Every field it reads, set, is read: the header is protobuf's, the data views.
TEST(FetchViewSchemaTest, EveryListedFieldIsRead) {
  v1::FetchResponse chunk;
  testing::FillHandledFields(ParsedFields(), chunk);
  ASSERT_THAT(testing::UnsetHandledFields(ParsedFields(), chunk), IsEmpty());
  const std::string wire = chunk.SerializeAsString();
  v1::FetchResponse header;
  absl::Span<const std::byte> keys, values;
  ASSERT_TRUE(internal::ParseTokenChunk(Bytes(wire), header, keys, values));
  EXPECT_EQ(AsString(keys), chunk.keys().data());
  EXPECT_EQ(AsString(values), chunk.values().data());
  chunk.mutable_keys()->clear_data();
  chunk.mutable_values()->clear_data();
  EXPECT_EQ(header.SerializeAsString(), chunk.SerializeAsString());
}

// Each field it leaves to protobuf, and a field the schema lacks in the chunk
// or in a tensor, sends the chunk to protobuf, which reads it whole.
TEST(FetchViewSchemaTest, FieldsNotReadHereLeaveTheChunkToProtobuf) {
  std::mt19937_64 rng(7);
  std::vector<v1::FetchResponse> chunks;
  for (int number : internal::kTokenChunkFieldsLeftToProtobuf) {
    testing::FieldsByMessage one = testing::AllFields(*v1::FetchResponse::descriptor());
    one[v1::FetchResponse::descriptor()->full_name()] = {number};
    testing::FillHandledFields(one, chunks.emplace_back(RandomChunk(rng)));
  }
  chunks.push_back(RandomChunk(rng));
  chunks.back().GetReflection()->MutableUnknownFields(&chunks.back())->AddVarint(1000, 1);
  chunks.push_back(RandomChunk(rng));
  v1::Tensor& keys = *chunks.back().mutable_keys();
  keys.GetReflection()->MutableUnknownFields(&keys)->AddLengthDelimited(1000, "later");
  for (const v1::FetchResponse& chunk : chunks) {
    SCOPED_TRACE(chunk.ShortDebugString().substr(0, 200));
    const std::string wire = chunk.SerializeAsString();
    v1::FetchResponse header;
    absl::Span<const std::byte> k, v;
    EXPECT_FALSE(internal::ParseTokenChunk(Bytes(wire), header, k, v));
    v1::FetchResponse protobuf;
    ASSERT_TRUE(protobuf.ParseFromString(wire));
    EXPECT_EQ(protobuf.SerializeAsString(), wire);
  }
}

}  // namespace
}  // namespace kvcache
