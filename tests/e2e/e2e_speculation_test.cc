// Speculative decoding end to end, through the client library over a
// loopback port, on a mixed layout (standard, rotating with sinks, quantized,
// chunked, recurrent): drafted tokens are readable in the speculative view
// and invisible to the live cache; a commit keeps the accepted prefix of every
// layer (a recurrent layer: the state recorded after it), as live updates of
// that prefix would; isolated speculation and abort leave the live cache as
// it was; and every refusal names its field and changes nothing.
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "chunked_recurrent_test_util.h"
#include "e2e_test_util.h"
#include "gtest/gtest.h"
#include "reference_quantized.h"
#include "reference_recurrent.h"
#include "wire_forms_util.h"

namespace kvcache::testing {
namespace {

using Code = absl::StatusCode;

// What one speculative round drafted, per layer: tokens (attention) or the
// state after each drafted token (recurrent).
struct Draft {
  std::vector<std::vector<RefToken>> tokens;
  std::vector<std::vector<RefState>> states;
};

class E2eSpeculationTest : public E2eTest {
 protected:
  void SetUp() override {
    E2eTest::SetUp();
    spec_ = MakeSpec({StandardLayerSpec(1, 8), RotatingLayerSpec(2, 8, 8, 8, 2),
                      engine::LayerSpec{.num_kv_heads = 2,
                                        .k_head_dim = 32,
                                        .v_head_dim = 32,
                                        .kind = engine::QuantizedKind{.group_size = 32, .bits = 4}},
                      ChunkedLayerSpec(1, 8, 8, 6), RecurrentLayerSpec(2, 4, 1, 2, 2)},
                     DType::kFloat32, 1);
    absl::StatusOr<v1::CacheInfo> info = client().CreateCache(ToWireSpec(spec_));
    ASSERT_TRUE(info.ok()) << info.status();
    cache_id_ = info->cache_id();
    reference_ = std::make_unique<RefCache>(spec_);
    ASSERT_TRUE(StepBoth(client(), cache_id_, *reference_, 11, rng_).ok());
  }

  // Drafts `k` tokens on every layer of speculation `id`: attention layers in
  // one update, recurrent layers one state per token (advance 1); the stream
  // names the cache too unless `name_cache` is false.
  Draft DraftTokens(const std::string& id, uint64_t k, bool name_cache = true) {
    Draft draft;
    draft.tokens.resize(spec_.layers.size());
    draft.states.resize(spec_.layers.size());
    std::vector<KvTensors> kv(spec_.layers.size());
    std::vector<LayerUpdate> updates;
    for (uint32_t l = 0; l < spec_.layers.size(); ++l) {
      if (engine::IsRecurrent(spec_.layers[l])) {
        for (uint64_t t = 0; t < k; ++t) draft.states[l].push_back(RandomState(spec_, l, rng_));
        for (const RefState& state : draft.states[l]) {
          updates.push_back(MakeStateUpdate(spec_, l, state, 1));
          updates.back().speculation_id = id;
        }
      } else {
        kv[l] = RandomLayerKv(spec_, l, k, rng_);
        draft.tokens[l] = TokensFromTensors(ShapeOf(spec_, l), kv[l].keys, kv[l].values, k);
        updates.push_back(MakeLayerUpdate(spec_, l, kv[l]));
        updates.back().speculation_id = id;
      }
    }
    absl::StatusOr<std::vector<v1::UpdateResponse>> acks =
        client().Update(name_cache ? cache_id_ : "", updates);
    EXPECT_TRUE(acks.ok()) << acks.status();
    return draft;
  }

  // The live reference after keeping `accepted` drafted tokens.
  void KeepInReference(const Draft& draft, uint64_t accepted) {
    if (accepted == 0) return;
    for (uint32_t l = 0; l < spec_.layers.size(); ++l) {
      if (engine::IsRecurrent(spec_.layers[l])) {
        reference_->UpdateState(l, draft.states[l][accepted - 1], accepted);
      } else {
        reference_->Update(l, std::vector<RefToken>(draft.tokens[l].begin(),
                                                    draft.tokens[l].begin() + accepted));
      }
    }
  }

  std::string Begin(bool isolated) {
    absl::StatusOr<v1::BeginSpeculationResponse> begun =
        client().BeginSpeculation(cache_id_, {.isolated = isolated});
    EXPECT_TRUE(begun.ok()) << begun.status();
    if (!begun.ok()) return "";
    EXPECT_EQ(begun->offset(), reference_->CommonOffset().value());
    return begun->speculation_id();
  }

  ::testing::AssertionResult LiveMatches() {
    return CacheMatchesReference(client(), cache_id_, *reference_);
  }

  std::mt19937_64 rng_{23};
  engine::CacheSpec spec_;
  std::string cache_id_;
  std::unique_ptr<RefCache> reference_;
};

// Drafted tokens show in the speculative view only; each commit keeps the
// accepted prefix on every layer, whatever k and accepted are.
TEST_P(E2eSpeculationTest, CommitKeepsTheAcceptedPrefixOnEveryLayer) {
  for (auto [k, accepted] : {std::pair<uint64_t, uint64_t>{4, 2}, {1, 1}, {8, 0}, {3, 3}, {6, 5}}) {
    SCOPED_TRACE(::testing::Message() << "k " << k << " accepted " << accepted);
    const std::string id = Begin(false);
    const Draft draft = DraftTokens(id, k);
    ASSERT_TRUE(LiveMatches());  // the live cache still shows the committed history
    std::vector<RefToken> view = reference_->layer(0).Fetch();
    const uint64_t start = reference_->layer(0).offset();
    for (uint64_t i = 0; i < draft.tokens[0].size(); ++i) {
      view.push_back(draft.tokens[0][i]);
      view.back().position = start + i;  // drafted tokens follow the committed ones
    }
    EXPECT_TRUE(HistoryMatches(view, client().FetchSpeculation(id, 0), ShapeOf(spec_, 0)));
    absl::StatusOr<v1::CacheInfo> committed = client().CommitSpeculation(id, accepted);
    ASSERT_TRUE(committed.ok()) << committed.status();
    KeepInReference(draft, accepted);
    EXPECT_EQ(committed->offset(), reference_->CommonOffset().value());
    ASSERT_TRUE(LiveMatches());
    ASSERT_TRUE(StepBoth(client(), cache_id_, *reference_, 1, rng_).ok());  // live again
  }
}

TEST_P(E2eSpeculationTest, IsolatedCommitAndAbortLeaveTheLiveCacheAlone) {
  const std::string isolated = Begin(true);
  DraftTokens(isolated, 3);
  absl::StatusOr<v1::CacheInfo> info = client().CommitSpeculation(isolated, 3);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->offset(), 11u);
  ASSERT_TRUE(LiveMatches());
  const std::string aborted = Begin(false);
  DraftTokens(aborted, 5);
  info = client().AbortSpeculation(aborted);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->offset(), 11u);
  ASSERT_TRUE(LiveMatches());
  ExpectRefused(Code::kNotFound, "speculation_id",
                [&] { return client().CommitSpeculation(aborted, 0).status(); });
}

TEST_P(E2eSpeculationTest, RefusalsNameTheirFieldAndChangeNothing) {
  const std::string id = Begin(false);
  DraftTokens(id, 2);
  ExpectRefused(Code::kFailedPrecondition, "cache_id",
                [&] { return client().BeginSpeculation(cache_id_).status(); });
  ExpectRefused(Code::kInvalidArgument, "accepted",
                [&] { return client().CommitSpeculation(id, 3).status(); });
  ExpectRefused(Code::kNotFound, "speculation_id", [&] {
    return client().CommitSpeculation("0123456789abcdef0123456789abcdef", 0).status();
  });
  ExpectRefused(Code::kInvalidArgument, "speculation_id",
                [&] { return client().AbortSpeculation("").status(); });
  ExpectRefused(Code::kFailedPrecondition, "cache_id", [&] {
    const KvTensors kv = RandomLayerKv(spec_, 0, 1, rng_);
    return client().Update(cache_id_, {MakeLayerUpdate(spec_, 0, kv)}).status();
  });
  ExpectRefused(Code::kFailedPrecondition, "cache_id",
                [&] { return client().Trim(cache_id_, 1).status(); });
  ASSERT_TRUE(LiveMatches());
  // Deleting the cache ends the speculation.
  ASSERT_TRUE(client().DeleteCache(cache_id_).ok());
  EXPECT_EQ(client().CommitSpeculation(id, 0).status().code(), Code::kNotFound);
}

// A draft may leave cache_id empty: the speculation's cache is meant. Named
// with another cache, the speculation is unknown (NOT_FOUND naming
// speculation_id), even when its tensors do not fit that cache's layers.
TEST_P(E2eSpeculationTest, DraftsMayOmitTheCacheIdAndAForeignOneIsNotFound) {
  const std::string id = Begin(false);
  absl::StatusOr<v1::CacheInfo> other = client().CreateCache(
      ToWireSpec(MakeSpec({StandardLayerSpec(3, 16)}, DType::kFloat32, 1)));
  ASSERT_TRUE(other.ok()) << other.status();
  const KvTensors kv = RandomLayerKv(spec_, 0, 1, rng_);
  LayerUpdate update = MakeLayerUpdate(spec_, 0, kv);
  update.speculation_id = id;
  ExpectRefused(Code::kNotFound, "speculation_id",
                [&] { return client().Update(other->cache_id(), {&update, 1}).status(); });
  update.layer = 3;  // out of range for the other cache, in range for its own
  ExpectRefused(Code::kNotFound, "speculation_id",
                [&] { return client().Update(other->cache_id(), {&update, 1}).status(); });
  ASSERT_TRUE(client().DeleteCache(other->cache_id()).ok());
  const Draft draft = DraftTokens(id, 3, /*name_cache=*/false);
  ASSERT_FALSE(::testing::Test::HasFailure());
  absl::StatusOr<v1::CacheInfo> committed = client().CommitSpeculation(id, 2);
  ASSERT_TRUE(committed.ok()) << committed.status();
  KeepInReference(draft, 2);
  ASSERT_TRUE(LiveMatches());
}

INSTANTIATE_TEST_SUITE_P(Paths, E2eSpeculationTest, ::testing::ValuesIn(kE2ePaths),
                         PathTestName);

}  // namespace
}  // namespace kvcache::testing
