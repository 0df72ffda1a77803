// The Fetch core (server/service/calls/fetch_call.h) without a network: the chunks
// it hands out in each form (viewed in pages, read into a buffer, filled as a
// message) are protobuf's encoding of what Handlers::FillFetchChunk fills,
// their announced length is theirs, and on every way a call ends the plan's
// pages are let go before the status is handed out.
#include "service/calls/fetch_call.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "handlers_test_base.h"

namespace kvcache::testing {
namespace {

class FetchCallTest : public HandlersTestBase {
 protected:
  void SetUp() override {
    HandlersTestBase::SetUp();
    if (HasFatalFailure()) return;
    spec_ = MakeSpec({StandardLayerSpec(2, 8), StandardLayerSpec(1, 16, 8)});
    id_ = Create(spec_);
    RefCache reference(spec_);
    ASSERT_TRUE(Step(id_, reference, 40));  // pages of 16 tokens: 3 per layer
  }

  // A request of the whole cache in chunks of `chunk_tokens`.
  v1::FetchRequest WholeCache(uint32_t chunk_tokens = 12) const {
    v1::FetchRequest request;
    request.set_cache_id(id_);
    request.set_max_chunk_tokens(chunk_tokens);
    return request;
  }

  // The next chunk's bytes as a transport would send them: from the pages
  // where it can, else read into a buffer; messages serialized.
  static std::string NextChunkBytes(service::FetchCall& call) {
    if (!call.next_is_tokens()) {
      v1::FetchResponse message;
      EXPECT_TRUE(call.FillNext(message).ok());
      return message.SerializeAsString();
    }
    const service::FetchChunkFraming& framing = call.NextFraming();
    std::string bytes(framing.size(), '\0');
    engine::KvMappedPieces views;
    if (!call.MappedNext(views)) {
      EXPECT_TRUE(call.ReadNext({reinterpret_cast<std::byte*>(bytes.data()), bytes.size()}).ok());
      return bytes;
    }
    framing.Write(reinterpret_cast<uint8_t*>(bytes.data()));
    size_t at = framing.keys_offset();
    for (const auto* pieces : {&views.keys, &views.values}) {
      for (absl::Span<const std::byte> piece : *pieces) {
        bytes.replace(at, piece.size(), reinterpret_cast<const char*>(piece.data()), piece.size());
        at += piece.size();
      }
      at = framing.values_offset();
    }
    return bytes;
  }

  uint32_t used_pages() const { return pool_->stats().used_pages; }

  engine::CacheSpec spec_;
  std::string id_;
};

TEST_P(FetchCallTest, ChunksAreTheEncodingOfTheFilledMessages) {
  absl::StatusOr<service::FetchPlan> plan = handlers_->PlanFetch(WholeCache());
  ASSERT_TRUE(plan.ok()) << plan.status();
  service::FetchCall call(*handlers_, WholeCache());
  const std::optional<uint64_t> announced = call.TokenChunksBytes(8);
  ASSERT_TRUE(announced.has_value());
  uint64_t sent = 0;
  for (size_t i = 0; i < plan->chunks.size(); ++i) {
    ASSERT_TRUE(call.has_next()) << "chunk " << i;
    v1::FetchResponse filled;
    ASSERT_TRUE(handlers_->FillFetchChunk(*plan, i, &filled).ok());
    const std::string bytes = NextChunkBytes(call);
    EXPECT_EQ(bytes, filled.SerializeAsString()) << "chunk " << i;
    sent += 8 + bytes.size();
  }
  EXPECT_FALSE(call.has_next());
  EXPECT_EQ(sent, *announced);
  EXPECT_TRUE(call.Finish().ok());
}

// Packed chunks are known only once filled: no length to announce.
TEST_P(FetchCallTest, OnlyKeysAndValuesHaveALengthBeforehand) {
  const engine::LayerSpec quantized{.num_kv_heads = 1, .k_head_dim = 64, .v_head_dim = 64,
                                    .kind = engine::QuantizedKind{.group_size = 32, .bits = 4}};
  const engine::CacheSpec spec = MakeSpec({quantized});
  const std::string id = Create(spec);
  RefCache reference(spec);
  ASSERT_TRUE(Step(id, reference, 20));
  v1::FetchRequest request;
  request.set_cache_id(id);
  request.set_packed(true);
  service::FetchCall call(*handlers_, request);
  EXPECT_FALSE(call.TokenChunksBytes(8).has_value());
  ASSERT_TRUE(call.has_next());
  EXPECT_FALSE(call.next_is_tokens());
  v1::FetchResponse chunk;
  EXPECT_TRUE(call.FillNext(chunk).ok());
  EXPECT_TRUE(chunk.has_packed_keys());
  EXPECT_TRUE(call.Finish().ok());
}

// The rule a client relies on when it deletes the cache on seeing the
// status: Finish lets go of the plan's pages before it returns. Each way a
// call ends: every chunk sent, the transport stopping half-way, and a
// refusal before planning.
TEST_P(FetchCallTest, PagesAreLetGoBeforeTheStatusOnEveryEnding) {
  struct Ending {
    const char* name;
    size_t chunks_sent;  // SIZE_MAX: all
    absl::Status transport;
    absl::StatusCode expected;
  };
  const Ending endings[] = {
      {"every chunk sent", SIZE_MAX, absl::OkStatus(), absl::StatusCode::kOk},
      {"the transport stopped", 1, absl::CancelledError("the client stopped reading"),
       absl::StatusCode::kCancelled},
      {"nothing sent", 0, absl::UnavailableError("send failed"), absl::StatusCode::kUnavailable},
  };
  for (const Ending& ending : endings) {
    SCOPED_TRACE(ending.name);
    const uint32_t pages_before = used_pages();  // the fixture's own cache
    const std::string id = Create(spec_);
    RefCache reference(spec_);
    ASSERT_TRUE(Step(id, reference, 40));
    v1::FetchRequest request = WholeCache();
    request.set_cache_id(id);
    service::FetchCall call(*handlers_, request);
    for (size_t sent = 0; call.has_next() && sent < ending.chunks_sent; ++sent) {
      NextChunkBytes(call);
    }
    ASSERT_TRUE(engine_->DeleteCache(id).ok());
    ASSERT_GT(used_pages(), pages_before) << "the plan should still hold the cache's pages";
    const absl::Status status = call.Finish(ending.transport);
    EXPECT_EQ(used_pages(), pages_before) << "the status came before the pages were let go";
    EXPECT_EQ(status.code(), ending.expected) << status;
    EXPECT_FALSE(call.has_next());
  }
}

// A call's own failure is its status, whatever the transport says after it;
// one refused before planning sends nothing and says why.
TEST_P(FetchCallTest, TheCallsOwnFailureIsItsStatus) {
  service::FetchCall refused(*handlers_, absl::InvalidArgumentError("FetchRequest: malformed"));
  EXPECT_FALSE(refused.has_next());
  EXPECT_FALSE(refused.TokenChunksBytes(8).has_value());
  EXPECT_EQ(refused.Finish(absl::CancelledError("")).message(), "FetchRequest: malformed");

  service::FetchCall unplanned(*handlers_, v1::FetchRequest());
  EXPECT_FALSE(unplanned.has_next());
  const absl::Status status = unplanned.Finish();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("cache_id"), absl::string_view::npos) << status;

  v1::FetchRequest past_the_end = WholeCache();
  past_the_end.set_start(100);
  service::FetchCall empty(*handlers_, past_the_end);
  EXPECT_FALSE(empty.has_next());
  EXPECT_EQ(empty.TokenChunksBytes(8), 0u);
  EXPECT_TRUE(empty.Finish().ok());
}

INSTANTIATE_TEST_SUITE_P(AllPaths, FetchCallTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
