// The client's hand encoder of UpdateRequests (client/update_encoding.h),
// without a server: both encodings (one copied slice, and slices that
// reference the caller's buffers) read back through protobuf's own parser as
// exactly the request meant, for attention layers (keys and values) and
// recurrent layers (a state, with no keys or values on the wire unless given);
// and it writes every field the schema has.
#include "update_encoding.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "support/schema_fields.h"

namespace kvcache {
namespace {

std::vector<std::byte> Bytes(size_t size, uint8_t seed) {
  std::vector<std::byte> out(size);
  for (size_t i = 0; i < size; ++i) out[i] = static_cast<std::byte>(seed + i * 7);
  return out;
}

std::string AsString(absl::Span<const std::byte> bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

// The buffer's bytes in one string, as protobuf would receive them.
std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& slice : slices) {
    out.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return out;
}

// Both encodings of `update`, parsed by protobuf; they must be the same bytes.
v1::UpdateRequest Parse(const LayerUpdate& update) {
  const std::string copied = Flatten(internal::EncodeUpdateCopy("cache-7", update));
  const std::string shared =
      Flatten(internal::EncodeUpdateShared("cache-7", update, std::make_shared<int>(0)));
  EXPECT_EQ(copied, shared);
  v1::UpdateRequest request;
  EXPECT_TRUE(request.ParseFromString(copied));
  return request;
}

void ExpectTensor(const v1::Tensor& tensor, v1::DType dtype, const std::vector<uint64_t>& shape,
                  absl::Span<const std::byte> data) {
  EXPECT_EQ(tensor.dtype(), dtype);
  EXPECT_EQ(std::vector<uint64_t>(tensor.shape().begin(), tensor.shape().end()), shape);
  EXPECT_EQ(tensor.data(), AsString(data));
}

TEST(UpdateEncodingTest, KeysAndValuesReadBackAsSent) {
  const std::vector<std::byte> keys = Bytes(2 * 3 * 4 * 2, 1), values = Bytes(2 * 3 * 4 * 4, 9);
  LayerUpdate update{.layer = 5,
                     .dtype = v1::DTYPE_BFLOAT16,
                     .keys_shape = {1, 2, 3, 4},
                     .keys = keys,
                     .values_shape = {1, 2, 3, 8},
                     .values = values,
                     .expected_offset = 0};
  const v1::UpdateRequest request = Parse(update);
  EXPECT_EQ(request.cache_id(), "cache-7");
  EXPECT_EQ(request.layer(), 5u);
  ExpectTensor(request.keys(), v1::DTYPE_BFLOAT16, {1, 2, 3, 4}, keys);
  ExpectTensor(request.values(), v1::DTYPE_BFLOAT16, {1, 2, 3, 8}, values);
  EXPECT_FALSE(request.has_state());
  ASSERT_TRUE(request.has_expected_offset());  // 0 is sent: it is set
  EXPECT_EQ(request.expected_offset(), 0u);
}

TEST(UpdateEncodingTest, AStateAloneSendsNoKeysOrValues) {
  const std::vector<std::byte> conv = Bytes(2 * 3 * 8 * 4, 3), delta = Bytes(2 * 2 * 4 * 4 * 4, 5);
  LayerUpdate update{.layer = 1,
                     .dtype = v1::DTYPE_FLOAT32,
                     .state = RecurrentStateUpdate{.conv_shape = {2, 3, 8},
                                                   .conv = conv,
                                                   .delta_shape = {2, 2, 4, 4},
                                                   .delta = delta,
                                                   .advance = 300}};
  const v1::UpdateRequest request = Parse(update);
  EXPECT_FALSE(request.has_keys());
  EXPECT_FALSE(request.has_values());
  ASSERT_TRUE(request.has_state());
  ExpectTensor(request.state().conv_state(), v1::DTYPE_FLOAT32, {2, 3, 8}, conv);
  ExpectTensor(request.state().delta_state(), v1::DTYPE_FLOAT32, {2, 2, 4, 4}, delta);
  EXPECT_EQ(request.state().advance(), 300u);
  EXPECT_FALSE(request.has_expected_offset());
}

// Advance 0 (a state replaced in place) and empty tensors are still a state.
TEST(UpdateEncodingTest, AnEmptyStateIsStillAState) {
  LayerUpdate update{.dtype = v1::DTYPE_FLOAT16, .state = RecurrentStateUpdate{}};
  const v1::UpdateRequest request = Parse(update);
  EXPECT_TRUE(request.has_state());
  EXPECT_EQ(request.state().advance(), 0u);
  EXPECT_TRUE(request.state().conv_state().data().empty());
  EXPECT_FALSE(request.has_keys());
}

// Keys and values given beside a state are sent too (the server then refuses
// them), so a client's mistake is not hidden by the encoder.
TEST(UpdateEncodingTest, KeysBesideAStateAreSent) {
  const std::vector<std::byte> keys = Bytes(16, 2), conv = Bytes(8, 4);
  LayerUpdate update{
      .dtype = v1::DTYPE_FLOAT16,
      .keys_shape = {1, 1, 2, 4},
      .keys = keys,
      .state = RecurrentStateUpdate{.conv_shape = {1, 4}, .conv = conv, .advance = 2}};
  const v1::UpdateRequest request = Parse(update);
  ExpectTensor(request.keys(), v1::DTYPE_FLOAT16, {1, 1, 2, 4}, keys);
  EXPECT_TRUE(request.has_values());  // empty, but present: sent as given
  ExpectTensor(request.state().conv_state(), v1::DTYPE_FLOAT16, {1, 4}, conv);
  EXPECT_EQ(request.state().advance(), 2u);
}

// The shared encoding references the caller's bytes and holds the owner
// until the buffer is gone.
TEST(UpdateEncodingTest, SharedEncodingHoldsTheOwnerOfTheStateBytes) {
  auto conv = std::make_shared<std::vector<std::byte>>(Bytes(64, 6));
  std::weak_ptr<std::vector<std::byte>> watch = conv;
  LayerUpdate update{.dtype = v1::DTYPE_FLOAT16,
                     .state = RecurrentStateUpdate{.conv_shape = {1, 4, 8}, .conv = *conv}};
  {
    grpc::ByteBuffer buffer = internal::EncodeUpdateShared("c", update, conv);
    conv.reset();
    EXPECT_FALSE(watch.expired());
    v1::UpdateRequest request;
    ASSERT_TRUE(request.ParseFromString(Flatten(buffer)));
    EXPECT_EQ(request.state().conv_state().data().size(), 64u);
  }
  EXPECT_TRUE(watch.expired());
}

testing::FieldsByMessage EncodedFields() {
  return {{v1::UpdateRequest::descriptor()->full_name(),
           testing::Numbers(internal::kEncodedUpdateRequestFields)},
          {v1::Tensor::descriptor()->full_name(), testing::Numbers(internal::kEncodedTensorFields)},
          {v1::RecurrentState::descriptor()->full_name(),
           testing::Numbers(internal::kEncodedRecurrentStateFields)}};
}

// The encoder writes every field of UpdateRequest and of the messages in it:
// a field added to the schema fails here until it is written.
TEST(UpdateEncodingTest, WritesEveryFieldTheSchemaHas) {
  EXPECT_THAT(testing::UndeclaredFields(*v1::UpdateRequest::descriptor(), EncodedFields()),
              ::testing::IsEmpty());
}

// An update that sets everything puts every listed field on the wire.
TEST(UpdateEncodingTest, EveryListedFieldIsWritten) {
  const std::vector<std::byte> keys = Bytes(16, 1), values = Bytes(16, 2), conv = Bytes(8, 3),
                               delta = Bytes(8, 4);
  LayerUpdate update{
      .layer = 2,
      .dtype = v1::DTYPE_FLOAT32,
      .keys_shape = {1, 1, 1, 4},
      .keys = keys,
      .values_shape = {1, 1, 1, 4},
      .values = values,
      .state = RecurrentStateUpdate{.conv_shape = {1, 2}, .conv = conv,
                                    .delta_shape = {1, 2}, .delta = delta, .advance = 1},
      .expected_offset = 9,
      .speculation_id = "draft"};
  EXPECT_THAT(testing::UnsetHandledFields(EncodedFields(), Parse(update)), ::testing::IsEmpty());
}

}  // namespace
}  // namespace kvcache
