// The speculation handlers (server/service/speculation_handlers.cc) and the
// speculation branches of Handlers::Update and Handlers::PlanFetch, without a
// network: each refusal has its code, names its field, and changes nothing
// (neither the engine's caches, snapshots and pages nor the open
// speculation); drafts, commits and aborts land as RefSpeculation says.
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "handlers_test_base.h"
#include "reference_speculation.h"
#include "speculation_test_util.h"
#include "wire_forms_util.h"

namespace kvcache::testing {
namespace {

using Code = absl::StatusCode;
constexpr char kUnknownId[] = "0123456789abcdef0123456789abcdef";

absl::Span<const std::byte> BytesOf(const std::string& data) {
  return {reinterpret_cast<const std::byte*>(data.data()), data.size()};
}

// A standard layer and a recurrent one.
engine::CacheSpec SpeculationSpec() {
  return MakeSpec({StandardLayerSpec(2, 8), RecurrentLayerSpec(2, 4, 1, 2, 2)});
}

class SpeculationHandlersTest : public HandlersTestBase {
 protected:
  // `cache_` at offset 5, and `other_`, a cache of another layout (two
  // standard layers of other heads, dims and dtype) at offset 2.
  void SetUp() override {
    HandlersTestBase::SetUp();
    if (HasFatalFailure()) return;
    cache_ = Create(SpeculationSpec());
    ASSERT_TRUE(Step(cache_, reference_, 5));
    other_ = Create(other_reference_.spec());
    ASSERT_TRUE(Step(other_, other_reference_, 2));
  }

  // As HandlersTestBase::ExpectRefused, and speculation `id` unchanged too.
  void ExpectRefusedDuring(const std::string& id, Code code, const std::string& field,
                           const std::function<absl::Status()>& call) {
    const SpeculationFingerprint before = SpeculationFingerprintOf(*engine_, id);
    ExpectRefused(code, field, call);
    EXPECT_TRUE(SpeculationFingerprintOf(*engine_, id) == before)
        << "a refusal changed the speculation";
  }

  // Begins a speculation on `cache_` through the handler, mirrored in speculation_.
  std::string Begin(bool isolated) {
    v1::BeginSpeculationRequest request;
    request.set_cache_id(cache_);
    request.set_isolated(isolated);
    v1::BeginSpeculationResponse response;
    const absl::Status status = handlers_->BeginSpeculation(request, &response);
    EXPECT_TRUE(status.ok()) << status;
    speculation_ = std::make_unique<RefSpeculation>(reference_, isolated);
    return response.speculation_id();
  }

  // A drafted update of `layer` (`tokens` tokens, or one state advancing by
  // them) for speculation `id`, named with cache `cache_id`; `data` holds it.
  v1::UpdateRequest DraftRequest(const std::string& id, const std::string& cache_id,
                                 uint32_t layer, uint64_t tokens, LayerUpdateData& data) {
    v1::UpdateRequest request = RandomLayerUpdate(cache_id, reference_.spec(), layer, tokens, data);
    request.set_speculation_id(id);
    return request;
  }

  // Drafts `tokens` on every layer through Handlers::Update (cache_id left
  // empty when `name_cache` is false), mirrored; checks each acknowledgement.
  void Draft(const std::string& id, uint64_t tokens, bool name_cache = true) {
    for (uint32_t layer = 0; layer < 2; ++layer) {
      LayerUpdateData data;
      const v1::UpdateRequest request =
          DraftRequest(id, name_cache ? cache_ : "", layer, tokens, data);
      v1::UpdateResponse ack;
      const absl::Status status = handlers_->Update(request, nullptr, &ack);
      ASSERT_TRUE(status.ok()) << "layer " << layer << ": " << status;
      if (layer == 1) {
        speculation_->UpdateState(layer, std::move(data.state), tokens);
      } else {
        speculation_->Update(layer, std::move(data.tokens));
      }
      EXPECT_EQ(ack.layer(), layer);
      EXPECT_EQ(ack.offset(), speculation_->layer_offsets()[layer]);
    }
  }

  // The engine's view of speculation `id` equals speculation_.
  ::testing::AssertionResult SpeculationMatches(const std::string& id) {
    auto view = engine_->Freeze("", "", id);
    if (!view.ok()) return ::testing::AssertionFailure() << view.status();
    return ViewMatches(
        **view, [&](uint32_t layer) { return speculation_->Fetch(layer); },
        [&](uint32_t layer) { return speculation_->FetchState(layer); });
  }

  absl::Status Commit(const std::string& id, uint64_t accepted, v1::CacheInfo* info) {
    v1::CommitSpeculationRequest request;
    request.set_speculation_id(id);
    request.set_accepted(accepted);
    return handlers_->CommitSpeculation(request, info);
  }
  absl::Status Abort(const std::string& id, v1::CacheInfo* info) {
    v1::AbortSpeculationRequest request;
    request.set_speculation_id(id);
    return handlers_->AbortSpeculation(request, info);
  }

  RefCache reference_{SpeculationSpec()};
  RefCache other_reference_{
      MakeSpec({StandardLayerSpec(3, 16), StandardLayerSpec(3, 16)}, DType::kFloat32)};
  std::unique_ptr<RefSpeculation> speculation_;
  std::string cache_;
  std::string other_;
};

TEST_P(SpeculationHandlersTest, BeginAnswersAnIdAndTheCommittedOffset) {
  const auto begin = [&](const std::string& cache_id) {
    return [this, cache_id] {
      v1::BeginSpeculationRequest request;
      request.set_cache_id(cache_id);
      v1::BeginSpeculationResponse response;
      return handlers_->BeginSpeculation(request, &response);
    };
  };
  ExpectRefused(Code::kInvalidArgument, "cache_id", begin(""));
  ExpectRefused(Code::kNotFound, "cache_id", begin(kUnknownId));
  // Out of step: layer 0 a token ahead.
  LayerUpdateData data;
  v1::UpdateResponse ack;
  ASSERT_TRUE(handlers_->Update(RandomLayerUpdate(other_, other_reference_.spec(), 0, 1, data),
                                nullptr, &ack).ok());
  other_reference_.Update(0, std::move(data.tokens));
  ExpectRefused(Code::kFailedPrecondition, "cache_id", begin(other_));
  v1::BeginSpeculationRequest request;
  request.set_cache_id(cache_);
  v1::BeginSpeculationResponse response;
  ASSERT_TRUE(handlers_->BeginSpeculation(request, &response).ok());
  EXPECT_EQ(response.speculation_id().size(), 32u);
  EXPECT_EQ(response.offset(), 5u);
  ExpectRefusedDuring(response.speculation_id(), Code::kFailedPrecondition, "cache_id",
                      begin(cache_));
  EXPECT_TRUE(Matches(cache_, reference_));
}

TEST_P(SpeculationHandlersTest, DraftsGoToTheSpeculationNamedWithOrWithoutItsCache) {
  const std::string id = Begin(false);
  Draft(id, 2);
  Draft(id, 1, /*name_cache=*/false);
  EXPECT_TRUE(Matches(cache_, reference_)) << "a draft reached the live cache";
  // A stream's known spec of another cache is replaced by the speculation's.
  service::KnownSpec known;
  ASSERT_TRUE(engine_->RefreshSpec(other_, known.layout_id, known.spec).ok());
  LayerUpdateData data;
  v1::UpdateResponse ack;
  ASSERT_TRUE(handlers_->Update(DraftRequest(id, "", 0, 1, data), &known, &ack).ok());
  speculation_->Update(0, std::move(data.tokens));
  service::KnownSpec speculated;
  ASSERT_TRUE(engine_->RefreshSpec(cache_, speculated.layout_id, speculated.spec).ok());
  EXPECT_EQ(known.layout_id, speculated.layout_id);
  EXPECT_EQ(ack.offset(), 9u);
}

// The speculation is looked up before anything is checked against a cache's
// layers: named with another cache (whatever its layout), it is NOT_FOUND.
TEST_P(SpeculationHandlersTest, UpdateRefusesUnknownAndForeignSpeculations) {
  const std::string id = Begin(false);
  Draft(id, 1);
  LayerUpdateData data;
  const v1::UpdateRequest good = DraftRequest(id, cache_, 0, 2, data);
  const auto refuse = [&](Code code, const std::string& field, auto mutate) {
    v1::UpdateRequest request = good;
    mutate(request);
    ExpectRefusedDuring(id, code, field, [&] {
      v1::UpdateResponse ack;
      return handlers_->Update(request, nullptr, &ack);
    });
  };
  const auto named = [](const std::string& cache_id) {
    return [cache_id](v1::UpdateRequest& r) { r.set_cache_id(cache_id); };
  };
  refuse(Code::kNotFound, "speculation_id", [](auto& r) { r.set_speculation_id(kUnknownId); });
  refuse(Code::kNotFound, "speculation_id", named(other_));
  refuse(Code::kNotFound, "speculation_id", named(kUnknownId));
  // Then checked against its own cache's spec, named or not.
  refuse(Code::kInvalidArgument, "layer", [](auto& r) { r.set_layer(2); });
  refuse(Code::kInvalidArgument, "keys.shape[1]", [](auto& r) {
    r.clear_cache_id();
    r.mutable_keys()->set_shape(1, 3);
  });
  refuse(Code::kInvalidArgument, "keys", [](auto& r) { r.set_layer(1); });
  refuse(Code::kInvalidArgument, "state", [](auto& r) { r.mutable_state()->set_advance(1); });
  refuse(Code::kFailedPrecondition, "expected_offset", [](auto& r) { r.set_expected_offset(5); });
  // The live cache refuses updates without one.
  refuse(Code::kFailedPrecondition, "cache_id", [](auto& r) { r.clear_speculation_id(); });
  EXPECT_TRUE(SpeculationMatches(id));
}

TEST_P(SpeculationHandlersTest, CommitKeepsTheAcceptedTokensAndRefusesWithoutChange) {
  const std::string id = Begin(false);
  Draft(id, 1);
  Draft(id, 2);  // one state for both: the recurrent layer can keep 1 or 3
  const auto commit = [&](const std::string& speculation_id, uint64_t accepted) {
    return [this, speculation_id, accepted] {
      v1::CacheInfo info;
      return Commit(speculation_id, accepted, &info);
    };
  };
  ExpectRefusedDuring(id, Code::kInvalidArgument, "speculation_id", commit("", 0));
  ExpectRefusedDuring(id, Code::kNotFound, "speculation_id", commit(kUnknownId, 0));
  ExpectRefusedDuring(id, Code::kInvalidArgument, "accepted", commit(id, 4));
  ExpectRefusedDuring(id, Code::kFailedPrecondition, "layer 1", commit(id, 2));
  // Out of step: layer 0 drafted 4, layer 1 3.
  LayerUpdateData data;
  v1::UpdateResponse ack;
  ASSERT_TRUE(handlers_->Update(DraftRequest(id, cache_, 0, 1, data), nullptr, &ack).ok());
  speculation_->Update(0, std::move(data.tokens));
  ExpectRefusedDuring(id, Code::kFailedPrecondition, "out of step", commit(id, 3));
  ExpectRefusedDuring(id, Code::kInvalidArgument, "accepted", commit(id, 5));
  ASSERT_TRUE(handlers_->Update(DraftRequest(id, "", 1, 1, data), nullptr, &ack).ok());
  speculation_->UpdateState(1, std::move(data.state), 1);
  ASSERT_EQ(speculation_->Commit(3, reference_), Code::kOk);
  v1::CacheInfo info;
  ASSERT_TRUE(Commit(id, 3, &info).ok());
  EXPECT_EQ(info.cache_id(), cache_);
  EXPECT_EQ(info.offset(), 8u);
  EXPECT_THAT(info.layer_offsets(), ::testing::ElementsAre(8u, 8u));
  EXPECT_TRUE(Matches(cache_, reference_));
  ExpectRefused(Code::kNotFound, "speculation_id", commit(id, 0));
}

TEST_P(SpeculationHandlersTest, AbortDropsEveryDraftedToken) {
  const auto abort = [&](const std::string& speculation_id) {
    return [this, speculation_id] {
      v1::CacheInfo info;
      return Abort(speculation_id, &info);
    };
  };
  ExpectRefused(Code::kInvalidArgument, "speculation_id", abort(""));
  ExpectRefused(Code::kNotFound, "speculation_id", abort(kUnknownId));
  const std::string id = Begin(true);
  Draft(id, 3);
  v1::CacheInfo info;
  ASSERT_TRUE(Abort(id, &info).ok());
  EXPECT_EQ(info.cache_id(), cache_);
  EXPECT_EQ(info.offset(), 5u);
  EXPECT_TRUE(Matches(cache_, reference_));
  ExpectRefused(Code::kNotFound, "speculation_id", abort(id));
}

// PlanFetch with a speculation_id: its view (committed + drafted), with or
// without its cache named; refusals as Update's.
TEST_P(SpeculationHandlersTest, FetchPlansTheSpeculativeView) {
  const std::string id = Begin(false);
  Draft(id, 3);
  for (const std::string& cache_id : {std::string(), cache_}) {
    v1::FetchRequest request;
    request.set_speculation_id(id);
    request.set_cache_id(cache_id);
    request.add_layers(0);
    request.set_max_chunk_tokens(3);
    absl::StatusOr<service::FetchPlan> plan = handlers_->PlanFetch(request);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->snapshot->to, 8u);
    std::vector<RefToken> fetched;
    for (size_t i = 0; i < plan->chunks.size(); ++i) {
      v1::FetchResponse chunk;
      ASSERT_TRUE(handlers_->FillFetchChunk(*plan, i, &chunk).ok());
      const uint64_t tokens = chunk.keys().shape(2);
      EXPECT_LE(tokens, 3u);
      std::vector<RefToken> part =
          TokensFromTensors(ShapeOf(reference_.spec(), 0), BytesOf(chunk.keys().data()),
                            BytesOf(chunk.values().data()), tokens);
      for (uint64_t t = 0; t < tokens; ++t) part[t].position = chunk.start() + t;
      fetched.insert(fetched.end(), part.begin(), part.end());
    }
    EXPECT_TRUE(SameTokens(speculation_->Fetch(0), fetched));
  }
  const auto plan = [&](const std::string& speculation_id, auto mutate) {
    return [this, speculation_id, mutate] {
      v1::FetchRequest request;
      request.set_speculation_id(speculation_id);
      mutate(request);
      return handlers_->PlanFetch(request).status();
    };
  };
  const auto as_is = [](v1::FetchRequest&) {};
  ExpectRefusedDuring(id, Code::kNotFound, "speculation_id", plan(kUnknownId, as_is));
  ExpectRefusedDuring(id, Code::kNotFound, "speculation_id",
                      plan(id, [&](auto& r) { r.set_cache_id(other_); }));
  ExpectRefusedDuring(id, Code::kInvalidArgument, "speculation_id",
                      plan(id, [](auto& r) { r.set_snapshot_id(kUnknownId); }));
  ExpectRefusedDuring(id, Code::kInvalidArgument, "layers[0]",
                      plan(id, [](auto& r) { r.add_layers(2); }));
  v1::CacheInfo info;
  ASSERT_TRUE(Abort(id, &info).ok());
  ExpectRefused(Code::kNotFound, "speculation_id", plan(id, as_is));
}

INSTANTIATE_TEST_SUITE_P(TransferPaths, SpeculationHandlersTest,
                         ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
