// The Fetch forms (server/service/fetch_forms.cc) without a network: a plan
// gives each layer the form it has (tokens, a quantized layer's packed form
// when asked, a recurrent layer's state whatever was asked), and each chunk is
// shaped as the proto says and holds the reference's bytes: packed words,
// scales and biases identical to the CPU reference quantizer's, states as
// sent (zeros before the first update), none for a snapshot that holds none.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "handlers_test_base.h"
#include "reference_recurrent.h"
#include "wire_forms_util.h"

namespace kvcache::testing {
namespace {

using Form = service::FetchPlan::Form;

// A global layer, a quantized one (4 bits, group 32, Dk != Dv) and a
// recurrent one; batch 2, bfloat16.
engine::CacheSpec FormsSpec() {
  const engine::LayerSpec quantized{.num_kv_heads = 2,
                                    .k_head_dim = 64,
                                    .v_head_dim = 32,
                                    .kind = engine::QuantizedKind{.group_size = 32, .bits = 4}};
  return MakeSpec({StandardLayerSpec(1, 8), quantized, RecurrentLayerSpec(3, 8, 2, 4, 4)},
                  DType::kBFloat16, 2);
}

class FetchFormsTest : public HandlersTestBase {
 protected:
  void SetUp() override {
    HandlersTestBase::SetUp();
    if (HasFatalFailure()) return;
    id_ = Create(FormsSpec());
  }

  // Every chunk `request` plans, filled through the handlers.
  std::vector<v1::FetchResponse> FetchAll(const v1::FetchRequest& request,
                                          std::vector<Form>* forms = nullptr) {
    absl::StatusOr<service::FetchPlan> plan = handlers_->PlanFetch(request);
    EXPECT_TRUE(plan.ok()) << plan.status();
    std::vector<v1::FetchResponse> chunks;
    if (!plan.ok()) return chunks;
    for (size_t i = 0; i < plan->chunks.size(); ++i) {
      if (forms != nullptr) forms->push_back(plan->chunks[i].form);
      const absl::Status status = handlers_->FillFetchChunk(*plan, i, &chunks.emplace_back());
      EXPECT_TRUE(status.ok()) << status;
    }
    return chunks;
  }

  std::vector<v1::FetchResponse> OfLayer(const std::vector<v1::FetchResponse>& chunks,
                                         uint32_t layer) {
    std::vector<v1::FetchResponse> out;
    for (const v1::FetchResponse& chunk : chunks) {
      if (chunk.layer() == layer) out.push_back(chunk);
    }
    return out;
  }

  std::string id_;
  RefCache reference_{FormsSpec()};
};

// `packed` changes only the quantized layer's form: the global layer still
// sends tokens, the recurrent layer its state.
TEST_P(FetchFormsTest, EachLayerHasItsForm) {
  ASSERT_TRUE(Step(id_, reference_, 5));
  v1::FetchRequest request;
  request.set_cache_id(id_);
  request.set_packed(true);
  request.set_max_chunk_tokens(2);
  std::vector<Form> forms;
  const std::vector<v1::FetchResponse> chunks = FetchAll(request, &forms);
  const std::vector<Form> expected = {Form::kTokens, Form::kTokens, Form::kTokens, Form::kPacked,
                                      Form::kPacked, Form::kPacked, Form::kState};
  EXPECT_EQ(forms, expected);
  ASSERT_EQ(chunks.size(), expected.size());
  EXPECT_TRUE(chunks[0].has_keys() && !chunks[0].has_packed_keys());
  for (size_t i = 3; i < 6; ++i) {
    EXPECT_FALSE(chunks[i].has_keys() || chunks[i].has_values() || chunks[i].has_state()) << i;
    EXPECT_EQ(chunks[i].packed_keys().wq().dtype(), v1::DTYPE_UNSPECIFIED);  // uint32 words
  }
  EXPECT_TRUE(chunks[6].has_state() && !chunks[6].has_keys());
}

// Packed chunks cut at any size, live and windowed, are the reference
// quantizer's planes of what was sent; dequantized ones its dequantization.
TEST_P(FetchFormsTest, PackedChunksAreTheReferenceQuantizersWords) {
  ASSERT_TRUE(Step(id_, reference_, 4));
  ASSERT_TRUE(Step(id_, reference_, 3));
  for (uint32_t max_chunk : {0u, 1u, 3u}) {
    for (auto [start, end] : {std::pair<uint64_t, uint64_t>{0, 7}, {2, 6}, {5, 9}}) {
      SCOPED_TRACE(::testing::Message()
                   << "chunks of " << max_chunk << ", window [" << start << ", " << end << ")");
      v1::FetchRequest request;
      request.set_cache_id(id_);
      request.add_layers(1);
      request.set_start(start);
      request.set_end(end);
      request.set_max_chunk_tokens(max_chunk);
      const std::vector<RefToken> expected = Clip(reference_.layer(1).Fetch(), {start, end});
      request.set_packed(true);
      absl::StatusOr<std::vector<RefToken>> packed =
          PackedTokensOf(FormsSpec(), 1, FetchAll(request));
      ASSERT_TRUE(packed.ok()) << packed.status();
      EXPECT_TRUE(SameTokens(expected, *packed));
      request.set_packed(false);
      std::vector<v1::FetchResponse> chunks = FetchAll(request);
      ASSERT_FALSE(chunks.empty());
      std::vector<RefToken> dequantized;
      for (const v1::FetchResponse& chunk : chunks) {
        const std::string& k = chunk.keys().data();
        const std::string& v = chunk.values().data();
        std::vector<RefToken> part = TokensFromTensors(
            ShapeOf(FormsSpec(), 1), {reinterpret_cast<const std::byte*>(k.data()), k.size()},
            {reinterpret_cast<const std::byte*>(v.data()), v.size()}, chunk.keys().shape(2));
        for (uint64_t i = 0; i < part.size(); ++i) part[i].position = chunk.start() + i;
        dequantized.insert(dequantized.end(), part.begin(), part.end());
      }
      EXPECT_TRUE(SameTokens(AsFetched(FormsSpec(), 1, expected), dequantized));
    }
  }
}

// A state chunk starts at the layer's offset whatever the window; a live
// layer reads zeros before its first update; a snapshot's state stays as it
// was; a split's first half holds no state, so it sends no chunk for it.
TEST_P(FetchFormsTest, StateChunksAreTheLayersState) {
  v1::FetchRequest request;
  request.set_cache_id(id_);
  request.add_layers(2);
  std::vector<v1::FetchResponse> chunks = FetchAll(request);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].start(), 0u);
  EXPECT_TRUE(StateOf(FormsSpec(), 2, chunks[0].state()).value() == ZeroState(FormsSpec(), 2));
  ASSERT_TRUE(Step(id_, reference_, 5));
  v1::SnapshotRequest snap;
  snap.set_cache_id(id_);
  v1::SnapshotInfo snapshot;
  ASSERT_TRUE(handlers_->Snapshot(snap, &snapshot).ok());
  const RefState at_five = *reference_.layer(2).FetchState();
  ASSERT_TRUE(Step(id_, reference_, 2));
  request.set_start(1);
  request.set_end(2);  // a window the state ignores
  chunks = FetchAll(request);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].start(), 7u);
  EXPECT_TRUE(StateOf(FormsSpec(), 2, chunks[0].state()).value() ==
              *reference_.layer(2).FetchState());
  request.set_snapshot_id(snapshot.snapshot_id());
  chunks = FetchAll(request);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].start(), 5u);
  EXPECT_TRUE(StateOf(FormsSpec(), 2, chunks[0].state()).value() == at_five);
  v1::SplitSnapshotRequest split;
  split.set_snapshot_id(snapshot.snapshot_id());
  split.set_at(3);
  v1::SplitSnapshotResponse halves;
  ASSERT_TRUE(handlers_->SplitSnapshot(split, &halves).ok());
  request.set_snapshot_id(halves.parent().snapshot_id());
  EXPECT_TRUE(FetchAll(request).empty());
  request.set_snapshot_id(halves.child().snapshot_id());
  chunks = FetchAll(request);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_TRUE(StateOf(FormsSpec(), 2, chunks[0].state()).value() == at_five);
}

INSTANTIATE_TEST_SUITE_P(AllPaths, FetchFormsTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
