#include "gtest/gtest.h"
#include "core/log.h"

namespace kvcache {
namespace {

TEST(LogLimiterTest, LetsTheFirstLinesOfAPeriodThroughAndCountsTheRest) {
  LogLimiter limiter(3, absl::Seconds(10));
  const absl::Time start = absl::FromUnixSeconds(1000);
  uint64_t held_back = 99;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(limiter.Allow(start + absl::Seconds(i), held_back));
    EXPECT_EQ(held_back, 0u);
  }
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(limiter.Allow(start + absl::Seconds(9), held_back));
  // A new period: the first line says how many were held back.
  ASSERT_TRUE(limiter.Allow(start + absl::Seconds(10), held_back));
  EXPECT_EQ(held_back, 5u);
  ASSERT_TRUE(limiter.Allow(start + absl::Seconds(11), held_back));
  EXPECT_EQ(held_back, 0u);
}

}  // namespace
}  // namespace kvcache
