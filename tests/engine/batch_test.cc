// The batch operations' semantics (mlx-lm BatchKVCache / BatchRotatingKVCache,
// engine/batch/batch_ops.h) against expectations written out by hand: every value
// names its cache, row and position (batch_test_util.h), so each expected row
// below reads as "zeros, then row r of cache t from position p on".
#include <string>
#include <thread>
#include <vector>

#include "batch_test_util.h"
#include "gtest/gtest.h"

namespace kvcache::testing {
namespace {

using engine::CacheInfo;
using engine::TokenRange;

std::vector<float> Cat(std::vector<std::vector<float>> parts) {
  std::vector<float> out;
  for (const auto& part : parts) out.insert(out.end(), part.begin(), part.end());
  return out;
}

std::vector<float> Zeros(uint64_t count) { return std::vector<float>(count, 0.0f); }

class BatchTest : public BatchTestBase {
 protected:
  CacheInfo Info(const std::string& id) {
    absl::StatusOr<CacheInfo> info = engine_->GetCache(id);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.value_or(CacheInfo{});
  }
  void ExpectShape(const CacheInfo& info, uint32_t batch, std::vector<uint32_t> padding,
                   uint64_t offset) {
    EXPECT_EQ(info.spec.batch_size, batch);
    EXPECT_EQ(info.spec.left_padding, padding);
    EXPECT_EQ(info.offset, offset);
    EXPECT_TRUE(info.in_step);
  }
  void ExpectRow(const std::string& id, uint32_t row, std::vector<TokenRange> ranges,
                 std::vector<float> keys, uint32_t layer = 0) {
    SCOPED_TRACE(::testing::Message() << "layer " << layer << " row " << row);
    RowContents contents = Row(id, layer, row);
    EXPECT_EQ(RangesString(contents.ranges), RangesString(ranges));
    EXPECT_EQ(contents.keys, keys);
  }
};

TEST_P(BatchTest, FilterKeepsRowsInOrderAndDropsTheirCommonPadding) {
  const std::string id = NewCache(TinySpec({TinyStandard(), TinyStandard()}, {2, 3, 0}));
  Append(id, 5, 1);
  // Rows 1 and 0 pad 3 and 2: the first 2 positions go, padding {1, 0}.
  absl::StatusOr<CacheInfo> filtered = engine_->FilterRows(id, {1, 0});
  ASSERT_TRUE(filtered.ok()) << filtered.status();
  EXPECT_EQ(filtered->cache_id, id);
  ExpectShape(*filtered, 2, {1, 0}, 3);
  for (uint32_t layer : {0, 1}) {
    ExpectRow(id, 0, {{0, 3}}, Expected(1, 1, 2, 3), layer);  // its padding content travels
    ExpectRow(id, 1, {{0, 3}}, Expected(1, 0, 2, 3), layer);
  }
  // A repeated row; both pad 0 now, so nothing is dropped.
  ASSERT_TRUE(engine_->FilterRows(id, {1, 1}).ok());
  ExpectShape(Info(id), 2, {}, 3);
  ExpectRow(id, 0, {{0, 3}}, Expected(1, 0, 2, 3));
  ExpectRow(id, 1, {{0, 3}}, Expected(1, 0, 2, 3));
  // The filtered cache goes on as a batch of 2.
  Append(id, 2, 2);
  ExpectRow(id, 1, {{0, 5}}, Cat({Expected(1, 0, 2, 3), Expected(2, 1, 3, 2)}));
}

TEST_P(BatchTest, FilterDropsNoMoreThanTheOffset) {
  const std::string id = NewCache(TinySpec({TinyStandard()}, {6, 4, 5}));
  Append(id, 2, 1);  // every row still inside its padding
  ASSERT_TRUE(engine_->FilterRows(id, {0, 2}).ok());
  // Dropping 2 (not 5) keeps each row's mlx offset (offset - padding).
  ExpectShape(Info(id), 2, {4, 3}, 0);
  ExpectRow(id, 0, {}, {});
}

TEST_P(BatchTest, ExtractStripsThePaddingAndLeavesTheSourceAlone) {
  const std::string id = NewCache(TinySpec({TinyStandard()}, {2, 3, 0}));
  Append(id, 5, 1);
  absl::StatusOr<CacheInfo> row1 = engine_->ExtractRow(id, 1);
  ASSERT_TRUE(row1.ok()) << row1.status();
  EXPECT_NE(row1->cache_id, id);
  ExpectShape(*row1, 1, {}, 2);
  ExpectRow(row1->cache_id, 0, {{0, 2}}, Expected(1, 1, 3, 2));
  absl::StatusOr<CacheInfo> row2 = engine_->ExtractRow(id, 2);
  ASSERT_TRUE(row2.ok()) << row2.status();
  ExpectShape(*row2, 1, {}, 5);
  ExpectRow(row2->cache_id, 0, {{0, 5}}, Expected(1, 2, 0, 5));
  ExpectShape(Info(id), 3, {2, 3, 0}, 5);
  for (uint32_t r = 0; r < 3; ++r) ExpectRow(id, r, {{0, 5}}, Expected(1, r, 0, 5));
  // A row still inside its padding extracts empty.
  const std::string young = NewCache(TinySpec({TinyStandard()}, {4, 0}));
  Append(young, 2, 2);
  absl::StatusOr<CacheInfo> empty = engine_->ExtractRow(young, 0);
  ASSERT_TRUE(empty.ok()) << empty.status();
  ExpectShape(*empty, 1, {}, 0);
}

TEST_P(BatchTest, ExtendRightAlignsBothCachesWithZerosInFront) {
  const std::string a = NewCache(TinySpec({TinyStandard()}, {0}));
  const std::string b = NewCache(TinySpec({TinyStandard()}, {0, 1}));
  Append(a, 5, 1);
  Append(b, 3, 2);
  absl::StatusOr<CacheInfo> extended = engine_->ExtendCache(a, b);
  ASSERT_TRUE(extended.ok()) << extended.status();
  EXPECT_EQ(extended->cache_id, a);
  ExpectShape(*extended, 3, {0, 2, 3}, 5);
  ExpectRow(a, 0, {{0, 5}}, Expected(1, 0, 0, 5));
  ExpectRow(a, 1, {{0, 5}}, Cat({Zeros(2), Expected(2, 0, 0, 3)}));
  ExpectRow(a, 2, {{0, 5}}, Cat({Zeros(2), Expected(2, 1, 0, 3)}));  // padding content travels
  ExpectShape(Info(b), 2, {0, 1}, 3);
  ExpectRow(b, 1, {{0, 3}}, Expected(2, 1, 0, 3));
  // The shorter side may be this cache: its rows move right.
  const std::string c = NewCache(TinySpec({TinyStandard()}, {0}));
  Append(c, 2, 3);
  ASSERT_TRUE(engine_->ExtendCache(c, b).ok());
  ExpectShape(Info(c), 3, {1, 0, 1}, 3);
  ExpectRow(c, 0, {{0, 3}}, Cat({Zeros(1), Expected(3, 0, 0, 2)}));
  ExpectRow(c, 2, {{0, 3}}, Expected(2, 1, 0, 3));
  // With itself: every row twice.
  ASSERT_TRUE(engine_->ExtendCache(b, b).ok());
  ExpectShape(Info(b), 4, {0, 1, 0, 1}, 3);
  ExpectRow(b, 3, {{0, 3}}, Expected(2, 1, 0, 3));
}

TEST_P(BatchTest, MergeLeftPadsEveryRowToTheLongest) {
  const std::string x = NewCache(TinySpec({TinyStandard()}, {0}));
  const std::string y = NewCache(TinySpec({TinyStandard()}, {0}));
  const std::string z = NewCache(TinySpec({TinyStandard()}, {1, 0}));
  Append(x, 4, 1);
  Append(y, 2, 2);
  Append(z, 3, 3);
  const std::vector<std::string> ids = {x, y, z, y};
  absl::StatusOr<CacheInfo> merged = engine_->MergeCaches(ids);
  ASSERT_TRUE(merged.ok()) << merged.status();
  const std::string m = merged->cache_id;
  // Lengths 4, 2, 2, 3, 2: padding max_length - length.
  ExpectShape(*merged, 5, {0, 2, 2, 1, 2}, 4);
  ExpectRow(m, 0, {{0, 4}}, Expected(1, 0, 0, 4));
  ExpectRow(m, 1, {{0, 4}}, Cat({Zeros(2), Expected(2, 0, 0, 2)}));
  ExpectRow(m, 2, {{0, 4}}, Cat({Zeros(2), Expected(3, 0, 1, 2)}));  // z's padding stays behind
  ExpectRow(m, 3, {{0, 4}}, Cat({Zeros(1), Expected(3, 1, 0, 3)}));
  ExpectRow(m, 4, {{0, 4}}, Cat({Zeros(2), Expected(2, 0, 0, 2)}));
  ExpectShape(Info(z), 2, {1, 0}, 3);  // inputs unchanged
  ExpectRow(z, 0, {{0, 3}}, Expected(3, 0, 0, 3));
}

TEST_P(BatchTest, RotatingMergeRightAlignsTheWindows) {
  const std::string wrapped = NewCache(TinySpec({TinyRotating(4, 0)}, {0}));
  const std::string young = NewCache(TinySpec({TinyRotating(4, 0)}, {0}));
  Append(wrapped, 10, 1, /*step=*/1);  // window [6, 10)
  Append(young, 2, 2);
  const std::vector<std::string> ids = {wrapped, young};
  absl::StatusOr<CacheInfo> merged = engine_->MergeCaches(ids);
  ASSERT_TRUE(merged.ok()) << merged.status();
  ExpectShape(*merged, 2, {0, 8}, 10);
  ExpectRow(merged->cache_id, 0, {{6, 10}}, Expected(1, 0, 6, 4));
  ExpectRow(merged->cache_id, 1, {{6, 10}}, Cat({Zeros(2), Expected(2, 0, 0, 2)}));
}

// A row that lost tokens of its own to the ring bounds the window: the longer
// window of the other row may not put zeros where its own tokens were.
TEST_P(BatchTest, RotatingWindowStopsAtARowThatLostItsOwnTokens) {
  const std::string wrapped = NewCache(TinySpec({TinyRotating(4, 0)}, {0}));
  const std::string long_held = NewCache(TinySpec({TinyRotating(4, 0)}, {0}));
  const std::string young = NewCache(TinySpec({TinyRotating(4, 0)}, {0}));
  Append(wrapped, 10, 1, 1);  // window [6, 10)
  Append(long_held, 6, 3);    // one update of 6: all held, [0, 6)
  Append(young, 2, 2);
  const std::vector<std::string> cut = {wrapped, long_held};
  absl::StatusOr<CacheInfo> merged = engine_->MergeCaches(cut);
  ASSERT_TRUE(merged.ok()) << merged.status();
  ExpectShape(*merged, 2, {0, 4}, 10);
  ExpectRow(merged->cache_id, 1, {{6, 10}}, Expected(3, 0, 2, 4));
  // Without a cut row the longest window stays whole.
  const std::vector<std::string> whole = {long_held, young};
  absl::StatusOr<CacheInfo> kept = engine_->MergeCaches(whole);
  ASSERT_TRUE(kept.ok()) << kept.status();
  ExpectShape(*kept, 2, {0, 4}, 6);
  ExpectRow(kept->cache_id, 1, {{0, 6}}, Cat({Zeros(4), Expected(2, 0, 0, 2)}));
  // The next single token trims the window to max_size, as mlx-lm's ring does.
  Append(kept->cache_id, 1, 4);
  ExpectRow(kept->cache_id, 0, {{3, 7}}, Cat({Expected(3, 0, 3, 3), Expected(4, 0, 6, 1)}));
}

TEST_P(BatchTest, RotatingFilterAndExtractShiftWrappedWindows) {
  const std::string id = NewCache(TinySpec({TinyRotating(4, 0), TinyStandard()}, {3, 0}));
  Append(id, 10, 5, 1);  // rotating window [6, 10)
  absl::StatusOr<CacheInfo> row0 = engine_->ExtractRow(id, 0);
  ASSERT_TRUE(row0.ok()) << row0.status();
  ExpectShape(*row0, 1, {}, 7);
  ExpectRow(row0->cache_id, 0, {{3, 7}}, Expected(5, 0, 6, 4), 0);
  ExpectRow(row0->cache_id, 0, {{0, 7}}, Expected(5, 0, 3, 7), 1);
  ASSERT_TRUE(engine_->FilterRows(id, {0}).ok());
  ExpectShape(Info(id), 1, {}, 7);
  ExpectRow(id, 0, {{3, 7}}, Expected(5, 0, 6, 4), 0);
}

TEST_P(BatchTest, RotatingLayersWithSinksBatchOnlyAtEqualLengths) {
  const auto spec = TinySpec({TinyRotating(8, 4)}, {0});
  const std::string s1 = NewCache(spec), s2 = NewCache(spec), s3 = NewCache(spec);
  Append(s1, 6, 1);
  Append(s2, 6, 2);
  Append(s3, 5, 3);
  const std::vector<std::string> unequal = {s1, s3};
  ExpectRefused(absl::StatusCode::kFailedPrecondition, "attention sinks",
                [&] { return engine_->MergeCaches(unequal); });
  ExpectRefused(absl::StatusCode::kFailedPrecondition, "other_id",
                [&] { return engine_->ExtendCache(s1, s3); });
  const std::vector<std::string> equal = {s1, s2};
  absl::StatusOr<CacheInfo> merged = engine_->MergeCaches(equal);
  ASSERT_TRUE(merged.ok()) << merged.status();
  ExpectShape(*merged, 2, {}, 6);
  ExpectRow(merged->cache_id, 1, {{0, 6}}, Expected(2, 0, 0, 6));
  ASSERT_TRUE(engine_->FilterRows(merged->cache_id, {1}).ok());
  ExpectRow(merged->cache_id, 0, {{0, 6}}, Expected(2, 0, 0, 6));
}

TEST_P(BatchTest, SnapshotsOutliveAFilterAndRefuseToRestoreIntoOtherRows) {
  const std::string id = NewCache(TinySpec({TinyStandard()}, {2, 3, 0}));
  Append(id, 5, 1);
  absl::StatusOr<engine::SnapshotInfo> snapshot = engine_->Snapshot(id, 0);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  ASSERT_TRUE(engine_->FilterRows(id, {2, 0}).ok());
  ExpectRefused(absl::StatusCode::kFailedPrecondition, "layout",
                [&] { return engine_->Restore(id, snapshot->snapshot_id, 5); });
  auto view = engine_->Freeze("", snapshot->snapshot_id);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ((*view)->spec.batch_size, 3u);
}

TEST_P(BatchTest, ConcurrentCallsOnTheSameCachesDoNotDeadlock) {
  const std::string a = NewCache(TinySpec({TinyStandard()}, {0}));
  const std::string b = NewCache(TinySpec({TinyStandard()}, {0}));
  Append(a, 3, 1);
  Append(b, 2, 2);
  const auto grow_and_shrink = [&](const std::string& self, const std::string& other) {
    for (int i = 0; i < 20; ++i) {
      EXPECT_TRUE(engine_->ExtendCache(self, other).ok());
      EXPECT_TRUE(engine_->FilterRows(self, {0}).ok());
    }
  };
  std::thread first(grow_and_shrink, a, b);
  std::thread second(grow_and_shrink, b, a);
  const std::vector<std::string> both = {a, b, a};
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<CacheInfo> merged = engine_->MergeCaches(both);
    ASSERT_TRUE(merged.ok()) << merged.status();
    EXPECT_TRUE(engine_->DeleteCache(merged->cache_id).ok());
  }
  first.join();
  second.join();
  ExpectRow(a, 0, {{0, 3}}, Expected(1, 0, 0, 3));
}

INSTANTIATE_TEST_SUITE_P(AllPaths, BatchTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
