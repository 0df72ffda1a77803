// CURVE keys in files (wire/curve/curve_keys.h): a written secret key is private
// and reads back with its public key; loose permissions, malformed keys and
// empty allow-lists are refused, naming the flag (and the line).
#include "wire/curve/curve_keys.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::curve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class CurveKeysTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("curve_keys_test_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& text, mode_t mode) {
    const std::string path = dir_ / name;
    std::ofstream(path) << text;
    chmod(path.c_str(), mode);
    return path;
  }

  std::filesystem::path dir_;
};

TEST_F(CurveKeysTest, AWrittenSecretKeyIsPrivateAndReadsBackWithItsPublicKey) {
  absl::StatusOr<KeyPair> pair = NewKeyPair();
  ASSERT_TRUE(pair.ok()) << pair.status();
  EXPECT_TRUE(CheckKey(pair->public_key, "public").ok());
  const std::optional<std::string> bytes = DecodeKey(pair->public_key);
  ASSERT_TRUE(bytes.has_value());
  EXPECT_EQ(bytes->size(), 32u);
  EXPECT_EQ(EncodeKey(*bytes), pair->public_key);
  EXPECT_FALSE(DecodeKey(pair->public_key.substr(1)).has_value());
  EXPECT_NE(pair->public_key, pair->secret_key);
  const std::string path = dir_ / "secret";
  ASSERT_TRUE(WriteSecretKeyFile(path, pair->secret_key).ok());
  struct stat info;
  ASSERT_EQ(stat(path.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600u);
  EXPECT_EQ(WriteSecretKeyFile(path, pair->secret_key).code(), absl::StatusCode::kAlreadyExists)
      << "an existing key is never replaced";

  absl::StatusOr<KeyPair> read = ReadSecretKeyFile(path, "--key");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->secret_key, pair->secret_key);
  EXPECT_EQ(read->public_key, pair->public_key);
}

TEST_F(CurveKeysTest, SecretKeysOpenToOthersOrMalformedAreRefused) {
  const std::string key = NewKeyPair()->secret_key;
  const auto refused = [](const std::string& path, const std::string& why) {
    absl::StatusOr<KeyPair> read = ReadSecretKeyFile(path, "--key");
    ASSERT_FALSE(read.ok());
    EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(read.status().message(), HasSubstr("--key"));
    EXPECT_THAT(read.status().message(), HasSubstr(why));
  };
  refused(Write("group", key, 0640), "chmod 600");
  refused(Write("short", key.substr(1), 0600), "not a CURVE key");
  refused(Write("not-z85", std::string(40, '"'), 0600), "not a CURVE key");
  refused((dir_ / "missing").string(), "cannot be opened");
  const std::string target = Write("target", key, 0600);
  std::filesystem::create_symlink(target, dir_ / "link");
  refused((dir_ / "link").string(), "cannot be opened");  // a link is not followed
  refused(dir_.string(), "not a regular file");
  EXPECT_TRUE(ReadSecretKeyFile(Write("spaced", "\n  " + key + " \n", 0600), "--key").ok());
}

TEST_F(CurveKeysTest, AllowListsSkipCommentsAndNameABadLine) {
  const std::string a = NewKeyPair()->public_key;
  const std::string b = NewKeyPair()->public_key;
  absl::StatusOr<std::vector<std::string>> keys =
      ReadPublicKeysFile(Write("list", "# routers\n" + a + "\n\n  " + b + "  \n", 0644), "--list");
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_THAT(*keys, ElementsAre(a, b));

  absl::StatusOr<std::vector<std::string>> bad =
      ReadPublicKeysFile(Write("bad", a + "\nnot-a-key\n", 0644), "--list");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("--list line 2"));
  absl::StatusOr<std::vector<std::string>> writable =
      ReadPublicKeysFile(Write("writable", a + "\n", 0666), "--list");
  ASSERT_FALSE(writable.ok());
  EXPECT_THAT(writable.status().message(), HasSubstr("written by other users"));
  absl::StatusOr<std::vector<std::string>> none =
      ReadPublicKeysFile(Write("none", "# nobody yet\n", 0644), "--list");
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(), HasSubstr("lists no key"));
}

}  // namespace
}  // namespace kvcache::curve
