// Quoted: what a status may echo of client input.
#include "core/client_text.h"

#include <string>

#include "gtest/gtest.h"

namespace kvcache {
namespace {

TEST(QuotedTest, ShortInputIsQuotedWhole) {
  EXPECT_EQ(Quoted("0123abcd"), "\"0123abcd\"");
  EXPECT_EQ(Quoted(""), "\"\"");
  EXPECT_EQ(Quoted(std::string(kMaxQuotedBytes, 'a')),
            "\"" + std::string(kMaxQuotedBytes, 'a') + "\"");
}

TEST(QuotedTest, LongInputIsCutAndCounted) {
  const std::string quoted = Quoted(std::string(200 << 10, 'x'));
  EXPECT_EQ(quoted, "\"" + std::string(kMaxQuotedBytes, 'x') + "…\" (204800 bytes)");
}

TEST(QuotedTest, BytesThatAreNotTextAreEscaped) {
  EXPECT_EQ(Quoted(std::string("a\0\xff\"\n", 5)), "\"a\\x00\\xff\\\"\\n\"");
}

}  // namespace
}  // namespace kvcache
