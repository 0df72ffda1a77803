// The Update core (server/service/calls/update_call.h) without a network: messages
// in pieces are applied and acknowledged with protobuf's encoding of their
// UpdateResponse, the first failure ends the call (later messages are not
// read, let alone applied) and is its status, and the next call on the same
// connection starts afresh.
#include "service/calls/update_call.h"

#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "handlers_test_base.h"
#include "update_wire_util.h"

namespace kvcache::testing {
namespace {

class UpdateCallTest : public HandlersTestBase {
 protected:
  void SetUp() override {
    HandlersTestBase::SetUp();
    if (HasFatalFailure()) return;
    spec_ = MakeSpec({StandardLayerSpec(2, 8), StandardLayerSpec(1, 16, 8)});
    id_ = Create(spec_);
  }

  // A random update of `layer`, serialized and cut into pieces at random.
  std::vector<std::string> Message(uint32_t layer, uint64_t tokens) {
    LayerUpdateData data;
    const v1::UpdateRequest request = RandomLayerUpdate(id_, spec_, layer, tokens, data);
    return RandomPieces(request.SerializeAsString(), rng_, 6);
  }

  std::vector<uint64_t> Offsets() {
    absl::StatusOr<engine::CacheInfo> info = engine_->GetCache(id_);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->layer_offsets : std::vector<uint64_t>();
  }

  engine::CacheSpec spec_;
  std::string id_;
};

TEST_P(UpdateCallTest, MessagesInPiecesAreAppliedAndAcknowledged) {
  service::UpdateCall call(*handlers_);
  uint64_t offset = 0;
  for (uint64_t tokens : {5, 1, 17}) {
    offset += tokens;
    for (uint32_t layer = 0; layer < 2; ++layer) {
      const std::vector<std::string> pieces = Message(layer, tokens);
      const absl::StatusOr<service::EncodedAck> ack = call.Apply(Spans(pieces));
      ASSERT_TRUE(ack.ok()) << ack.status();
      v1::UpdateResponse expected;
      expected.set_layer(layer);
      expected.set_offset(offset);
      const absl::Span<const std::byte> bytes = ack->bytes();
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                expected.SerializeAsString());
    }
  }
  EXPECT_FALSE(call.failed());
  EXPECT_TRUE(call.Finish().ok());
  EXPECT_EQ(Offsets(), (std::vector<uint64_t>{23, 23}));
}

TEST_P(UpdateCallTest, TheFirstFailureEndsTheCallAndIsItsStatus) {
  service::UpdateCall call(*handlers_);
  ASSERT_TRUE(call.Apply(Spans(Message(0, 3))).ok());
  const std::string malformed = "\x0a\x7f";
  const absl::StatusOr<service::EncodedAck> refused = call.Apply(Spans({malformed}));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("UpdateRequest"), absl::string_view::npos);
  EXPECT_TRUE(call.failed());
  // Well-formed, but the call has ended: not applied.
  EXPECT_EQ(call.Apply(Spans(Message(1, 3))).status(), refused.status());
  EXPECT_EQ(Offsets(), (std::vector<uint64_t>{3, 0}));
  EXPECT_EQ(call.Finish(), refused.status());
  // The next call on the connection.
  EXPECT_FALSE(call.failed());
  ASSERT_TRUE(call.Apply(Spans(Message(1, 3))).ok());
  EXPECT_TRUE(call.Finish().ok());
  EXPECT_EQ(Offsets(), (std::vector<uint64_t>{3, 3}));
}

// A message that names another cache than the one the call wrote to: the
// spec it keeps is replaced, not used for the other cache's layers.
TEST_P(UpdateCallTest, AnotherCacheIsCheckedAgainstItsOwnSpec) {
  service::UpdateCall call(*handlers_);
  ASSERT_TRUE(call.Apply(Spans(Message(0, 2))).ok());
  const std::string first = id_;
  spec_ = MakeSpec({StandardLayerSpec(1, 4)});
  id_ = Create(spec_);
  const absl::StatusOr<service::EncodedAck> ack = call.Apply(Spans(Message(0, 2)));
  ASSERT_TRUE(ack.ok()) << ack.status();
  std::vector<std::string> other_layer = Message(0, 2);
  v1::UpdateRequest request;
  ASSERT_TRUE(request.ParseFromString(absl::StrJoin(other_layer, "")));
  request.set_layer(1);  // the first cache has it; this one does not
  const absl::StatusOr<service::EncodedAck> refused =
      call.Apply(Spans({request.SerializeAsString()}));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("layer"), absl::string_view::npos);
  (void)call.Finish();
  EXPECT_EQ(engine_->GetCache(first)->layer_offsets, (std::vector<uint64_t>{2, 0}));
}

INSTANTIATE_TEST_SUITE_P(AllPaths, UpdateCallTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
