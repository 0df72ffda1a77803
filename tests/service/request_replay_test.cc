// Requests sent again with their request_id, through Handlers::Answer (the
// path every unary gRPC call takes), without a network: each kind of change
// happens once however often it is sent, the retry gets the first answer, and
// ids that are misused are refused naming request_id with nothing changed.
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "handlers_test_base.h"
#include "service/convert.h"
#include "service_test_util.h"

namespace kvcache::testing {
namespace {

using Code = absl::StatusCode;
using service::Handlers;

class RequestReplayTest : public HandlersTestBase {
 protected:
  void SetUp() override {
    HandlersTestBase::SetUp();
    if (HasFatalFailure()) return;
    cache_ = Create(reference_.spec());
    ASSERT_TRUE(Step(cache_, reference_, 10));
  }

  // Handlers::Answer, as the service calls it.
  template <typename Request, typename Response>
  absl::Status Send(absl::Status (Handlers::*handler)(const Request&, Response*),
                    const char* method, const Request& request, Response* response) {
    return handlers_->Answer(handler, method, request, response);
  }

  v1::CreateCacheRequest CreateRequest(const std::string& request_id) {
    v1::CreateCacheRequest request;
    service::ToProto(reference_.spec(), request.mutable_spec());
    request.set_request_id(request_id);
    return request;
  }

  uint64_t OffsetOf(const std::string& id) {
    absl::StatusOr<engine::CacheInfo> info = engine_->GetCache(id);
    return info.ok() ? info->offset : ~0ull;
  }

  RefCache reference_{MakeSpec({StandardLayerSpec(2, 8), StandardLayerSpec(2, 8)})};
  std::string cache_;
};

TEST_P(RequestReplayTest, ACreateSentTwiceMakesOneCache) {
  const v1::CreateCacheRequest request = CreateRequest("create-1");
  v1::CacheInfo first, second;
  ASSERT_TRUE(Send(&Handlers::CreateCache, "CreateCache", request, &first).ok());
  ASSERT_TRUE(Send(&Handlers::CreateCache, "CreateCache", request, &second).ok());
  EXPECT_EQ(second.SerializeAsString(), first.SerializeAsString());
  EXPECT_EQ(engine_->ListCaches().size(), 2u);  // cache_ and one more
  v1::Stats stats;
  ASSERT_TRUE(handlers_->GetStats({}, &stats).ok());
  EXPECT_EQ(stats.requests_replayed(), 1u);
  EXPECT_EQ(stats.request_log_entries(), 1u);
  EXPECT_GT(stats.request_log_bytes(), 0u);
  ASSERT_TRUE(engine_->DeleteCache(first.cache_id()).ok());
}

TEST_P(RequestReplayTest, WithoutAnIdEachCreateMakesACache) {
  const v1::CreateCacheRequest request = CreateRequest("");
  v1::CacheInfo first, second;
  ASSERT_TRUE(Send(&Handlers::CreateCache, "CreateCache", request, &first).ok());
  ASSERT_TRUE(Send(&Handlers::CreateCache, "CreateCache", request, &second).ok());
  EXPECT_NE(first.cache_id(), second.cache_id());
  ASSERT_TRUE(engine_->DeleteCache(first.cache_id()).ok());
  ASSERT_TRUE(engine_->DeleteCache(second.cache_id()).ok());
}

TEST_P(RequestReplayTest, ATrimSentThreeTimesDropsItsTokensOnce) {
  v1::TrimRequest request;
  request.set_cache_id(cache_);
  request.set_n(3);
  request.set_request_id("trim-1");
  for (int attempt = 0; attempt < 3; ++attempt) {
    v1::TrimResponse response;
    ASSERT_TRUE(Send(&Handlers::Trim, "Trim", request, &response).ok());
    EXPECT_EQ(response.trimmed(), 3u);
    EXPECT_EQ(response.cache().offset(), 7u);
  }
  EXPECT_EQ(OffsetOf(cache_), 7u);
  // A new id is a new trim.
  request.set_request_id("trim-2");
  v1::TrimResponse response;
  ASSERT_TRUE(Send(&Handlers::Trim, "Trim", request, &response).ok());
  EXPECT_EQ(OffsetOf(cache_), 4u);
}

TEST_P(RequestReplayTest, ConsumingCallsAnswerTheirRetryInsteadOfNotFound) {
  v1::SnapshotRequest take;
  take.set_cache_id(cache_);
  take.set_request_id("snap-a");
  v1::SnapshotInfo a, a_again;
  ASSERT_TRUE(Send(&Handlers::Snapshot, "Snapshot", take, &a).ok());
  ASSERT_TRUE(Send(&Handlers::Snapshot, "Snapshot", take, &a_again).ok());
  EXPECT_EQ(a_again.snapshot_id(), a.snapshot_id());
  EXPECT_EQ(engine_->ListSnapshots("").size(), 1u);

  v1::SplitSnapshotRequest split;
  split.set_snapshot_id(a.snapshot_id());
  split.set_at(4);
  split.set_request_id("split-a");
  v1::SplitSnapshotResponse parts, parts_again;
  ASSERT_TRUE(Send(&Handlers::SplitSnapshot, "SplitSnapshot", split, &parts).ok());
  ASSERT_TRUE(Send(&Handlers::SplitSnapshot, "SplitSnapshot", split, &parts_again).ok());
  EXPECT_EQ(parts_again.SerializeAsString(), parts.SerializeAsString());

  v1::MergeSnapshotsRequest merge;
  merge.set_parent_id(parts.parent().snapshot_id());
  merge.set_child_id(parts.child().snapshot_id());
  merge.set_request_id("merge-a");
  v1::SnapshotInfo merged, merged_again;
  ASSERT_TRUE(Send(&Handlers::MergeSnapshots, "MergeSnapshots", merge, &merged).ok());
  ASSERT_TRUE(Send(&Handlers::MergeSnapshots, "MergeSnapshots", merge, &merged_again).ok());
  EXPECT_EQ(merged_again.snapshot_id(), merged.snapshot_id());
  EXPECT_EQ(engine_->ListSnapshots("").size(), 1u);

  v1::ReleaseSnapshotRequest release;
  release.set_snapshot_id(merged.snapshot_id());
  release.set_request_id("release-a");
  v1::ReleaseSnapshotResponse released;
  ASSERT_TRUE(Send(&Handlers::ReleaseSnapshot, "ReleaseSnapshot", release, &released).ok());
  EXPECT_TRUE(Send(&Handlers::ReleaseSnapshot, "ReleaseSnapshot", release, &released).ok());
  EXPECT_TRUE(engine_->ListSnapshots("").empty());
  // Without an id the second release is what it always was.
  release.clear_request_id();
  EXPECT_EQ(Send(&Handlers::ReleaseSnapshot, "ReleaseSnapshot", release, &released).code(),
            Code::kNotFound);
}

TEST_P(RequestReplayTest, ASpeculationIsBegunAndCommittedOnce) {
  v1::BeginSpeculationRequest begin;
  begin.set_cache_id(cache_);
  begin.set_request_id("begin-1");
  v1::BeginSpeculationResponse begun, begun_again;
  ASSERT_TRUE(Send(&Handlers::BeginSpeculation, "BeginSpeculation", begin, &begun).ok());
  ASSERT_TRUE(Send(&Handlers::BeginSpeculation, "BeginSpeculation", begin, &begun_again).ok());
  EXPECT_EQ(begun_again.speculation_id(), begun.speculation_id());
  v1::AbortSpeculationRequest abort;
  abort.set_speculation_id(begun.speculation_id());
  abort.set_request_id("abort-1");
  v1::CacheInfo aborted, aborted_again;
  ASSERT_TRUE(Send(&Handlers::AbortSpeculation, "AbortSpeculation", abort, &aborted).ok());
  ASSERT_TRUE(Send(&Handlers::AbortSpeculation, "AbortSpeculation", abort, &aborted_again).ok());
  EXPECT_EQ(aborted_again.SerializeAsString(), aborted.SerializeAsString());
  EXPECT_EQ(engine_->GetSpeculation(begun.speculation_id(), "").status().code(),
            Code::kNotFound);
}

TEST_P(RequestReplayTest, ADeleteAndACommitAnswerTheirRetryAsTheFirstTime) {
  v1::CacheInfo scratch;
  ASSERT_TRUE(handlers_->CreateCache(CreateRequest(""), &scratch).ok());
  v1::DeleteCacheRequest remove;
  remove.set_cache_id(scratch.cache_id());
  remove.set_request_id("delete-1");
  v1::DeleteCacheResponse removed;
  ASSERT_TRUE(Send(&Handlers::DeleteCache, "DeleteCache", remove, &removed).ok());
  EXPECT_TRUE(Send(&Handlers::DeleteCache, "DeleteCache", remove, &removed).ok());
  EXPECT_EQ(engine_->GetCache(scratch.cache_id()).status().code(), Code::kNotFound);

  v1::BeginSpeculationRequest begin;
  begin.set_cache_id(cache_);
  v1::BeginSpeculationResponse begun;
  ASSERT_TRUE(handlers_->BeginSpeculation(begin, &begun).ok());
  v1::CommitSpeculationRequest commit;
  commit.set_speculation_id(begun.speculation_id());
  commit.set_accepted(0);
  commit.set_request_id("commit-1");
  v1::CacheInfo committed, committed_again;
  ASSERT_TRUE(Send(&Handlers::CommitSpeculation, "CommitSpeculation", commit, &committed).ok());
  ASSERT_TRUE(
      Send(&Handlers::CommitSpeculation, "CommitSpeculation", commit, &committed_again).ok());
  EXPECT_EQ(committed_again.SerializeAsString(), committed.SerializeAsString());
  EXPECT_EQ(OffsetOf(cache_), 10u);
}

TEST_P(RequestReplayTest, ARetriedPublishAnswersAsTheFirstDidNotAsAlreadyPublished) {
  v1::SnapshotRequest take;
  take.set_cache_id(cache_);
  v1::SnapshotInfo snapshot;
  ASSERT_TRUE(handlers_->Snapshot(take, &snapshot).ok());
  v1::PublishPrefixRequest publish;
  publish.set_snapshot_id(snapshot.snapshot_id());
  for (uint32_t token = 0; token < 10; ++token) publish.add_tokens(100 + token);
  publish.set_request_id("publish-1");
  v1::PublishPrefixResponse first, second;
  ASSERT_TRUE(Send(&Handlers::PublishPrefix, "PublishPrefix", publish, &first).ok());
  ASSERT_TRUE(Send(&Handlers::PublishPrefix, "PublishPrefix", publish, &second).ok());
  EXPECT_FALSE(first.already_published());
  EXPECT_EQ(second.SerializeAsString(), first.SerializeAsString());
  // The same publish under a new id is a new call, and finds its own entry.
  publish.set_request_id("publish-2");
  v1::PublishPrefixResponse third;
  ASSERT_TRUE(Send(&Handlers::PublishPrefix, "PublishPrefix", publish, &third).ok());
  EXPECT_TRUE(third.already_published());
}

TEST_P(RequestReplayTest, AnIdReusedForAnotherRequestIsRefusedAndChangesNothing) {
  v1::TrimRequest trim;
  trim.set_cache_id(cache_);
  trim.set_n(2);
  trim.set_request_id("reused");
  v1::TrimResponse trimmed;
  ASSERT_TRUE(Send(&Handlers::Trim, "Trim", trim, &trimmed).ok());
  trim.set_n(5);
  ExpectRefused(Code::kInvalidArgument, "request_id",
                [&] { return Send(&Handlers::Trim, "Trim", trim, &trimmed); });
  const v1::CreateCacheRequest create = CreateRequest("reused");
  v1::CacheInfo info;
  ExpectRefused(Code::kInvalidArgument, "request_id",
                [&] { return Send(&Handlers::CreateCache, "CreateCache", create, &info); });
  EXPECT_EQ(OffsetOf(cache_), 8u);
}

TEST_P(RequestReplayTest, ALongIdIsRefusedBeforeAnythingRuns) {
  const v1::CreateCacheRequest create = CreateRequest(std::string(129, 'x'));
  v1::CacheInfo info;
  ExpectRefused(Code::kInvalidArgument, "request_id",
                [&] { return Send(&Handlers::CreateCache, "CreateCache", create, &info); });
  EXPECT_EQ(engine_->ListCaches().size(), 1u);
}

TEST_P(RequestReplayTest, AFailedRequestRunsAgainWhenSentAgain) {
  v1::TrimRequest trim;
  trim.set_cache_id("0123456789abcdef0123456789abcdef");
  trim.set_n(1);
  trim.set_request_id("fails-first");
  v1::TrimResponse response;
  EXPECT_EQ(Send(&Handlers::Trim, "Trim", trim, &response).code(), Code::kNotFound);
  // The id was not kept: the corrected request under it runs.
  trim.set_cache_id(cache_);
  ASSERT_TRUE(Send(&Handlers::Trim, "Trim", trim, &response).ok());
  EXPECT_EQ(OffsetOf(cache_), 9u);
}

INSTANTIATE_TEST_SUITE_P(AllPaths, RequestReplayTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
