// The layer kinds beyond standard end to end, through the client library over a
// loopback port: quantized layers fetched packed (words, scales and biases
// identical to the CPU reference quantizer on the same input) and dequantized
// (each value within one quantization step of what was sent); recurrent
// states set by Update (copied and shared encodings) and read by FetchState,
// live and from snapshots; updates of the wrong kind refused with
// INVALID_ARGUMENT naming the field; and restores that one layer of a mixed
// layout cannot reach refused with FAILED_PRECONDITION. Every refusal changes
// nothing a client can see.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "chunked_recurrent_test_util.h"
#include "e2e_test_util.h"
#include "gtest/gtest.h"
#include "reference_quantized.h"
#include "reference_recurrent.h"
#include "support/ref_quantizer.h"
#include "wire_forms_util.h"

namespace kvcache::testing {
namespace {

using Code = absl::StatusCode;

engine::LayerSpec QuantizedSpec(uint32_t heads, uint32_t k_dim, uint32_t v_dim, uint32_t group,
                                uint32_t bits) {
  return engine::LayerSpec{.num_kv_heads = heads,
                           .k_head_dim = k_dim,
                           .v_head_dim = v_dim,
                           .kind = engine::QuantizedKind{.group_size = group, .bits = bits}};
}

// Every element of `fetched` (rows of `dim` dtype values, as `input`) lies
// within one quantization step of the input element it stands for: the
// bound of support/ref_quantizer.h for the scale and bias the reference
// quantizer gives its group.
::testing::AssertionResult WithinOneStep(const RefQuantFormat& f, uint32_t dim,
                                         absl::Span<const std::byte> input,
                                         absl::Span<const std::byte> fetched) {
  if (input.size() != fetched.size()) {
    return ::testing::AssertionFailure() << fetched.size() << " bytes for " << input.size();
  }
  const uint64_t elem = DTypeSize(f.dtype);
  const RefPacked packed = RefQuantize(f, input);
  for (uint64_t i = 0; i < input.size() / elem; ++i) {
    const uint64_t group = i / f.group_size;
    const float scale = RefLoad(f.dtype, packed.scales.data() + group * elem);
    const float bias = RefLoad(f.dtype, packed.biases.data() + group * elem);
    const float x = RefLoad(f.dtype, input.data() + i * elem);
    const float y = RefLoad(f.dtype, fetched.data() + i * elem);
    const double bound = RefErrorBound(f, scale, bias, x);
    if (!(std::abs(double{y} - double{x}) <= bound)) {
      return ::testing::AssertionFailure()
             << "element " << i << " (row " << i / dim << "): sent " << x << ", fetched " << y
             << ", more than one step (" << bound << ") apart";
    }
  }
  return ::testing::AssertionSuccess();
}

class E2eLayerKindsTest : public E2eTest {
 protected:
  // A cache of `spec` over the wire, mirrored in reference_.
  void Create(const engine::CacheSpec& spec) {
    absl::StatusOr<v1::CacheInfo> info = client().CreateCache(ToWireSpec(spec));
    ASSERT_TRUE(info.ok()) << info.status();
    cache_id_ = info->cache_id();
    reference_ = std::make_unique<RefCache>(spec);
  }

  // One step of every layer in one stream (tokens, or states advancing by
  // `tokens`), mirrored; returns the tokens sent to layer `keep_layer`.
  KvTensors Step(uint64_t tokens, uint32_t keep_layer = 0) {
    const engine::CacheSpec& spec = reference_->spec();
    std::vector<KvTensors> kv(spec.layers.size());
    std::vector<RefState> states(spec.layers.size());
    std::vector<LayerUpdate> updates;
    for (uint32_t l = 0; l < spec.layers.size(); ++l) {
      if (engine::IsRecurrent(spec.layers[l])) {
        states[l] = RandomState(spec, l, rng_);
        updates.push_back(MakeStateUpdate(spec, l, states[l], tokens));
      } else {
        kv[l] = RandomLayerKv(spec, l, tokens, rng_);
        updates.push_back(MakeLayerUpdate(spec, l, kv[l]));
      }
    }
    absl::StatusOr<std::vector<v1::UpdateResponse>> acks = client().Update(cache_id_, updates);
    EXPECT_TRUE(acks.ok()) << acks.status();
    if (!acks.ok()) return {};
    for (uint32_t l = 0; l < spec.layers.size(); ++l) {
      if (engine::IsRecurrent(spec.layers[l])) {
        reference_->UpdateState(l, states[l], tokens);
      } else {
        reference_->Update(l,
                           TokensFromTensors(ShapeOf(spec, l), kv[l].keys, kv[l].values, tokens));
      }
      EXPECT_EQ((*acks)[l].offset(), reference_->layer(l).offset()) << "layer " << l;
    }
    return kv[keep_layer];
  }

  ::testing::AssertionResult LiveMatches() {
    return CacheMatchesReference(client(), cache_id_, *reference_);
  }

  // A snapshot from `from`, mirrored.
  std::pair<std::string, RefCacheSnapshotPtr> Snapshot(uint64_t from) {
    absl::StatusOr<v1::SnapshotInfo> info = client().Snapshot(cache_id_, {.from_offset = from});
    EXPECT_TRUE(info.ok()) << info.status();
    return {info.ok() ? info->snapshot_id() : "", reference_->Snapshot(from)};
  }

  std::mt19937_64 rng_{17};
  std::string cache_id_;
  std::unique_ptr<RefCache> reference_;
};

// Packed chunks (cut small, so a history spans several) are the reference
// quantizer's words, scales and biases of what was sent, byte for byte, live
// and from a snapshot; dequantized values are within one step of the input.
TEST_P(E2eLayerKindsTest, QuantizedLayersFetchPackedAndDequantized) {
  struct Case {
    DType dtype;
    uint32_t group, bits, k_dim, v_dim;
  };
  for (const Case& c :
       {Case{DType::kFloat16, 32, 4, 64, 32}, Case{DType::kBFloat16, 64, 8, 64, 128},
        Case{DType::kFloat32, 128, 4, 128, 128}}) {
    SCOPED_TRACE(
        absl::StrCat(std::string(DTypeName(c.dtype)), " group ", c.group, " bits ", c.bits));
    Create(MakeSpec({QuantizedSpec(2, c.k_dim, c.v_dim, c.group, c.bits)}, c.dtype, 2));
    if (HasFatalFailure()) return;
    const RefQuantFormat format{c.dtype, c.group, c.bits};
    const KvTensors first = Step(5);
    const auto [snapshot_id, snapshot] = Snapshot(0);
    const KvTensors second = Step(3);
    ASSERT_TRUE(LiveMatches());  // dequantized == CPU dequantization, packed == reference
    ASSERT_TRUE(LayerMatchesReference(client(), "", snapshot_id, reference_->spec(), 0,
                                      RefCache::FetchSnapshot(*snapshot, 0), std::nullopt));
    v1::FetchRequest request;
    request.set_cache_id(cache_id_);
    request.set_packed(true);
    request.set_max_chunk_tokens(3);
    absl::StatusOr<std::vector<v1::FetchResponse>> chunks = client().FetchAll(request);
    ASSERT_TRUE(chunks.ok()) << chunks.status();
    ASSERT_EQ(chunks->size(), 3u);  // [0,3) [3,6) [6,8)
    absl::StatusOr<std::vector<RefToken>> packed = PackedTokensOf(reference_->spec(), 0, *chunks);
    ASSERT_TRUE(packed.ok()) << packed.status();
    EXPECT_TRUE(SameTokens(reference_->layer(0).Fetch(), *packed));
    // Each update's tokens, fetched dequantized alone, are one [B, H, L, D]
    // tensor laid out as sent.
    for (auto [sent, begin] : {std::pair{&first, 0}, std::pair{&second, 5}}) {
      request.set_packed(false);
      request.set_max_chunk_tokens(0);
      request.set_start(begin);
      request.set_end(begin + sent->tokens);
      absl::StatusOr<std::vector<v1::FetchResponse>> window = client().FetchAll(request);
      ASSERT_TRUE(window.ok()) << window.status();
      absl::StatusOr<LayerHistory> history = AssembleHistory(*window);
      ASSERT_TRUE(history.ok()) << history.status();
      EXPECT_TRUE(WithinOneStep(format, c.k_dim, sent->keys, history->keys)) << "keys at " << begin;
      EXPECT_TRUE(WithinOneStep(format, c.v_dim, sent->values, history->values))
          << "values at " << begin;
    }
    ASSERT_TRUE(client().ReleaseSnapshot(snapshot_id).ok());
    ASSERT_TRUE(client().DeleteCache(cache_id_).ok());
  }
}

// States land as sent: zeros before the first update, a snapshot's state
// after later updates, advance 0 replacing in place, the shared (zero-copy)
// encoding as well as the copied one.
TEST_P(E2eLayerKindsTest, RecurrentStatesUpdateAndFetch) {
  Create(MakeSpec({RecurrentLayerSpec(3, 20, 4, 16, 32), StandardLayerSpec(2, 8)}, DType::kFloat32,
                  2));
  ASSERT_TRUE(LiveMatches());  // zeros, at offset 0
  Step(3);
  ASSERT_TRUE(LiveMatches());
  const auto [snapshot_id, snapshot] = Snapshot(0);
  Step(2);
  ASSERT_TRUE(LiveMatches());
  absl::StatusOr<v1::RecurrentState> kept = client().FetchState("", snapshot_id, 0);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(StateOf(reference_->spec(), 0, *kept).value() == *snapshot->layers[0]->state);
  // advance 0 through WriteShared: the state's buffers are referenced, not copied.
  auto state = std::make_shared<RefState>(RandomState(reference_->spec(), 0, rng_));
  std::unique_ptr<UpdateStream> stream = client().OpenUpdate(cache_id_);
  LayerUpdate update = MakeStateUpdate(reference_->spec(), 0, *state, 0);
  update.expected_offset = 5;
  ASSERT_TRUE(stream->WriteShared(update, state));
  absl::StatusOr<std::vector<v1::UpdateResponse>> acks = stream->Finish();
  ASSERT_TRUE(acks.ok()) << acks.status();
  ASSERT_EQ(acks->size(), 1u);
  EXPECT_EQ((*acks)[0].offset(), 5u);
  reference_->UpdateState(0, *state, 0);
  ASSERT_TRUE(LiveMatches());
  // Back to the snapshot: its state, at its offset.
  absl::StatusOr<v1::CacheInfo> restored = client().Restore(cache_id_, snapshot_id, 3);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ASSERT_TRUE(reference_->Restore(snapshot.get(), 3));
  ASSERT_TRUE(LiveMatches());
}

// K/V for a recurrent layer, a state for an attention layer (standard or
// quantized), both at once, and states of the wrong shape, size or dtype:
// INVALID_ARGUMENT naming the field, nothing changed.
TEST_P(E2eLayerKindsTest, UpdatesOfTheWrongKindAreRefused) {
  Create(MakeSpec(
      {RecurrentLayerSpec(2, 8, 2, 4, 4), StandardLayerSpec(2, 8), QuantizedSpec(1, 32, 32, 32, 4)},
      DType::kFloat16, 2));
  Step(4);
  const engine::CacheSpec spec = reference_->spec();
  const RefState state = RandomState(spec, 0, rng_);
  const KvTensors kv = RandomKv(spec, 1, 2, rng_);
  const auto send = [this](LayerUpdate update) {
    return [this, update] { return client().Update(cache_id_, {&update, 1}).status(); };
  };
  LayerUpdate kv_to_recurrent = MakeLayerUpdate(spec, 1, kv);
  kv_to_recurrent.layer = 0;
  ExpectRefused(Code::kInvalidArgument, "keys", send(kv_to_recurrent));
  LayerUpdate both = MakeStateUpdate(spec, 0, state, 1);
  both.keys_shape = kv_to_recurrent.keys_shape;
  both.keys = kv.keys;
  ExpectRefused(Code::kInvalidArgument, "keys", send(both));
  for (uint32_t attention : {1u, 2u}) {
    LayerUpdate state_to_attention = MakeStateUpdate(spec, 0, state, 1);
    state_to_attention.layer = attention;
    ExpectRefused(Code::kInvalidArgument, "state", send(state_to_attention));
  }
  LayerUpdate bad = MakeStateUpdate(spec, 0, state, 1);
  bad.state->conv_shape[1] = 3;
  ExpectRefused(Code::kInvalidArgument, "state.conv_state.shape[1]", send(bad));
  bad = MakeStateUpdate(spec, 0, state, 1);
  bad.state->delta = bad.state->delta.subspan(2);
  ExpectRefused(Code::kInvalidArgument, "state.delta_state.data", send(bad));
  bad = MakeStateUpdate(spec, 0, state, 1);
  bad.dtype = v1::DTYPE_BFLOAT16;
  ExpectRefused(Code::kInvalidArgument, "state.conv_state.dtype", send(bad));
  ASSERT_TRUE(LiveMatches());
}

// Qwen3-Next-like (recurrent + global): the recurrent layer cannot go below
// its snapshot's offset or rewind live, so the whole restore is refused.
TEST_P(E2eLayerKindsTest, RestoresARecurrentLayerCannotReachAreRefused) {
  Create(MakeSpec({RecurrentLayerSpec(2, 8, 2, 4, 4), RecurrentLayerSpec(3, 4, 1, 4, 8),
                   StandardLayerSpec(2, 8)},
                  DType::kBFloat16));
  Step(5);
  const auto [snapshot_id, snapshot] = Snapshot(2);
  Step(3);
  ExpectRefused(Code::kFailedPrecondition, "layer 0",
                [&] { return client().Restore(cache_id_, snapshot_id, 4).status(); });
  ExpectRefused(Code::kFailedPrecondition, "recurrent state cannot be rewound",
                [&] { return client().Restore(cache_id_, "", 6).status(); });
  ASSERT_TRUE(LiveMatches());
  // At the snapshot's own offset it works, every layer together.
  ASSERT_TRUE(client().Restore(cache_id_, snapshot_id, 5).ok());
  ASSERT_TRUE(reference_->Restore(snapshot.get(), 5));
  ASSERT_TRUE(LiveMatches());
}

// Recurrent layers only: none beside them would refuse a target past the
// snapshot's offset, so they refuse it themselves rather than land elsewhere.
TEST_P(E2eLayerKindsTest, ARecurrentCacheRestoresOnlyToItsSnapshotsOffset) {
  Create(MakeSpec({RecurrentLayerSpec(2, 8, 2, 4, 4)}, DType::kBFloat16));
  Step(8);
  const auto [snapshot_id, snapshot] = Snapshot(0);
  Step(3);
  ExpectRefused(Code::kFailedPrecondition, "layer 0: target 9 is past the recurrent snapshot's",
                [&] { return client().Restore(cache_id_, snapshot_id, 9).status(); });
  ASSERT_TRUE(LiveMatches());
  ASSERT_TRUE(client().Restore(cache_id_, snapshot_id, 8).ok());
  ASSERT_TRUE(reference_->Restore(snapshot.get(), 8));
  ASSERT_TRUE(LiveMatches());
}

// Gemma 3-like (sliding window with sinks + global + quantized): once the
// window has wrapped, neither a live rewind nor a clamped restore of a
// wrapped snapshot can rebuild it, so the global and quantized layers, which
// could, are left alone too.
TEST_P(E2eLayerKindsTest, RestoresAWrappedWindowCannotReachAreRefused) {
  Create(MakeSpec({RotatingLayerSpec(1, 8, 0, 8, 4), StandardLayerSpec(2, 8, 4),
                   QuantizedSpec(1, 32, 64, 32, 8)},
                  DType::kFloat16));
  Step(6);
  Step(6);  // offset 12 > the window of 8
  const auto [snapshot_id, snapshot] = Snapshot(0);
  Step(1);
  ExpectRefused(Code::kFailedPrecondition, "layer 0",
                [&] { return client().Restore(cache_id_, "", 11).status(); });
  ExpectRefused(Code::kFailedPrecondition, "incomplete window",
                [&] { return client().Restore(cache_id_, snapshot_id, 10).status(); });
  ExpectRefused(Code::kFailedPrecondition, "beyond the snapshot's end",
                [&] { return client().Restore(cache_id_, snapshot_id, 13).status(); });
  ASSERT_TRUE(LiveMatches());
  ASSERT_TRUE(client().Restore(cache_id_, snapshot_id, 12).ok());
  ASSERT_TRUE(reference_->Restore(snapshot.get(), 12));
  ASSERT_TRUE(LiveMatches());
}

INSTANTIATE_TEST_SUITE_P(Paths, E2eLayerKindsTest, ::testing::ValuesIn(kE2ePaths), PathTestName);

}  // namespace
}  // namespace kvcache::testing
