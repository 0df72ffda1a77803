// The tokens file: what it accepts, how a bad line is refused (by number and
// field, never quoting a token), and finding a token's tenant.
#include "service/tokens_file.h"

#include <cstdint>
#include <limits>
#include <string>
#include <variant>

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

// The field a row of kTenantQuotaKeys sets, read from `quotas`.
uint64_t QuotaOf(const TenantQuotas& quotas, const TenantQuotaKey& key) {
  return std::visit([&](auto field) { return uint64_t{quotas.*field}; }, key.field);
}

// The largest count the row's field holds.
uint64_t LargestOf(const TenantQuotaKey& key) {
  return std::holds_alternative<uint32_t TenantQuotas::*>(key.field)
             ? std::numeric_limits<uint32_t>::max()
             : std::numeric_limits<uint64_t>::max();
}

// One more than that, in decimal.
std::string OnePastLargestOf(const TenantQuotaKey& key) {
  return std::holds_alternative<uint32_t TenantQuotas::*>(key.field)
             ? absl::StrCat(uint64_t{std::numeric_limits<uint32_t>::max()} + 1)
             : "18446744073709551616";
}

TEST(TokensFileTest, EveryQuotaKeySetsItsOwnFieldUpToItsLargestCount) {
  for (const TenantQuotaKey& key : kTenantQuotaKeys) {
    SCOPED_TRACE(key.name);
    const std::string line = absl::StrCat("tenant=bob token=bob-secret-token-0002 ", key.name, "=");
    absl::StatusOr<std::vector<TenantConfig>> largest =
        ParseTokensFile(absl::StrCat(line, LargestOf(key), "\n"));
    ASSERT_TRUE(largest.ok()) << largest.status();
    for (const TenantQuotaKey& other : kTenantQuotaKeys) {
      EXPECT_EQ(QuotaOf((*largest)[0].quotas, other), other.name == key.name ? LargestOf(key) : 0)
          << other.name;
    }
    absl::StatusOr<std::vector<TenantConfig>> past =
        ParseTokensFile(absl::StrCat(line, OnePastLargestOf(key), "\n"));
    ASSERT_FALSE(past.ok());
    EXPECT_THAT(past.status().message(),
                HasSubstr(absl::StrCat("line 1: ", key.name, ": \"", OnePastLargestOf(key),
                                       "\" is not a count in range")));
  }
}

TEST(TokensFileTest, AnUnknownKeyListsTheKnownOnes) {
  absl::StatusOr<std::vector<TenantConfig>> tenants =
      ParseTokensFile("tenant=bob token=bob-secret-token-0002 max_pinned=1\n");
  ASSERT_FALSE(tenants.ok());
  EXPECT_THAT(tenants.status().message(),
              HasSubstr("line 1: unknown key \"max_pinned\" (known: tenant, token, sha256, "));
  for (const TenantQuotaKey& key : kTenantQuotaKeys) {
    EXPECT_THAT(tenants.status().message(), HasSubstr(absl::StrCat(", ", key.name))) << key.name;
  }
}

TEST(TokensFileTest, AQuotaFieldIsNamedAsTheFileSpellsIt) {
  static_assert(TenantQuotaName(&TenantQuotas::max_host_bytes) == "max_host_bytes");
  EXPECT_EQ(TenantQuotaName(&TenantQuotas::max_pinned_bytes), "max_pinned_bytes");
  EXPECT_EQ(TenantQuotaName(&TenantQuotas::max_lane_connections), "max_lane_connections");
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
