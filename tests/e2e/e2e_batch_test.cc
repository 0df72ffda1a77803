// The batch RPCs (ExtractRow, FilterRows, MergeCaches, ExtendCache; mlx-lm
// BatchKVCache) end to end through the client library. Tiny float32 caches
// whose values name their cache, row and position give expectations written
// out by hand; caches of every kind at once are checked byte for byte against
// tests/engine/reference_batch.h. Refusals (bad rows, ids, layouts; caches out
// of step; padding against attention sinks) change nothing a client can see.
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "chunked_recurrent_test_util.h"
#include "e2e_test_util.h"
#include "gtest/gtest.h"
#include "reference_batch.h"

namespace kvcache::testing {
namespace {

using Code = absl::StatusCode;


// K element d of row `row` at position `position` of cache `tag`; V is its
// negation. Exact in float32 for the sizes used here.
float Tagged(int tag, uint32_t row, uint64_t position, uint32_t d) {
  return static_cast<float>(tag * 10000 + row * 1000 + position * 10 + d);
}

// K element 0 of `count` positions of row `row` of cache `tag` from `begin` on.
std::vector<float> Tags(int tag, uint32_t row, uint64_t begin, uint64_t count) {
  std::vector<float> out;
  for (uint64_t p = begin; p < begin + count; ++p) out.push_back(Tagged(tag, row, p, 0));
  return out;
}

std::vector<float> Cat(std::vector<std::vector<float>> parts) {
  std::vector<float> out;
  for (const auto& part : parts) out.insert(out.end(), part.begin(), part.end());
  return out;
}

// float32, one head, head dim 2: a global layer and a sliding window of 8
// without sinks (so rows may be padded).
engine::CacheSpec TinySpec(std::vector<uint32_t> padding) {
  engine::CacheSpec spec = MakeSpec({StandardLayerSpec(1, 2), RotatingLayerSpec(1, 2, 0, 8, 0)},
                                    DType::kFloat32, static_cast<uint32_t>(padding.size()));
  spec.left_padding = std::move(padding);
  return spec;
}

// Every kind in one batch: recurrent, quantized, chunked, sliding window, global.
engine::CacheSpec EveryKindSpec(std::vector<uint32_t> padding) {
  const engine::LayerSpec quantized{.num_kv_heads = 1,
                                    .k_head_dim = 32,
                                    .v_head_dim = 32,
                                    .kind = engine::QuantizedKind{.group_size = 32, .bits = 4}};
  engine::CacheSpec spec =
      MakeSpec({RecurrentLayerSpec(2, 8, 2, 4, 4), quantized, ChunkedLayerSpec(1, 4, 0, 5),
                RotatingLayerSpec(1, 4, 8, 7, 0), StandardLayerSpec(2, 8)},
               DType::kBFloat16, static_cast<uint32_t>(padding.size()));
  spec.left_padding = std::move(padding);
  return spec;
}

class E2eBatchTest : public E2eTest {
 protected:
  // A cache of `spec` over the wire, mirrored in references_.
  std::string NewCache(const engine::CacheSpec& spec) {
    absl::StatusOr<v1::CacheInfo> info = client().CreateCache(ToWireSpec(spec));
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return "";
    references_[info->cache_id()] = std::make_unique<RefCache>(spec);
    return info->cache_id();
  }
  RefCache& Ref(const std::string& id) { return *references_.at(id); }

  // Appends `tokens` tagged tokens to every layer of a tiny cache, one stream.
  void AppendTagged(const std::string& id, uint64_t tokens, int tag) {
    RefCache& reference = Ref(id);
    const engine::CacheSpec& spec = reference.spec();
    const uint64_t offset = reference.CommonOffset().value();
    KvTensors kv{.tokens = tokens};
    std::vector<float> keys, values;
    for (uint32_t row = 0; row < spec.batch_size; ++row) {
      for (uint64_t p = offset; p < offset + tokens; ++p) {
        for (uint32_t d = 0; d < 2; ++d) {
          keys.push_back(Tagged(tag, row, p, d));
          values.push_back(-Tagged(tag, row, p, d));
        }
      }
    }
    for (auto [out, in] : {std::pair{&kv.keys, &keys}, std::pair{&kv.values, &values}}) {
      out->resize(in->size() * sizeof(float));
      std::memcpy(out->data(), in->data(), out->size());
    }
    std::vector<LayerUpdate> updates;
    for (uint32_t l = 0; l < spec.layers.size(); ++l)
      updates.push_back(MakeLayerUpdate(spec, l, kv));
    absl::StatusOr<std::vector<v1::UpdateResponse>> acks = client().Update(id, updates);
    ASSERT_TRUE(acks.ok()) << acks.status();
    for (uint32_t l = 0; l < spec.layers.size(); ++l) {
      reference.Update(l, TokensFromTensors(ShapeOf(spec, l), kv.keys, kv.values, tokens));
    }
  }

  // K element 0 of each position a row of a tiny cache holds in `layer`.
  std::vector<float> RowKeys(const std::string& id, uint32_t layer, uint32_t row) {
    absl::StatusOr<LayerHistory> history = client().FetchLayer(id, "", layer);
    EXPECT_TRUE(history.ok()) << history.status();
    if (!history.ok()) return {};
    std::vector<float> out;
    for (uint64_t l = 0; l < history->tokens; ++l) {
      float value;
      std::memcpy(&value, history->keys.data() + ((row * history->tokens) + l) * 2 * sizeof(float),
                  sizeof(float));
      out.push_back(value);
    }
    return out;
  }

  // The cache `info` describes has `batch` rows, `padding` and `offset`, and
  // matches `expected`; it is mirrored from then on.
  void Adopt(const absl::StatusOr<v1::CacheInfo>& info, RefBatchResult expected, uint32_t batch,
             std::vector<uint32_t> padding, uint64_t offset) {
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(expected.code, Code::kOk);
    EXPECT_EQ(info->spec().batch_size(), batch);
    EXPECT_EQ(std::vector<uint32_t>(info->spec().left_padding().begin(),
                                    info->spec().left_padding().end()),
              padding);
    EXPECT_EQ(info->offset(), offset);
    EXPECT_TRUE(info->in_step());
    EXPECT_TRUE(CacheMatchesReference(client(), info->cache_id(), *expected.cache));
    references_[info->cache_id()] = std::move(expected.cache);
  }

  ::testing::AssertionResult Unchanged(const std::string& id) {
    return CacheMatchesReference(client(), id, Ref(id));
  }

  std::mt19937_64 rng_{23};
  std::map<std::string, std::unique_ptr<RefCache>> references_;
};

TEST_P(E2eBatchTest, ExtractRowStripsItsPaddingAndLeavesTheSourceAlone) {
  const std::string id = NewCache(TinySpec({2, 3, 0}));
  AppendTagged(id, 5, 1);
  const absl::StatusOr<v1::CacheInfo> row1 = client().ExtractRow(id, 1);
  Adopt(row1, RefExtractRow(Ref(id), 1), 1, {}, 2);
  EXPECT_NE(row1->cache_id(), id);
  for (uint32_t layer : {0u, 1u}) {
    EXPECT_EQ(RowKeys(row1->cache_id(), layer, 0), Tags(1, 1, 3, 2)) << "layer " << layer;
  }
  const absl::StatusOr<v1::CacheInfo> row2 = client().ExtractRow(id, 2);
  Adopt(row2, RefExtractRow(Ref(id), 2), 1, {}, 5);
  EXPECT_EQ(RowKeys(row2->cache_id(), 0, 0), Tags(1, 2, 0, 5));
  EXPECT_TRUE(Unchanged(id));
}

TEST_P(E2eBatchTest, FilterRowsKeepsThemInOrderAndDropsTheirCommonPadding) {
  const std::string id = NewCache(TinySpec({2, 3, 0}));
  AppendTagged(id, 5, 1);
  // Rows 1 and 0 pad 3 and 2: the first 2 positions go, padding {1, 0}.
  const uint32_t keep[] = {1, 0};
  RefBatchResult expected = RefFilterRows(Ref(id), {1, 0});
  const absl::StatusOr<v1::CacheInfo> filtered = client().FilterRows(id, keep);
  EXPECT_EQ(filtered.value_or(v1::CacheInfo()).cache_id(), id);
  Adopt(filtered, std::move(expected), 2, {1, 0}, 3);
  for (uint32_t layer : {0u, 1u}) {
    EXPECT_EQ(RowKeys(id, layer, 0), Tags(1, 1, 2, 3)) << "layer " << layer;
    EXPECT_EQ(RowKeys(id, layer, 1), Tags(1, 0, 2, 3)) << "layer " << layer;
  }
  // The filtered batch goes on stepping.
  AppendTagged(id, 2, 2);
  EXPECT_EQ(RowKeys(id, 0, 1), Cat({Tags(1, 0, 2, 3), Tags(2, 1, 3, 2)}));
  EXPECT_TRUE(Unchanged(id));
}

TEST_P(E2eBatchTest, ExtendAndMergeRightAlignRowsBehindZeros) {
  const std::string a = NewCache(TinySpec({0}));
  const std::string b = NewCache(TinySpec({0, 1}));
  AppendTagged(a, 5, 1);
  AppendTagged(b, 3, 2);
  // Merge: a new batch of a's row and b's two, b's moved right by 2.
  const std::string ids[] = {b, a};
  const absl::StatusOr<v1::CacheInfo> merged = client().MergeCaches(ids);
  Adopt(merged, RefMerge({&Ref(b), &Ref(a)}), 3, {2, 3, 0}, 5);
  EXPECT_EQ(RowKeys(merged->cache_id(), 0, 1), Cat({{0, 0, 0}, Tags(2, 1, 1, 2)}));
  EXPECT_EQ(RowKeys(merged->cache_id(), 1, 2), Tags(1, 0, 0, 5));
  EXPECT_TRUE(Unchanged(a));
  EXPECT_TRUE(Unchanged(b));
  // Extend: b's rows appended to a's in place, right-aligned; b unchanged.
  RefBatchResult expected = RefExtend(Ref(a), Ref(b));
  const absl::StatusOr<v1::CacheInfo> extended = client().ExtendCache(a, b);
  EXPECT_EQ(extended.value_or(v1::CacheInfo()).cache_id(), a);
  Adopt(extended, std::move(expected), 3, {0, 2, 3}, 5);
  EXPECT_EQ(RowKeys(a, 0, 1), Cat({{0, 0}, Tags(2, 0, 0, 3)}));
  EXPECT_EQ(RowKeys(a, 1, 2), Cat({{0, 0}, Tags(2, 1, 0, 3)}));  // padding content travels
  EXPECT_TRUE(Unchanged(b));
}

// Recurrent states picked by row, quantized rows moved as stored, chunked
// starts and windows right-aligned: each result equals the reference's.
TEST_P(E2eBatchTest, EveryKindBatchesAsTheReferenceDoes) {
  const std::string id = NewCache(EveryKindSpec({1, 0, 3}));
  const std::string partner = NewCache(EveryKindSpec({2}));
  for (uint64_t tokens : {4, 1, 3}) ASSERT_TRUE(StepBoth(client(), id, Ref(id), tokens, rng_).ok());
  for (uint64_t tokens : {2, 2}) {
    ASSERT_TRUE(StepBoth(client(), partner, Ref(partner), tokens, rng_).ok());
  }
  for (uint32_t row = 0; row < 3; ++row) {
    const absl::StatusOr<v1::CacheInfo> extracted = client().ExtractRow(id, row);
    RefBatchResult expected = RefExtractRow(Ref(id), row);
    ASSERT_TRUE(extracted.ok()) << extracted.status();
    EXPECT_TRUE(CacheMatchesReference(client(), extracted->cache_id(), *expected.cache));
  }
  const std::string ids[] = {partner, id, partner};
  const absl::StatusOr<v1::CacheInfo> merged = client().MergeCaches(ids);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_TRUE(CacheMatchesReference(client(), merged->cache_id(),
                                    *RefMerge({&Ref(partner), &Ref(id), &Ref(partner)}).cache));
  RefBatchResult extended = RefExtend(Ref(id), Ref(partner));
  ASSERT_TRUE(client().ExtendCache(id, partner).ok());
  EXPECT_TRUE(CacheMatchesReference(client(), id, *extended.cache));
  references_[id] = std::move(extended.cache);
  const uint32_t keep[] = {3, 1, 3};
  RefBatchResult filtered = RefFilterRows(Ref(id), {3, 1, 3});
  ASSERT_TRUE(client().FilterRows(id, keep).ok());
  EXPECT_TRUE(CacheMatchesReference(client(), id, *filtered.cache));
  references_[id] = std::move(filtered.cache);
  // The result steps on like any cache.
  ASSERT_TRUE(StepBoth(client(), id, Ref(id), 2, rng_).ok());
  EXPECT_TRUE(Unchanged(id));
  EXPECT_TRUE(Unchanged(partner));
}

TEST_P(E2eBatchTest, BadRequestsAreInvalidArgumentOrNotFound) {
  const std::string id = NewCache(TinySpec({1, 0}));
  const std::string other = NewCache(MakeSpec({StandardLayerSpec(1, 2)}, DType::kFloat32));
  AppendTagged(id, 3, 1);
  Client& c = client();
  ExpectRefused(Code::kInvalidArgument, "row", [&] { return c.ExtractRow(id, 2).status(); });
  ExpectRefused(Code::kInvalidArgument, "cache_id", [&] { return c.ExtractRow("", 0).status(); });
  ExpectRefused(Code::kNotFound, "cache_id", [&] { return c.ExtractRow(kUnknownId, 0).status(); });
  ExpectRefused(Code::kInvalidArgument, "keep_rows", [&] { return c.FilterRows(id, {}).status(); });
  const uint32_t out_of_range[] = {0, 2};
  ExpectRefused(Code::kInvalidArgument, "keep_rows[1]",
                [&] { return c.FilterRows(id, out_of_range).status(); });
  ExpectRefused(Code::kInvalidArgument, "cache_ids", [&] { return c.MergeCaches({}).status(); });
  for (const std::string& second : {std::string(""), other}) {
    const std::string ids[] = {id, second};
    ExpectRefused(Code::kInvalidArgument, "cache_ids[1]",
                  [&] { return c.MergeCaches(ids).status(); });
  }
  const std::string unknown[] = {id, kUnknownId};
  ExpectRefused(Code::kNotFound, "cache_ids[1]", [&] { return c.MergeCaches(unknown).status(); });
  ExpectRefused(Code::kInvalidArgument, "other_id", [&] { return c.ExtendCache(id, "").status(); });
  ExpectRefused(Code::kInvalidArgument, "other_id",
                [&] { return c.ExtendCache(id, other).status(); });
  ExpectRefused(Code::kNotFound, "other_id",
                [&] { return c.ExtendCache(id, kUnknownId).status(); });
}

TEST_P(E2eBatchTest, OutOfStepCachesAndDisplacedSinksAreFailedPrecondition) {
  const std::string id = NewCache(TinySpec({1, 0}));
  AppendTagged(id, 3, 1);
  // Layer 0 one token ahead: every batch operation on the cache is refused.
  const KvTensors kv = RandomKv(Ref(id).spec(), 0, 1, rng_);
  const LayerUpdate ahead = MakeLayerUpdate(Ref(id).spec(), 0, kv);
  ASSERT_TRUE(client().Update(id, {&ahead, 1}).ok());
  Ref(id).Update(0, TokensFromTensors(ShapeOf(Ref(id).spec(), 0), kv.keys, kv.values, 1));
  Client& c = client();
  const uint32_t keep[] = {0};
  const std::string ids[] = {id};
  ExpectRefused(Code::kFailedPrecondition, "out of step",
                [&] { return c.ExtractRow(id, 0).status(); });
  ExpectRefused(Code::kFailedPrecondition, "out of step",
                [&] { return c.FilterRows(id, keep).status(); });
  ExpectRefused(Code::kFailedPrecondition, "cache_ids[0]",
                [&] { return c.MergeCaches(ids).status(); });
  ExpectRefused(Code::kFailedPrecondition, "out of step",
                [&] { return c.ExtendCache(id, id).status(); });
  // Sinks (rotating keep 4) batch only at equal lengths: padding would move them.
  const engine::CacheSpec sinks = MakeSpec({RotatingLayerSpec(1, 2, 0, 8, 4)}, DType::kFloat32);
  const std::string longer = NewCache(sinks);
  const std::string shorter = NewCache(sinks);
  AppendTagged(longer, 4, 2);
  AppendTagged(shorter, 2, 3);
  const std::string pair[] = {longer, shorter};
  ExpectRefused(Code::kFailedPrecondition, "attention sinks",
                [&] { return c.MergeCaches(pair).status(); });
  ExpectRefused(Code::kFailedPrecondition, "attention sinks",
                [&] { return c.ExtendCache(longer, shorter).status(); });
}

INSTANTIATE_TEST_SUITE_P(Paths, E2eBatchTest, ::testing::ValuesIn(kE2ePaths), PathTestName);

}  // namespace
}  // namespace kvcache::testing
