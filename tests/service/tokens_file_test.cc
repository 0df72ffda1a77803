// The tokens file: what it accepts, how a bad line is refused (by number and
// field, never quoting a token), and finding a token's tenant.
#include "service/tokens_file.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kAliceToken[] = "alice-secret-token-0001";

TEST(TokensFileTest, ParsesTenantsQuotasAndDigests) {
  const std::string digest_hex =
      "2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b";  // sha256("secret")
  absl::StatusOr<std::vector<TenantConfig>> tenants = ParseTokensFile(
      absl::StrCat("# tenants\n\n", "tenant=alice token=", kAliceToken,
                   " max_pinned_bytes=1024 max_metadata_bytes=2048 max_requests_in_flight=3 "
                   "max_lane_connections=4 max_caches=5 max_snapshots=6 max_device_bytes=7 "
                   "max_host_bytes=8 max_disk_bytes=9 max_saved_bytes=10\n",
                   "  tenant=ops\tsha256=", digest_hex, " admin  \n"));
  ASSERT_TRUE(tenants.ok()) << tenants.status();
  ASSERT_EQ(tenants->size(), 2u);
  const TenantConfig& alice = (*tenants)[0];
  EXPECT_EQ(alice.name, "alice");
  EXPECT_FALSE(alice.admin);
  EXPECT_EQ(alice.token_digest, DigestToken(kAliceToken));
  EXPECT_EQ(alice.quotas.max_pinned_bytes, 1024u);
  EXPECT_EQ(alice.quotas.max_metadata_bytes, 2048u);
  EXPECT_EQ(alice.quotas.max_requests_in_flight, 3u);
  EXPECT_EQ(alice.quotas.max_lane_connections, 4u);
  EXPECT_EQ(alice.quotas.max_caches, 5u);
  EXPECT_EQ(alice.quotas.max_snapshots, 6u);
  EXPECT_EQ(alice.quotas.max_device_bytes, 7u);
  EXPECT_EQ(alice.quotas.max_host_bytes, 8u);
  EXPECT_EQ(alice.quotas.max_disk_bytes, 9u);
  EXPECT_EQ(alice.quotas.max_saved_bytes, 10u);
  const TenantConfig& ops = (*tenants)[1];
  EXPECT_TRUE(ops.admin);
  EXPECT_EQ(ops.token_digest, DigestToken("secret"));
  EXPECT_EQ(ops.quotas.max_requests_in_flight, 0u);
}

TEST(TokensFileTest, RefusesBadLinesByNumberWithoutQuotingTokens) {
  const std::string ok_line = absl::StrCat("tenant=alice token=", kAliceToken, "\n");
  const struct {
    std::string text;
    std::string names;
  } cases[] = {
      {"", "names no tenant"},
      {"tenant=bob token=tiny-secret\n", "line 1: token: shorter than 16"},
      {ok_line + "token=bob-secret-token-0002\n", "line 2: tenant: missing"},
      {ok_line + "tenant=bob\n", "line 2: needs exactly one of token= and sha256="},
      {ok_line + "tenant=bob token=bob-secret-token-0002 sha256=" + std::string(64, 'a') + "\n",
       "line 2: needs exactly one"},
      {ok_line + "tenant=alice token=bob-secret-token-0002\n",
       "line 2: tenant alice is named twice"},
      {ok_line + "tenant=bob token=" + kAliceToken + "\n", "line 2: token: another tenant"},
      {"tenant=a/b token=bob-secret-token-0002\n", "line 1: tenant: must be 1-64"},
      {"tenant=bob sha256=xyz\n", "line 1: sha256: must be 64 hex digits"},
      {"tenant=bob token=bob-secret-token-0002 max_pinned_bytes=-1\n", "line 1: max_pinned_bytes"},
      {"tenant=bob token=bob-secret-token-0002 max_requests_in_flight=4294967296\n",
       "line 1: max_requests_in_flight"},
      {"tenant=bob token=bob-secret-token-0002 colour=blue\n", "line 1: unknown key \"colour\""},
      {"tenant=bob token=bob-secret-token-0002 superuser\n", "line 1: \"superuser\" is not"},
  };
  for (const auto& [text, names] : cases) {
    SCOPED_TRACE(text);
    absl::StatusOr<std::vector<TenantConfig>> tenants = ParseTokensFile(text);
    ASSERT_FALSE(tenants.ok());
    EXPECT_EQ(tenants.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(tenants.status().message(), HasSubstr(names));
    EXPECT_THAT(tenants.status().message(), Not(HasSubstr("secret")));
  }
}

TEST(TokensFileTest, ReadingAMissingFileSaysWhich) {
  absl::StatusOr<std::vector<TenantConfig>> tenants = ReadTokensFile("/nonexistent/tokens");
  EXPECT_EQ(tenants.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tenants.status().message(), HasSubstr("/nonexistent/tokens"));
}

TEST(TokenDirectoryTest, FindsTheTenantOfExactlyItsToken) {
  absl::StatusOr<std::vector<TenantConfig>> tenants = ParseTokensFile(absl::StrCat(
      "tenant=alice token=", kAliceToken, "\ntenant=bob token=bob-secret-token-0002\n"));
  ASSERT_TRUE(tenants.ok());
  const TokenDirectory directory(*tenants);
  EXPECT_EQ(directory.Find(kAliceToken), 0);
  EXPECT_EQ(directory.Find("bob-secret-token-0002"), 1);
  EXPECT_EQ(directory.Find(""), -1);
  EXPECT_EQ(directory.Find("bob-secret-token-000"), -1);    // a prefix
  EXPECT_EQ(directory.Find("bob-secret-token-00022"), -1);  // longer
  EXPECT_EQ(directory.Find("Bob-secret-token-0002"), -1);
}

}  // namespace
}  // namespace kvcache
