// The batch handlers (server/service/batch_handlers.cc) without a network:
// each answers with the resulting cache's CacheInfo (the same cache for
// FilterRows and ExtendCache, a new one for ExtractRow and MergeCaches) whose
// contents equal tests/engine/reference_batch.h's, sources unchanged; missing
// ids are INVALID_ARGUMENT naming the field, unknown ones NOT_FOUND, and no
// refusal changes anything.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "handlers_test_base.h"
#include "reference_batch.h"

namespace kvcache::testing {
namespace {

using Code = absl::StatusCode;

// A recurrent state, a quantized layer, a sliding window without sinks.
engine::CacheSpec BatchSpec(std::vector<uint32_t> padding) {
  const engine::LayerSpec quantized{.num_kv_heads = 1,
                                    .k_head_dim = 32,
                                    .v_head_dim = 32,
                                    .kind = engine::QuantizedKind{.group_size = 32, .bits = 8}};
  engine::CacheSpec spec =
      MakeSpec({RecurrentLayerSpec(2, 4, 1, 2, 2), quantized, RotatingLayerSpec(1, 4, 0, 6, 0)},
               DType::kFloat16, static_cast<uint32_t>(padding.size()));
  spec.left_padding = std::move(padding);
  return spec;
}

class BatchHandlersTest : public HandlersTestBase {
 protected:
  // Two batches: `a_` (3 rows, padding {1, 0, 2}, 5 tokens) and `b_` (1 row,
  // 3 tokens), each mirrored.
  void SetUp() override {
    HandlersTestBase::SetUp();
    if (HasFatalFailure()) return;
    a_ = Create(BatchSpec({1, 0, 2}));
    b_ = Create(BatchSpec({0}));
    ASSERT_TRUE(Step(a_, a_ref_, 4));
    ASSERT_TRUE(Step(a_, a_ref_, 1));
    ASSERT_TRUE(Step(b_, b_ref_, 3));
  }

  // `info` describes a cache of `batch` rows at `offset`, in step, equal to `expected`.
  void ExpectCache(const v1::CacheInfo& info, const RefBatchResult& expected, uint32_t batch,
                   uint64_t offset) {
    ASSERT_EQ(expected.code, Code::kOk);
    EXPECT_EQ(info.cache_id().size(), 32u);
    EXPECT_EQ(info.spec().batch_size(), batch);
    EXPECT_EQ(info.spec().layers_size(), 3);
    EXPECT_EQ(info.offset(), offset);
    EXPECT_TRUE(info.in_step());
    EXPECT_EQ(info.layer_offsets_size(), 3);
    EXPECT_TRUE(Matches(info.cache_id(), *expected.cache));
  }

  std::string a_, b_;
  RefCache a_ref_{BatchSpec({1, 0, 2})};
  RefCache b_ref_{BatchSpec({0})};
};

TEST_P(BatchHandlersTest, ExtractRowMakesANewCacheOfOneRow) {
  v1::ExtractRowRequest request;
  request.set_cache_id(a_);
  request.set_row(2);
  v1::CacheInfo info;
  ASSERT_TRUE(handlers_->ExtractRow(request, &info).ok());
  EXPECT_NE(info.cache_id(), a_);
  ExpectCache(info, RefExtractRow(a_ref_, 2), 1, 3);  // padding 2 stripped
  EXPECT_EQ(info.spec().left_padding_size(), 0);
  EXPECT_TRUE(Matches(a_, a_ref_));
}

TEST_P(BatchHandlersTest, FilterRowsChangesTheCacheInPlace) {
  v1::FilterRowsRequest request;
  request.set_cache_id(a_);
  for (uint32_t row : {2, 0}) request.add_keep_rows(row);
  v1::CacheInfo info;
  ASSERT_TRUE(handlers_->FilterRows(request, &info).ok());
  EXPECT_EQ(info.cache_id(), a_);
  ExpectCache(info, RefFilterRows(a_ref_, {2, 0}), 2, 4);  // common padding 1 dropped
  EXPECT_EQ(
      std::vector<uint32_t>(info.spec().left_padding().begin(), info.spec().left_padding().end()),
      (std::vector<uint32_t>{1, 0}));
}

// An Update stream keeps the spec it looked up (KnownSpec); FilterRows changes
// the cache's rows under the same id, and the stream must follow.
TEST_P(BatchHandlersTest, AnUpdateStreamFollowsTheRowsAfterFilterRows) {
  service::KnownSpec known;  // as a stream that wrote before the filter holds it
  ASSERT_TRUE(engine_->RefreshSpec(a_, known.layout_id, known.spec).ok());
  v1::UpdateResponse response;
  LayerUpdateData data;
  const engine::CacheSpec three_rows = BatchSpec({1, 0, 2});
  v1::FilterRowsRequest filter;
  filter.set_cache_id(a_);
  for (uint32_t row : {2, 0}) filter.add_keep_rows(row);
  v1::CacheInfo info;
  ASSERT_TRUE(handlers_->FilterRows(filter, &info).ok());
  engine::CacheSpec two_rows = three_rows;
  two_rows.batch_size = 2;
  two_rows.left_padding = {1, 0};
  const absl::Status stale =
      handlers_->Update(RandomLayerUpdate(a_, three_rows, 1, 1, data), &known, &response);
  EXPECT_EQ(stale.code(), Code::kInvalidArgument) << stale;
  EXPECT_NE(stale.message().find("keys"), std::string::npos) << stale;
  EXPECT_TRUE(
      handlers_->Update(RandomLayerUpdate(a_, two_rows, 1, 1, data), &known, &response).ok());
}

TEST_P(BatchHandlersTest, MergeCachesMakesANewLeftPaddedBatch) {
  v1::MergeCachesRequest request;
  for (const std::string& id : {b_, a_, b_}) request.add_cache_ids(id);
  v1::CacheInfo info;
  ASSERT_TRUE(handlers_->MergeCaches(request, &info).ok());
  ExpectCache(info, RefMerge({&b_ref_, &a_ref_, &b_ref_}), 5, 5);
  EXPECT_TRUE(Matches(a_, a_ref_));
  EXPECT_TRUE(Matches(b_, b_ref_));
}

TEST_P(BatchHandlersTest, ExtendCacheAppendsTheOtherRowsInPlace) {
  v1::ExtendCacheRequest request;
  request.set_cache_id(b_);
  request.set_other_id(a_);
  v1::CacheInfo info;
  ASSERT_TRUE(handlers_->ExtendCache(request, &info).ok());
  EXPECT_EQ(info.cache_id(), b_);
  ExpectCache(info, RefExtend(b_ref_, a_ref_), 4, 5);  // b's row moves right by 2
  EXPECT_TRUE(Matches(a_, a_ref_));
}

TEST_P(BatchHandlersTest, MissingAndUnknownIdsAreRefused) {
  constexpr char kUnknown[] = "00112233445566778899aabbccddeeff";
  v1::CacheInfo info;
  v1::ExtractRowRequest extract;
  ExpectRefused(Code::kInvalidArgument, "cache_id",
                [&] { return handlers_->ExtractRow(extract, &info); });
  extract.set_cache_id(kUnknown);
  ExpectRefused(Code::kNotFound, "cache_id", [&] { return handlers_->ExtractRow(extract, &info); });
  extract.set_cache_id(a_);
  extract.set_row(3);
  ExpectRefused(Code::kInvalidArgument, "row",
                [&] { return handlers_->ExtractRow(extract, &info); });
  v1::FilterRowsRequest filter;
  ExpectRefused(Code::kInvalidArgument, "cache_id",
                [&] { return handlers_->FilterRows(filter, &info); });
  filter.set_cache_id(a_);
  ExpectRefused(Code::kInvalidArgument, "keep_rows",
                [&] { return handlers_->FilterRows(filter, &info); });
  v1::MergeCachesRequest merge;
  ExpectRefused(Code::kInvalidArgument, "cache_ids",
                [&] { return handlers_->MergeCaches(merge, &info); });
  merge.add_cache_ids(a_);
  merge.add_cache_ids("");
  ExpectRefused(Code::kInvalidArgument, "cache_ids[1]",
                [&] { return handlers_->MergeCaches(merge, &info); });
  merge.set_cache_ids(1, kUnknown);
  ExpectRefused(Code::kNotFound, "cache_ids[1]",
                [&] { return handlers_->MergeCaches(merge, &info); });
  v1::ExtendCacheRequest extend;
  extend.set_other_id(a_);
  ExpectRefused(Code::kInvalidArgument, "cache_id",
                [&] { return handlers_->ExtendCache(extend, &info); });
  extend.set_cache_id(a_);
  extend.clear_other_id();
  ExpectRefused(Code::kInvalidArgument, "other_id",
                [&] { return handlers_->ExtendCache(extend, &info); });
  extend.set_other_id(kUnknown);
  ExpectRefused(Code::kNotFound, "other_id", [&] { return handlers_->ExtendCache(extend, &info); });
}

INSTANTIATE_TEST_SUITE_P(AllPaths, BatchHandlersTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
