// The Update stream's hand parser over a real connection: requests encoded in
// ways protobuf's serialiser never uses, ones only protobuf's parser handles,
// and malformed ones, sent as raw bytes; and recurrent states through the
// generated stub. Each is applied as protobuf would read it, or ends the
// stream with INVALID_ARGUMENT after the acknowledgements before it.
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/sync_stream.h>

#include <random>
#include <string>
#include <vector>

#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service_test_util.h"
#include "update_wire_util.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;

struct RawStreamResult {
  std::vector<v1::UpdateResponse> acks;
  grpc::Status status;
};

class E2eUpdateWireTest : public E2eTest {
 protected:
  // Layer 0: standard, 1 head of dim 8 (so a layer's keys are its tokens'
  // keys in order); layer 1: recurrent, conv [1, 3, 16], delta [1, 2, 4, 8].
  void SetUp() override {
    E2eTest::SetUp();
    if (HasFatalFailure()) return;
    spec_ = ProtoSpec(1, 1, 8);
    v1::RecurrentLayer* kind = spec_.add_layers()->mutable_recurrent();
    kind->set_conv_tail(3);
    kind->set_conv_dim(16);
    kind->set_num_v_heads(2);
    kind->set_head_v_dim(4);
    kind->set_head_k_dim(8);
    absl::StatusOr<v1::CacheInfo> info = client().CreateCache(spec_);
    ASSERT_TRUE(info.ok()) << info.status();
    cache_id_ = info->cache_id();
  }

  v1::UpdateRequest StateUpdate(uint64_t advance) {
    v1::UpdateRequest request;
    request.set_cache_id(cache_id_);
    request.set_layer(1);
    v1::RecurrentState* state = request.mutable_state();
    *state->mutable_conv_state() = RandomTensor(v1::DTYPE_FLOAT16, {1, 3, 16}, rng_);
    *state->mutable_delta_state() = RandomTensor(v1::DTYPE_FLOAT16, {1, 2, 4, 8}, rng_);
    state->set_advance(advance);
    return request;
  }

  // Sends each message's bytes, cut into slices at random, on one Update stream.
  RawStreamResult SendRaw(const std::vector<std::string>& messages) {
    auto channel = grpc::CreateChannel(server_->server().address(),
                                       grpc::InsecureChannelCredentials());
    const grpc::internal::RpcMethod method("/kvcache.v1.KvCacheService/Update",
                                           grpc::internal::RpcMethod::BIDI_STREAMING, channel);
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, v1::UpdateResponse>> stream(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, v1::UpdateResponse>::Create(
            channel.get(), method, &context));
    for (const std::string& message : messages) {
      std::vector<grpc::Slice> slices;
      for (const std::string& piece : RandomPieces(message, rng_, 8)) slices.emplace_back(piece);
      if (!stream->Write(grpc::ByteBuffer(slices.data(), slices.size()))) break;
    }
    stream->WritesDone();
    RawStreamResult result;
    v1::UpdateResponse ack;
    while (stream->Read(&ack)) result.acks.push_back(ack);
    result.status = stream->Finish();
    return result;
  }

  v1::CacheSpec spec_;
  std::string cache_id_;
  std::mt19937_64 rng_{3};
};

TEST_P(E2eUpdateWireTest, UnusualEncodingsAreAppliedAsProtobufReadsThem) {
  const v1::UpdateRequest first = RandomUpdate(cache_id_, spec_, 0, 3, rng_);
  const v1::UpdateRequest second = RandomUpdate(cache_id_, spec_, 0, 2, rng_);
  // Fields reordered, shapes unpacked, maybe unknown fields (which make it
  // protobuf's). A group: protobuf's. Then a state, reordered.
  const std::string group = WireTag(99, 3) + VarintField(1, 5) + WireTag(99, 4);
  const RawStreamResult result =
      SendRaw({RandomEncoding(first, rng_, UnknownFields::kSome),
               second.SerializeAsString() + group,
               RandomEncoding(StateUpdate(4), rng_, UnknownFields::kSome)});
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  ASSERT_EQ(result.acks.size(), 3u);
  EXPECT_EQ(result.acks[1].offset(), 5u);
  EXPECT_EQ(result.acks[2].layer(), 1u);
  EXPECT_EQ(result.acks[2].offset(), 4u);
  absl::StatusOr<LayerHistory> history = client().FetchLayer(cache_id_, "", 0);
  ASSERT_TRUE(history.ok()) << history.status();
  EXPECT_EQ(history->tokens, 5u);
  const std::string keys = first.keys().data() + second.keys().data();
  const std::string values = first.values().data() + second.values().data();
  EXPECT_TRUE(std::equal(keys.begin(), keys.end(), history->keys.begin(), history->keys.end(),
                         [](char a, std::byte b) { return std::byte(a) == b; }));
  EXPECT_TRUE(std::equal(values.begin(), values.end(), history->values.begin(),
                         history->values.end(),
                         [](char a, std::byte b) { return std::byte(a) == b; }));
}

TEST_P(E2eUpdateWireTest, MalformedMessageEndsTheStreamAfterEarlierAcknowledgements) {
  const std::string good = RandomUpdate(cache_id_, spec_, 0, 2, rng_).SerializeAsString();
  const RawStreamResult result = SendRaw({good, good.substr(0, good.size() - 5), good});
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(result.status.error_message(), HasSubstr("UpdateRequest"));
  ASSERT_EQ(result.acks.size(), 1u);
  EXPECT_EQ(result.acks[0].offset(), 2u);
  absl::StatusOr<v1::CacheInfo> info = client().GetCache(cache_id_);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_THAT(info->layer_offsets(), ::testing::ElementsAre(2, 0));
}

// Through the generated stub: a recurrent layer takes states, refuses keys.
TEST_P(E2eUpdateWireTest, RecurrentLayersTakeStatesOverTheWire) {
  grpc::ClientContext context;
  auto stream = client().stub().Update(&context);
  ASSERT_TRUE(stream->Write(StateUpdate(4)));
  v1::UpdateRequest replace = StateUpdate(0);
  replace.set_expected_offset(4);
  ASSERT_TRUE(stream->Write(replace));
  v1::UpdateRequest keys_on_state = RandomUpdate(cache_id_, spec_, 0, 1, rng_);
  keys_on_state.set_layer(1);
  stream->Write(keys_on_state);
  stream->WritesDone();
  std::vector<v1::UpdateResponse> acks;
  for (v1::UpdateResponse ack; stream->Read(&ack);) acks.push_back(ack);
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("keys"));
  ASSERT_EQ(acks.size(), 2u);
  EXPECT_EQ(acks[0].offset(), 4u);
  EXPECT_EQ(acks[1].offset(), 4u);
  absl::StatusOr<v1::CacheInfo> info = client().GetCache(cache_id_);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_THAT(info->layer_offsets(), ::testing::ElementsAre(0, 4));
}

INSTANTIATE_TEST_SUITE_P(Paths, E2eUpdateWireTest, ::testing::ValuesIn(kE2ePaths), PathTestName);

}  // namespace
}  // namespace kvcache::testing
