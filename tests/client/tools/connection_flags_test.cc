// ClientOptions from the tools' connection flags: TLS only where asked for
// (--tls or a CA file), the PEM files' text read, and an unreadable file
// refused naming its flag.
#include "tools/connection_flags.h"

#include <stdlib.h>

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

// A file of `text` in the test's temporary directory; its path.
std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/", name);
  std::ofstream(path) << text;
  return path;
}

TEST(ConnectionFlagsTest, PlaintextKeepsTheAddressAndTokenAndReadsNoFile) {
  // Without TLS the client certificate is not read: a missing one is no error.
  absl::StatusOr<ClientOptions> options = ClientOptionsFrom(
      {.address = "10.0.0.1:50051", .token = "t0k3n", .tls_cert_file = "/nonexistent/cert.pem"});
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->address, "10.0.0.1:50051");
  EXPECT_EQ(options->token, "t0k3n");
  EXPECT_FALSE(options->tls);
  EXPECT_EQ(options->tls_client_cert_pem, "");
}

TEST(ConnectionFlagsTest, TlsReadsEachPemFileItNames) {
  const std::string ca = WriteFile("ca.pem", "CA PEM");
  const std::string cert = WriteFile("cert.pem", "CERT PEM");
  const std::string key = WriteFile("key.pem", "KEY PEM");
  const struct {
    const char* what;
    ConnectionFlags flags;
    bool tls;
    std::string ca_pem, cert_pem, key_pem;
  } cases[] = {
      {"--tls alone trusts the system's CAs", {.tls = true}, true, "", "", ""},
      {"a CA file implies TLS", {.tls_ca_file = ca}, true, "CA PEM", "", ""},
      {"mutual TLS",
       {.tls_ca_file = ca, .tls_cert_file = cert, .tls_key_file = key, .tls_server_name = "kv"},
       true,
       "CA PEM",
       "CERT PEM",
       "KEY PEM"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    absl::StatusOr<ClientOptions> options = ClientOptionsFrom(c.flags);
    ASSERT_TRUE(options.ok()) << options.status();
    EXPECT_EQ(options->tls, c.tls);
    EXPECT_EQ(options->tls_root_certs_pem, c.ca_pem);
    EXPECT_EQ(options->tls_client_cert_pem, c.cert_pem);
    EXPECT_EQ(options->tls_client_key_pem, c.key_pem);
    EXPECT_EQ(options->tls_server_name, c.flags.tls_server_name);
  }
}

TEST(ConnectionFlagsTest, AnUnreadablePemFileIsRefusedNamingItsFlag) {
  const std::string ca = WriteFile("ca.pem", "CA PEM");
  const std::string missing = "/nonexistent/file.pem";
  const struct {
    ConnectionFlags flags;
    const char* names;
  } cases[] = {
      {{.tls_ca_file = missing}, "--tls_ca: cannot read /nonexistent/file.pem"},
      {{.tls = true, .tls_cert_file = missing}, "--tls_cert: cannot read"},
      {{.tls_ca_file = ca, .tls_key_file = missing}, "--tls_key: cannot read"},
  };
  for (const auto& [flags, names] : cases) {
    SCOPED_TRACE(names);
    absl::StatusOr<ClientOptions> options = ClientOptionsFrom(flags);
    EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(options.status().message(), HasSubstr(names));
  }
}

TEST(ConnectionFlagsTest, TheEnvironmentFillsOnlyAnEmptyValue) {
  ASSERT_EQ(setenv("KVCACHE_CONNECTION_FLAGS_TEST", "from-env", 1), 0);
  EXPECT_EQ(OrEnvironment("from-flag", "KVCACHE_CONNECTION_FLAGS_TEST"), "from-flag");
  EXPECT_EQ(OrEnvironment("", "KVCACHE_CONNECTION_FLAGS_TEST"), "from-env");
  ASSERT_EQ(unsetenv("KVCACHE_CONNECTION_FLAGS_TEST"), 0);
  EXPECT_EQ(OrEnvironment("", "KVCACHE_CONNECTION_FLAGS_TEST"), "");
}

}  // namespace
}  // namespace kvcache
