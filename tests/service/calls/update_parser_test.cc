// The hand parser of UpdateRequest (service/calls/update_parser.h) against
// protobuf's own: every message it accepts parses to what protobuf parses,
// tensors stay in the pieces they arrived in, it reads every field the schema
// has, and what it leaves to protobuf (ParsedUpdate's fallback: fields it
// does not read among others) ends the same way protobuf does, malformed
// messages as INVALID_ARGUMENT.
#include "service/calls/update_parser.h"

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <functional>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/grpc/wire_format.h"
#include "support/schema_fields.h"
#include "update_wire_util.h"

namespace kvcache::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

grpc::ByteBuffer BufferOf(const std::vector<std::string>& pieces) {
  std::vector<grpc::Slice> slices;
  for (const std::string& piece : pieces) slices.emplace_back(piece);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// Parses `bytes` cut into `pieces`, received as gRPC slices, with
// ParsedUpdate and expects protobuf's verdict: the same message, or
// INVALID_ARGUMENT where protobuf fails.
// Returns whether the hand parser took it.
bool ExpectParsedLikeProtobuf(const std::string& bytes, const std::vector<std::string>& pieces) {
  v1::UpdateRequest expected;
  const bool protobuf_ok = expected.ParseFromString(bytes);
  grpc::ByteBuffer buffer = BufferOf(pieces);  // as gRPC hands it over
  service::ReceivedUpdate slices;
  EXPECT_TRUE(slices.Receive(buffer).ok());
  service::ParsedUpdate received;
  const absl::Status status = received.Parse(slices.pieces());
  if (!protobuf_ok) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(received.parsed_by_protobuf()) << "the hand parser took a malformed message";
    return false;
  }
  EXPECT_TRUE(status.ok()) << status;
  if (!status.ok()) return false;
  EXPECT_EQ(Differences(expected, Rebuild(received.view())), "");
  return !received.parsed_by_protobuf();
}

TEST(UpdateParserTest, RandomRequestsParseAsProtobufParsesThem) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 3000; ++i) {
    const v1::UpdateRequest request = RandomUpdateRequest(rng);
    const std::string bytes = rng() % 4 == 0 ? request.SerializeAsString()
                                             : RandomEncoding(request, rng);
    v1::UpdateRequest expected;
    ASSERT_TRUE(expected.ParseFromString(bytes));
    const std::vector<std::string> pieces = RandomPieces(bytes, rng);
    service::UpdateView view;
    ASSERT_TRUE(service::ParseUpdateRequest(Spans(pieces), view)) << "request " << i;
    ASSERT_EQ(Differences(expected, Rebuild(view)), "") << "request " << i;
    ASSERT_TRUE(PointsInto(view, pieces)) << "request " << i << ": a tensor was copied";
  }
}

TEST(UpdateParserTest, LargeTensorsInManySlicesStayWhereTheyArrived) {
  std::mt19937_64 rng(8);
  for (int i = 0; i < 20; ++i) {
    const v1::UpdateRequest request = RandomUpdateRequest(rng, /*max_data=*/3 << 20);
    const std::string bytes = RandomEncoding(request, rng);
    const std::vector<std::string> pieces = RandomPieces(bytes, rng, /*max_cuts=*/200);
    EXPECT_TRUE(ExpectParsedLikeProtobuf(bytes, pieces));
    service::UpdateView view;
    ASSERT_TRUE(service::ParseUpdateRequest(Spans(pieces), view));
    EXPECT_TRUE(PointsInto(view, pieces));
  }
}

TEST(UpdateParserTest, RepeatedScalarsKeepTheLastValue) {
  const std::string tensor = VarintField(1, 2) + VarintField(1, 3) + VarintField(2, 4);
  const std::string bytes = BytesField(1, "first") + VarintField(2, 9) + VarintField(7, 5) +
                            BytesField(3, tensor) + BytesField(1, "second") + VarintField(2, 1) +
                            VarintField(7, 0) +
                            BytesField(5, VarintField(3, 4) + VarintField(3, 6));
  EXPECT_TRUE(ExpectParsedLikeProtobuf(bytes, {bytes}));
  service::UpdateView view;
  ASSERT_TRUE(service::ParseUpdateRequest(Spans({bytes}), view));
  EXPECT_EQ(view.cache_id, "second");
  EXPECT_EQ(view.layer, 1u);
  EXPECT_EQ(view.expected_offset, 0u);
  EXPECT_EQ(view.keys->dtype, 3);
  EXPECT_EQ(view.state->advance, 6u);
}

TEST(UpdateParserTest, WhatProtobufMergesOrChecksIsLeftToProtobuf) {
  const std::string tensor = VarintField(1, 2) + VarintField(2, 4) + BytesField(3, "abcd");
  const std::string layer_eleven_bytes_high = WireTag(2, 0) + std::string(9, '\xff') + "\x7f";
  const std::pair<const char*, std::string> cases[] = {
      {"keys twice (merged)", BytesField(3, tensor) + BytesField(3, VarintField(2, 8))},
      {"data twice (last wins)", BytesField(4, tensor + BytesField(3, "xy"))},
      {"state twice", BytesField(5, VarintField(3, 1)) + BytesField(5, VarintField(3, 2))},
      {"conv_state twice", BytesField(5, BytesField(1, tensor) + BytesField(1, tensor))},
      {"a group", WireTag(99, 3) + VarintField(1, 5) + WireTag(99, 4)},
      {"UTF-8 cache_id", BytesField(1, "cach\xc3\xa9")},
      {"layer with another wire type", BytesField(2, "x")},
      {"keys with another wire type", VarintField(3, 1)},
      {"a 10-byte varint with bits past 63", layer_eleven_bytes_high},
      {"an over-long tag", std::string("\x90\x80\x80\x80\x80\x00", 6) + Varint(1)},
  };
  std::mt19937_64 rng(9);
  for (const auto& [name, bytes] : cases) {
    SCOPED_TRACE(name);
    service::UpdateView view;
    EXPECT_FALSE(service::ParseUpdateRequest(Spans({bytes}), view));
    EXPECT_FALSE(ExpectParsedLikeProtobuf(bytes, RandomPieces(bytes, rng)));
  }
}

TEST(UpdateParserTest, MalformedMessagesAreInvalidArgument) {
  const std::string keys = BytesField(3, VarintField(2, 4) + BytesField(3, std::string(100, 'k')));
  const std::pair<const char*, std::string> cases[] = {
      {"cut inside the keys' data", keys.substr(0, keys.size() - 10)},
      {"a length past the end", WireTag(1, 2) + Varint(50) + "short"},
      {"a length past the enclosing message",
       WireTag(3, 2) + Varint(3) + WireTag(3, 2) + Varint(10) + std::string(10, 'x')},
      {"an 11-byte varint", WireTag(2, 0) + std::string(10, '\x80') + "\x01"},
      {"a varint cut off", WireTag(7, 0) + "\x80\x80"},
      {"field number 0", VarintField(0, 1)},
      {"wire type 6", WireTag(9, 6) + "x"},
      {"wire type 7", WireTag(9, 7) + "x"},
      {"an end-group tag alone", WireTag(9, 4)},
      {"invalid UTF-8 in cache_id", BytesField(1, "\xff\xfe")},
      {"a packed shape cut off", BytesField(3, WireTag(2, 2) + Varint(2) + "\x80\x80")},
      {"a fixed64 cut off", WireTag(8, 1) + "1234"},
  };
  for (const auto& [name, bytes] : cases) {
    SCOPED_TRACE(name);
    v1::UpdateRequest protobuf;
    ASSERT_FALSE(protobuf.ParseFromString(bytes)) << "not malformed after all";
    service::UpdateView view;
    EXPECT_FALSE(service::ParseUpdateRequest(Spans({bytes}), view));
    service::ParsedUpdate received;
    EXPECT_EQ(received.Parse(Spans({bytes})).code(), absl::StatusCode::kInvalidArgument);
  }
}

// Valid messages broken at random (cut, bytes flipped, inserted or doubled):
// ParsedUpdate must always agree with protobuf, accepted or not.
TEST(UpdateParserTest, DamagedMessagesEndAsProtobufSays) {
  std::mt19937_64 rng(10);
  int by_hand = 0, refused = 0;
  for (int i = 0; i < 4000; ++i) {
    const v1::UpdateRequest request = RandomUpdateRequest(rng, 64);
    const UnknownFields unknown = rng() % 4 == 0 ? UnknownFields::kSome : UnknownFields::kNone;
    std::string bytes = RandomEncoding(request, rng, unknown);
    if (bytes.empty()) continue;
    const size_t at = rng() % bytes.size();
    switch (rng() % 4) {
      case 0: bytes.resize(at); break;
      case 1: bytes[at] = static_cast<char>(rng()); break;
      case 2: bytes.insert(at, 1, static_cast<char>(rng())); break;
      default: bytes.insert(at, bytes.substr(at, rng() % 8)); break;
    }
    SCOPED_TRACE(i);
    v1::UpdateRequest protobuf;
    if (!protobuf.ParseFromString(bytes)) ++refused;
    if (ExpectParsedLikeProtobuf(bytes, RandomPieces(bytes, rng, 10))) ++by_hand;
  }
  // Every outcome happened: parsed by hand, parsed by protobuf, refused.
  EXPECT_GT(by_hand, 500) << refused;
  EXPECT_GT(refused, 500) << by_hand;
  EXPECT_GT(4000 - refused - by_hand, 10) << by_hand << " " << refused;
}

TEST(UpdateParserTest, EmptyMessageIsAllDefaults) {
  grpc::ByteBuffer buffer;  // gRPC hands an empty message over as no buffer at all
  service::ReceivedUpdate slices;
  ASSERT_TRUE(slices.Receive(buffer).ok());
  service::ParsedUpdate received;
  ASSERT_TRUE(received.Parse(slices.pieces()).ok());
  EXPECT_EQ(Differences(v1::UpdateRequest(), Rebuild(received.view())), "");
  EXPECT_FALSE(received.parsed_by_protobuf());
}

TEST(UpdateParserTest, ResponsesAreEncodedAsProtobufEncodesThem) {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 1000; ++i) {
    v1::UpdateResponse response;
    if (rng() % 3 != 0) response.set_layer(static_cast<uint32_t>(rng() >> (rng() % 64)));
    if (rng() % 3 != 0) response.set_offset(rng() >> (rng() % 64));
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(service::EncodeUpdateResponse(response).Dump(&slices).ok());
    std::string encoded;
    for (const grpc::Slice& slice : slices) {
      encoded.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    ASSERT_EQ(encoded, response.SerializeAsString());
  }
}

// What the hand parser reads, by message.
FieldsByMessage ParsedFields() {
  return {{v1::UpdateRequest::descriptor()->full_name(),
           Numbers(service::kParsedUpdateRequestFields)},
          {v1::Tensor::descriptor()->full_name(), Numbers(service::kParsedTensorFields)},
          {v1::RecurrentState::descriptor()->full_name(),
           Numbers(service::kParsedRecurrentStateFields)}};
}

// Whether `message` or a message in it holds fields the schema lacks.
bool HoldsUnknownFields(const google::protobuf::Message& message) {
  const google::protobuf::Reflection& reflection = *message.GetReflection();
  if (!reflection.GetUnknownFields(message).empty()) return true;
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection.ListFields(message, &fields);
  return std::any_of(fields.begin(), fields.end(), [&](const auto* field) {
    return field->message_type() != nullptr && !field->is_repeated() &&
           HoldsUnknownFields(reflection.GetMessage(message, field));
  });
}

// The parser reads every field of UpdateRequest and of the messages in it: a
// field added to the schema fails here until the parser reads it.
TEST(UpdateParserSchemaTest, ReadsEveryFieldTheSchemaHas) {
  EXPECT_THAT(UndeclaredFields(*v1::UpdateRequest::descriptor(), ParsedFields()), IsEmpty());
}

// The check above, given lists that leave a field out (as a field added to
// the schema would be left out), names it.
TEST(UpdateParserSchemaTest, AFieldLeftOutOfTheListsIsNamed) {
  FieldsByMessage fewer = ParsedFields();
  std::vector<int>& tensor = fewer[v1::Tensor::descriptor()->full_name()];
  tensor.erase(std::find(tensor.begin(), tensor.end(), v1::Tensor::kDataFieldNumber));
  EXPECT_THAT(UndeclaredFields(*v1::UpdateRequest::descriptor(), fewer),
              ElementsAre(HasSubstr("kvcache.v1.Tensor.data = 3")));
  fewer.erase(v1::RecurrentState::descriptor()->full_name());
  EXPECT_THAT(UndeclaredFields(*v1::UpdateRequest::descriptor(), fewer),
              ElementsAre(HasSubstr("kvcache.v1.Tensor.data = 3"),
                          HasSubstr("kvcache.v1.RecurrentState: reached, but no fields")));
}

// Every field the lists name, set, is read by hand, to what protobuf reads.
TEST(UpdateParserSchemaTest, EveryListedFieldIsReadByHand) {
  v1::UpdateRequest request;
  FillHandledFields(ParsedFields(), request);
  ASSERT_THAT(UnsetHandledFields(ParsedFields(), request), IsEmpty());
  const std::string bytes = request.SerializeAsString();
  EXPECT_TRUE(ExpectParsedLikeProtobuf(bytes, {bytes}));
}

// A field the parser does not read, of any wire type, in the request or in
// any message within it, sends the request to protobuf: the request comes out
// as protobuf parses it (the unknown field kept there, and read by nothing).
TEST(UpdateParserTest, AFieldNotReadHereLeavesTheMessageToProtobuf) {
  v1::UpdateRequest filled;
  FillHandledFields(ParsedFields(), filled);
  using Place = std::function<google::protobuf::Message*(v1::UpdateRequest&)>;
  const std::pair<const char*, Place> places[] = {
      {"request", [](v1::UpdateRequest& r) { return &r; }},
      {"keys", [](v1::UpdateRequest& r) { return r.mutable_keys(); }},
      {"values", [](v1::UpdateRequest& r) { return r.mutable_values(); }},
      {"state", [](v1::UpdateRequest& r) { return r.mutable_state(); }},
      {"conv_state", [](v1::UpdateRequest& r) { return r.mutable_state()->mutable_conv_state(); }},
      {"delta_state", [](v1::UpdateRequest& r) { return r.mutable_state()->mutable_delta_state(); }},
  };
  constexpr int kNumber = 1000;
  std::mt19937_64 rng(12);
  for (const auto& [where, place] : places) {
    for (int wire_type : {0, 1, 2, 3, 5}) {
      SCOPED_TRACE(::testing::Message() << where << ", wire type " << wire_type);
      v1::UpdateRequest request = filled;
      google::protobuf::Message* message = place(request);
      ASSERT_EQ(message->GetDescriptor()->FindFieldByNumber(kNumber), nullptr);
      google::protobuf::UnknownFieldSet* unknown =
          message->GetReflection()->MutableUnknownFields(message);
      switch (wire_type) {
        case 0: unknown->AddVarint(kNumber, 300); break;
        case 1: unknown->AddFixed64(kNumber, 7); break;
        case 2: unknown->AddLengthDelimited(kNumber, "later"); break;
        case 3: unknown->AddGroup(kNumber)->AddVarint(1, 5); break;
        default: unknown->AddFixed32(kNumber, 7); break;
      }
      const std::string bytes = request.SerializeAsString();
      service::UpdateView view;
      EXPECT_FALSE(service::ParseUpdateRequest(Spans({bytes}), view));
      ASSERT_TRUE(v1::UpdateRequest().ParseFromString(bytes));
      EXPECT_FALSE(ExpectParsedLikeProtobuf(bytes, RandomPieces(bytes, rng)));
    }
  }
}

// Random requests, unknown fields among their fields or not: those with one
// go to protobuf, the others are read by hand, and all end as protobuf says.
TEST(UpdateParserTest, RequestsWithUnknownFieldsGoToProtobufTheRestAreReadByHand) {
  std::mt19937_64 rng(13);
  int by_hand = 0;
  for (int i = 0; i < 1500; ++i) {
    SCOPED_TRACE(i);
    const std::string bytes =
        RandomEncoding(RandomUpdateRequest(rng, 64), rng, UnknownFields::kSome);
    v1::UpdateRequest protobuf;
    ASSERT_TRUE(protobuf.ParseFromString(bytes));
    const bool read_by_hand = ExpectParsedLikeProtobuf(bytes, RandomPieces(bytes, rng));
    EXPECT_EQ(read_by_hand, !HoldsUnknownFields(protobuf));
    by_hand += read_by_hand;
  }
  // Both ways were taken.
  EXPECT_GT(by_hand, 50);
  EXPECT_LT(by_hand, 1450);
}

// The encoder writes every field of UpdateResponse: a field added to the
// schema fails here until it does.
TEST(UpdateParserSchemaTest, ResponsesWriteEveryFieldTheSchemaHas) {
  const FieldsByMessage encoded = {{v1::UpdateResponse::descriptor()->full_name(),
                                    Numbers(service::kEncodedUpdateResponseFields)}};
  EXPECT_THAT(UndeclaredFields(*v1::UpdateResponse::descriptor(), encoded), IsEmpty());
  v1::UpdateResponse response;
  FillHandledFields(encoded, response);
  ASSERT_THAT(UnsetHandledFields(encoded, response), IsEmpty());
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(service::EncodeUpdateResponse(response).Dump(&slices).ok());
  ASSERT_EQ(slices.size(), 1u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(slices[0].begin()), slices[0].size()),
            response.SerializeAsString());
}

}  // namespace
}  // namespace kvcache::testing
