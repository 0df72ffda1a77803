// The request log on its own: a retried request is answered from it, never
// run twice while it is kept; a different request with the same id, or a
// retry while the first still runs, is refused; failures are not kept; the
// window and the byte bound drop the oldest answers first.
#include "service/request_log.h"

#include <atomic>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::service {
namespace {

using ::testing::HasSubstr;

constexpr absl::Time kStart = absl::FromUnixSeconds(1'000'000);

// Begin, expecting "run it".
void ExpectRun(RequestLog& log, const std::string& id, uint64_t fingerprint = 1,
               absl::Time now = kStart) {
  const absl::StatusOr<std::optional<std::string>> claim =
      log.Begin(id, "CreateCache", fingerprint, now);
  ASSERT_TRUE(claim.ok()) << claim.status();
  EXPECT_FALSE(claim->has_value()) << "replayed " << **claim;
}

// Begin, expecting the kept answer `response`.
void ExpectReplay(RequestLog& log, const std::string& id, const std::string& response,
                  absl::Time now = kStart) {
  const absl::StatusOr<std::optional<std::string>> claim = log.Begin(id, "CreateCache", 1, now);
  ASSERT_TRUE(claim.ok()) << claim.status();
  ASSERT_TRUE(claim->has_value());
  EXPECT_EQ(**claim, response);
}

TEST(RequestLogTest, ARetryGetsTheFirstAnswer) {
  RequestLog log({});
  ExpectRun(log, "a");
  log.Finish("a", true, "answer of a", kStart);
  ExpectReplay(log, "a", "answer of a");
  ExpectReplay(log, "a", "answer of a", kStart + absl::Minutes(9));
  ExpectRun(log, "b");
  const RequestLogCounts counts = log.Counts(kStart);
  EXPECT_EQ(counts.entries, 1u);  // b still runs
  EXPECT_EQ(counts.replayed, 2u);
  EXPECT_GT(counts.bytes, std::string("answer of a").size());
}

TEST(RequestLogTest, TheSameIdOnAnotherRequestIsRefusedNamingIt) {
  RequestLog log({});
  ExpectRun(log, "a", /*fingerprint=*/1);
  log.Finish("a", true, "answer", kStart);
  const auto other_request = log.Begin("a", "CreateCache", /*fingerprint=*/2, kStart);
  EXPECT_EQ(other_request.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(other_request.status().message(), HasSubstr("request_id"));
  const auto other_method = log.Begin("a", "Trim", 1, kStart);
  EXPECT_EQ(other_method.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(other_method.status().message(), HasSubstr("CreateCache"));
  ExpectReplay(log, "a", "answer");  // the refusals changed nothing
}

TEST(RequestLogTest, ARetryWhileTheFirstRunsIsToldToRetry) {
  RequestLog log({});
  ExpectRun(log, "a");
  const auto again = log.Begin("a", "CreateCache", 1, kStart);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(again.status().message(), HasSubstr("request_id"));
  log.Finish("a", true, "answer", kStart);
  ExpectReplay(log, "a", "answer");
}

TEST(RequestLogTest, AFailureIsNotKeptSoTheRetryRunsAgain) {
  RequestLog log({});
  ExpectRun(log, "a");
  log.Finish("a", false, "", kStart);
  EXPECT_EQ(log.Counts(kStart).entries, 0u);
  ExpectRun(log, "a");  // and may now be another request
  log.Finish("a", true, "second", kStart);
  ExpectReplay(log, "a", "second");
}

TEST(RequestLogTest, AnswersGoWhenTheWindowEnds) {
  RequestLog log({.window = absl::Minutes(1)});
  ExpectRun(log, "old");
  log.Finish("old", true, "x", kStart);
  ExpectRun(log, "new", 1, kStart + absl::Seconds(30));
  log.Finish("new", true, "y", kStart + absl::Seconds(30));
  ExpectReplay(log, "old", "x", kStart + absl::Seconds(59));
  ExpectRun(log, "old", 1, kStart + absl::Seconds(60));  // forgotten: runs again
  ExpectReplay(log, "new", "y", kStart + absl::Seconds(60));
  EXPECT_EQ(log.Counts(kStart + absl::Seconds(90)).entries, 0u);
  EXPECT_EQ(log.Counts(kStart + absl::Seconds(90)).bytes, 0u);
}

TEST(RequestLogTest, TheByteBoundDropsTheOldestFirst) {
  RequestLog log({.max_bytes = 2000});
  const std::string answer(400, 'r');
  for (int i = 0; i < 10; ++i) {
    ExpectRun(log, absl::StrCat("id", i));
    log.Finish(absl::StrCat("id", i), true, answer, kStart + absl::Seconds(i));
  }
  const RequestLogCounts counts = log.Counts(kStart + absl::Seconds(10));
  EXPECT_LE(counts.bytes, 2000u);
  EXPECT_GE(counts.entries, 3u);
  EXPECT_LT(counts.entries, 10u);
  ExpectReplay(log, "id9", answer, kStart + absl::Seconds(10));
  ExpectRun(log, "id0", 1, kStart + absl::Seconds(10));
}

TEST(RequestLogTest, AnAnswerLargerThanTheBoundIsNotKept) {
  RequestLog log({.max_bytes = 1000});
  ExpectRun(log, "small");
  log.Finish("small", true, "s", kStart);
  ExpectRun(log, "huge");
  log.Finish("huge", true, std::string(5000, 'h'), kStart);
  ExpectRun(log, "huge");  // runs again rather than evicting everything
  ExpectReplay(log, "small", "s");
}

TEST(RequestLogTest, OfManyThreadsSendingOneIdAtOnceOneRuns) {
  RequestLog log({});
  std::atomic<int> ran{0}, told_to_retry{0}, replayed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        const std::string id = absl::StrCat("id", i);
        const auto claim = log.Begin(id, "CreateCache", 1, kStart);
        if (!claim.ok()) {
          EXPECT_EQ(claim.status().code(), absl::StatusCode::kUnavailable);
          ++told_to_retry;
        } else if (claim->has_value()) {
          EXPECT_EQ(**claim, id);
          ++replayed;
        } else {
          ++ran;
          log.Finish(id, true, id, kStart);
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(ran.load(), 200);
  EXPECT_EQ(ran + told_to_retry + replayed, 8 * 200);
  EXPECT_EQ(log.Counts(kStart).entries, 200u);
}

TEST(RequestLogTest, LimitsAreChecked) {
  EXPECT_TRUE(RequestLogLimits{}.Validate().ok());
  const absl::Status no_window = RequestLogLimits{.window = absl::ZeroDuration()}.Validate();
  EXPECT_EQ(no_window.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_window.message(), HasSubstr("request_log_window"));
  const absl::Status no_bytes = RequestLogLimits{.max_bytes = 0}.Validate();
  EXPECT_EQ(no_bytes.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_bytes.message(), HasSubstr("request_log_bytes"));
}

}  // namespace
}  // namespace kvcache::service
