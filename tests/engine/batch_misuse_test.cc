// Every refusal of the batch operations: the status code, the field or reason
// the message names, and that nothing visible changed (ExpectRefused compares
// fingerprints of every cache, snapshot and the pool's used pages).
#include <string>
#include <vector>

#include "batch_test_util.h"
#include "gtest/gtest.h"

namespace kvcache::testing {
namespace {

using absl::StatusCode;

constexpr char kUnknownId[] = "0123456789abcdef0123456789abcdef";

class BatchMisuseTest : public BatchTestBase {
 protected:
  // A batch of 3 with padding and history, plus a snapshot to disturb.
  std::string Populated() {
    const std::string id = NewCache(TinySpec({TinyStandard(), TinyRotating(4, 0)}, {1, 0, 2}));
    Append(id, 6, 1, 2);
    EXPECT_TRUE(engine_->Snapshot(id, 0).ok());
    return id;
  }
};

TEST_P(BatchMisuseTest, UnknownIdsAreNotFoundNamingTheField) {
  const std::string id = Populated();
  ExpectRefused(StatusCode::kNotFound, "cache_id",
                [&] { return engine_->ExtractRow(kUnknownId, 0); });
  ExpectRefused(StatusCode::kNotFound, "cache_id",
                [&] { return engine_->FilterRows(kUnknownId, {0}); });
  const std::vector<std::string> ids = {id, kUnknownId};
  ExpectRefused(StatusCode::kNotFound, "cache_ids[1]", [&] { return engine_->MergeCaches(ids); });
  ExpectRefused(StatusCode::kNotFound, "other_id",
                [&] { return engine_->ExtendCache(id, kUnknownId); });
  ExpectRefused(StatusCode::kNotFound, "cache_id",
                [&] { return engine_->ExtendCache(kUnknownId, id); });
}

TEST_P(BatchMisuseTest, BadRowsAreInvalidArgumentsNamingTheField) {
  const std::string id = Populated();
  ExpectRefused(StatusCode::kInvalidArgument, "row", [&] { return engine_->ExtractRow(id, 3); });
  ExpectRefused(StatusCode::kInvalidArgument, "keep_rows",
                [&] { return engine_->FilterRows(id, {}); });
  ExpectRefused(StatusCode::kInvalidArgument, "keep_rows[1]", [&] {
    return engine_->FilterRows(id, {0, 3, 1});
  });
  ExpectRefused(StatusCode::kInvalidArgument, "cache_ids",
                [&] { return engine_->MergeCaches(std::vector<std::string>{}); });
}

TEST_P(BatchMisuseTest, OtherLayoutsAreInvalidArgumentsNamingTheCache) {
  const std::string id = Populated();
  engine::CacheSpec dims = TinySpec({StandardLayerSpec(1, 4, 4), TinyRotating(4, 0)}, {0});
  engine::CacheSpec window = TinySpec({TinyStandard(), TinyRotating(5, 0)}, {0});
  engine::CacheSpec dtype = TinySpec({TinyStandard(), TinyRotating(4, 0)}, {0});
  dtype.dtype = DType::kFloat16;
  engine::CacheSpec kinds = TinySpec({TinyStandard(), TinyStandard()}, {0});
  for (const engine::CacheSpec& spec : {dims, window, dtype, kinds}) {
    const std::string other = NewCache(spec);
    const std::vector<std::string> ids = {id, id, other};
    ExpectRefused(StatusCode::kInvalidArgument, "cache_ids[2]",
                  [&] { return engine_->MergeCaches(ids); });
    ExpectRefused(StatusCode::kInvalidArgument, "other_id",
                  [&] { return engine_->ExtendCache(id, other); });
  }
}

TEST_P(BatchMisuseTest, LayersOutOfStepAreFailedPreconditions) {
  const std::string good = Populated();
  const std::string torn = Populated();
  const std::vector<float> one(3 * 2, 1.0f);
  const auto bytes = absl::MakeConstSpan(reinterpret_cast<const std::byte*>(one.data()), 24);
  ASSERT_TRUE(engine_->Update(torn, 0, {bytes, bytes, 1}).ok());  // layer 1 behind
  const std::vector<std::string> ids = {good, torn};
  ExpectRefused(StatusCode::kFailedPrecondition, "out of step",
                [&] { return engine_->ExtractRow(torn, 0); });
  ExpectRefused(StatusCode::kFailedPrecondition, "cache_id",
                [&] { return engine_->FilterRows(torn, {0}); });
  ExpectRefused(StatusCode::kFailedPrecondition, "cache_ids[1]",
                [&] { return engine_->MergeCaches(ids); });
  ExpectRefused(StatusCode::kFailedPrecondition, "other_id",
                [&] { return engine_->ExtendCache(good, torn); });
  ExpectRefused(StatusCode::kFailedPrecondition, "cache_id",
                [&] { return engine_->ExtendCache(torn, good); });
}

TEST_P(BatchMisuseTest, ResultsBeyondTheLimitsAreInvalidArguments) {
  engine::SpecLimits limits{.max_batch_size = 4, .max_window = 8};
  StartEngine(4 << 20, engine::EngineOptions{.page_tokens = 3, .limits = limits});
  const std::string id = Populated();
  const std::string young = NewCache(TinySpec({TinyStandard(), TinyRotating(4, 0)}, {0, 0}));
  const std::vector<std::string> rows5 = {id, young};
  ExpectRefused(StatusCode::kInvalidArgument, "batch_size",
                [&] { return engine_->MergeCaches(rows5); });
  ExpectRefused(StatusCode::kInvalidArgument, "other_id",
                [&] { return engine_->ExtendCache(id, young); });
  ExpectRefused(StatusCode::kInvalidArgument, "keep_rows", [&] {
    return engine_->FilterRows(id, {0, 1, 2, 0, 1});
  });
  // 10 tokens against an empty row: padding 10 is over max_window 8.
  const std::string old = NewCache(TinySpec({TinyStandard(), TinyRotating(4, 0)}, {0}));
  Append(old, 10, 2, 1);
  const std::string empty = NewCache(TinySpec({TinyStandard(), TinyRotating(4, 0)}, {0}));
  const std::vector<std::string> padded = {old, empty};
  ExpectRefused(StatusCode::kInvalidArgument, "left_padding",
                [&] { return engine_->MergeCaches(padded); });
}

// A filter that keeps every row still strips the common padding: the same
// positions now hold other tokens, so an older snapshot must not come back.
TEST_P(BatchMisuseTest, RestoreAcrossAPaddingChangeIsAFailedPrecondition) {
  const std::string id = NewCache(TinySpec({TinyStandard(), TinyRotating(4, 0)}, {2, 1, 3}));
  Append(id, 6, 1, 2);
  auto before = engine_->Snapshot(id, 0);
  ASSERT_TRUE(before.ok()) << before.status();
  auto filtered = engine_->FilterRows(id, {0, 1, 2});
  ASSERT_TRUE(filtered.ok()) << filtered.status();
  EXPECT_EQ(filtered->spec.left_padding, (std::vector<uint32_t>{1, 0, 2}));
  ExpectRefused(StatusCode::kFailedPrecondition, "left_padding",
                [&] { return engine_->Restore(id, before->snapshot_id, 6); });
}

// All-zero padding is no padding: attention sinks stay allowed and the
// padding is dropped from the spec.
TEST_P(BatchMisuseTest, AllZeroPaddingIsNoPadding) {
  auto info = engine_->CreateCache(TinySpec({TinyStandard(), TinyRotating(4, 1)}, {0, 0}));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->spec.left_padding.empty());
  const absl::Status padded =
      engine_->CreateCache(TinySpec({TinyStandard(), TinyRotating(4, 1)}, {0, 1})).status();
  EXPECT_EQ(padded.code(), StatusCode::kInvalidArgument) << padded;
  EXPECT_TRUE(engine_->DeleteCache(info->cache_id).ok());
}

// 8 heads x (64 + 64) x 4 bytes: one row of a token fills a 4 KiB page; two do not fit.
TEST_P(BatchMisuseTest, ABatchWhoseTokenOverflowsAPageIsRefused) {
  const engine::CacheSpec wide = MakeSpec({StandardLayerSpec(8, 64, 64)}, DType::kFloat32, 1);
  const std::string a = NewCache(wide);
  const std::string b = NewCache(wide);
  const std::vector<std::string> ids = {a, b};
  ExpectRefused(StatusCode::kInvalidArgument, "cache_ids",
                [&] { return engine_->MergeCaches(ids); });
  ExpectRefused(StatusCode::kInvalidArgument, "page", [&] { return engine_->ExtendCache(a, a); });
}

TEST_P(BatchMisuseTest, RunningOutOfPagesChangesNothing) {
  const std::string id = Populated();
  const std::string big = NewCache(TinySpec({TinyStandard(), TinyRotating(4, 0)}, {0, 0, 0, 0}));
  Append(big, 24, 2);
  // Six pages left: each call below needs at least eight, one extracted row four.
  std::vector<gpu::PageId> hog;
  ASSERT_TRUE(pool_->Allocate(pool_->available_pages() - 6, hog).ok());
  const std::vector<uint32_t> keep = {0, 1, 2, 3, 0, 1};
  const std::vector<std::string> ids = {big, big, id};
  for (int attempt = 0; attempt < 2; ++attempt) {
    ExpectRefused(StatusCode::kResourceExhausted, "",
                  [&] { return engine_->FilterRows(big, keep); });
    ExpectRefused(StatusCode::kResourceExhausted, "", [&] { return engine_->MergeCaches(ids); });
    ExpectRefused(StatusCode::kResourceExhausted, "",
                  [&] { return engine_->ExtendCache(big, big); });
  }
  EXPECT_TRUE(engine_->ExtractRow(id, 1).ok());  // what fits still works
  for (gpu::PageId page : hog) pool_->Release(page);
}

INSTANTIATE_TEST_SUITE_P(AllPaths, BatchMisuseTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
