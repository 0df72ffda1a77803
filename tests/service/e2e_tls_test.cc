// TLS on the gRPC port (server/transport_security.h) with certificates the
// test makes with Debian's openssl (never committed keys): a client that
// trusts the CA works, over a stream too; one that trusts another CA, or
// speaks plaintext, gets nothing; mutual TLS refuses a client without a
// certificate; the plaintext data lane is off beside TLS unless allowed, and
// refuses a non-loopback address unless allowed.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;

std::string ReadText(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class E2eTlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::filesystem::path(std::filesystem::path(::testing::TempDir()) /
                                     ("kvcached-tls-" + std::to_string(std::random_device()())));
    std::filesystem::create_directories(*dir_);
    // Two CAs; a server certificate for 127.0.0.1 and a client one, by the first.
    const std::string script = absl::StrCat(
        "set -e; cd '", dir_->string(), "'\n",
        "key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out $1; }\n",
        "for ca in ca other_ca; do key $ca.key; openssl req -x509 -new -key $ca.key -days 1 "
        "-subj \"/CN=$ca\" -out $ca.pem; done\n",
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > server.ext\n",
        "printf 'extendedKeyUsage=clientAuth\\n' > client.ext\n",
        "for who in server client; do key $who.key; openssl req -new -key $who.key "
        "-subj \"/CN=$who\" -out $who.csr; openssl x509 -req -in $who.csr -CA ca.pem -CAkey "
        "ca.key -CAcreateserial -days 1 -extfile $who.ext -out $who.pem; done\n");
    std::ofstream(*dir_ / "make.sh") << script;
    made_ = std::system(
                absl::StrCat("bash '", (*dir_ / "make.sh").string(), "' 2>/dev/null").c_str()) == 0;
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  void SetUp() override { ASSERT_TRUE(made_) << "openssl could not make the test certificates"; }
  void TearDown() override {
    if (server_ != nullptr) server_->CleanUpAndCheck();
    server_.reset();
  }

  static std::string File(const std::string& name) { return (*dir_ / name).string(); }
  static ClientOptions Trusting(const std::string& ca) {
    ClientOptions options;
    options.tls = true;
    options.tls_root_certs_pem = ReadText(*dir_ / ca);
    return options;
  }
  static TlsConfig ServerTls(bool mutual) {
    return {.cert_file = File("server.pem"),
            .key_file = File("server.key"),
            .client_ca_file = mutual ? File("ca.pem") : ""};
  }
  // What a client of `options` gets from the server: OK or why not.
  absl::Status Try(ClientOptions options) {
    options.address = server_->server().address();
    options.deadline = absl::Seconds(5);
    options.dedicated_connection = true;
    return Client::Connect(options)->ListCaches().status();
  }

  static std::filesystem::path* dir_;
  static bool made_;
  std::unique_ptr<TestServer> server_;
};

std::filesystem::path* E2eTlsTest::dir_ = nullptr;
bool E2eTlsTest::made_ = false;

TEST_F(E2eTlsTest, ClientsThatTrustTheCaWorkAndOthersGetNothing) {
  server_ = TestServer::Start({.tls = ServerTls(false), .client_tls = Trusting("ca.pem")});
  ASSERT_NE(server_, nullptr);
  // A whole step over TLS: an Update stream, a Fetch stream.
  const engine::CacheSpec spec = MakeSpec({StandardLayerSpec(2, 8), StandardLayerSpec(2, 8)});
  absl::StatusOr<v1::CacheInfo> cache = server_->client().CreateCache(ToWireSpec(spec));
  ASSERT_TRUE(cache.ok()) << cache.status();
  RefCache reference(spec);
  std::mt19937_64 rng(3);
  ASSERT_TRUE(StepBoth(server_->client(), cache->cache_id(), reference, 40, rng).ok());
  EXPECT_TRUE(CacheMatchesReference(server_->client(), cache->cache_id(), reference));

  const absl::Status other_ca = Try(Trusting("other_ca.pem"));
  EXPECT_EQ(other_ca.code(), absl::StatusCode::kUnavailable) << other_ca;
  const absl::Status plaintext = Try(ClientOptions{});
  EXPECT_EQ(plaintext.code(), absl::StatusCode::kUnavailable) << plaintext;
  // The plaintext lane is off beside TLS: Update and Fetch stay on gRPC.
  absl::StatusOr<v1::Stats> stats = server_->client().GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->data_lane_address(), "");
}

TEST_F(E2eTlsTest, MutualTlsRefusesClientsWithoutACertificateOfTheCa) {
  ClientOptions with_cert = Trusting("ca.pem");
  with_cert.tls_client_cert_pem = ReadText(*dir_ / "client.pem");
  with_cert.tls_client_key_pem = ReadText(*dir_ / "client.key");
  server_ = TestServer::Start({.tls = ServerTls(true), .client_tls = with_cert});
  ASSERT_NE(server_, nullptr);
  EXPECT_TRUE(Try(with_cert).ok());
  const absl::Status without = Try(Trusting("ca.pem"));
  EXPECT_EQ(without.code(), absl::StatusCode::kUnavailable) << without;
  // A certificate its own CA signed (the server's, presented as a client's)
  // is of the right CA; one signed by no CA the server trusts is not.
  ClientOptions self_signed = Trusting("ca.pem");
  self_signed.tls_client_cert_pem = ReadText(*dir_ / "other_ca.pem");
  self_signed.tls_client_key_pem = ReadText(*dir_ / "other_ca.key");
  const absl::Status foreign = Try(self_signed);
  EXPECT_EQ(foreign.code(), absl::StatusCode::kUnavailable) << foreign;
}

TEST_F(E2eTlsTest, ThePlaintextLaneNeedsAnExplicitFlag) {
  server_ = TestServer::Start(
      {.tls = ServerTls(false), .allow_plaintext_lane = true, .client_tls = Trusting("ca.pem")});
  ASSERT_NE(server_, nullptr);
  EXPECT_NE(server_->server().data_lane_address(), "") << "allowed, the lane is on beside TLS";

  ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.data_lane_listen = "0.0.0.0:0";
  config.pool.budget_bytes = 4 << 20;
  absl::StatusOr<std::unique_ptr<KvCacheServer>> refused = KvCacheServer::Start(config);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("data_lane_listen"));
  EXPECT_THAT(refused.status().message(), HasSubstr("allow_plaintext_lane"));

  config.data_lane_listen = "127.0.0.1:0";
  config.tls = {.cert_file = File("missing.pem"), .key_file = File("server.key")};
  absl::StatusOr<std::unique_ptr<KvCacheServer>> unreadable = KvCacheServer::Start(config);
  ASSERT_FALSE(unreadable.ok());
  EXPECT_EQ(unreadable.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unreadable.status().message(), HasSubstr("tls_cert"));
}

}  // namespace
}  // namespace kvcache::testing
