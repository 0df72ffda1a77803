// mlx-lm BatchRotatingKVCache meta_state: written as Python's str() writes it,
// read back strictly, and "False" read as false (mlx-lm's bool("False") is True).
#include "engine/files/mlx_batch_meta.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvcache::engine {
namespace {

TEST(MlxBatchMetaTest, RotatedFalseReadsBackAsFalse) {
  absl::StatusOr<BatchRotatingMeta> meta =
      ParseBatchRotatingMetaState(std::vector<std::string>{"8", "12", "4", "False"});
  ASSERT_TRUE(meta.ok()) << meta.status();
  EXPECT_FALSE(meta->rotated);
  EXPECT_EQ(*meta, (BatchRotatingMeta{.max_size = 8, .offset = 12, .idx = 4, .rotated = false}));
}

TEST(MlxBatchMetaTest, RoundTripsBothValuesOfRotated) {
  for (bool rotated : {false, true}) {
    const BatchRotatingMeta meta{.max_size = 4096, .offset = 70000, .idx = 17, .rotated = rotated};
    const std::vector<std::string> written = BatchRotatingMetaState(meta);
    EXPECT_EQ(written[3], rotated ? "True" : "False");
    absl::StatusOr<BatchRotatingMeta> read = ParseBatchRotatingMetaState(written);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, meta);
  }
}

TEST(MlxBatchMetaTest, RefusesWhatPythonWouldNotHaveWritten) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"8", "12", "4", "false"}, "meta_state[3]"},
      {{"8", "12", "4", ""}, "meta_state[3]"},
      {{"8", "12", "4", "0"}, "meta_state[3]"},
      {{"8", "-1", "4", "True"}, "meta_state[1]"},
      {{"8", "12", " 4", "True"}, "meta_state[2]"},
      {{"eight", "12", "4", "True"}, "meta_state[0]"},
      {{"8", "99999999999999999999999", "4", "True"}, "meta_state[1]"},
      {{"8", "12", "4"}, "meta_state"},
  };
  for (const auto& [meta_state, field] : cases) {
    absl::StatusOr<BatchRotatingMeta> meta = ParseBatchRotatingMetaState(meta_state);
    EXPECT_EQ(meta.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(meta.status().message().find(field), absl::string_view::npos) << meta.status();
  }
  EXPECT_FALSE(ParsePythonBool("1").ok());
  EXPECT_TRUE(*ParsePythonBool("True"));
  EXPECT_FALSE(*ParsePythonBool("False"));
}

}  // namespace
}  // namespace kvcache::engine
