// TLS on the gRPC port and the data lane (server/transport_security.h,
// protos/lane/tls.h) with certificates the test makes with Debian's openssl
// (never committed keys): a client that trusts the CA works, over streams
// and over the lane; one that trusts another CA, or speaks plaintext, gets
// nothing on either; mutual TLS refuses a client without a certificate of
// the CA on both; a plaintext lane refuses a non-loopback address unless
// allowed, a TLS one takes it.
#include <sys/socket.h>

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
#include "lane/socket.h"

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
  // The lane runs TLS beside it.
  absl::StatusOr<v1::Stats> stats = server_->client().GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_NE(stats->data_lane_address(), "");
}

TEST_F(E2eTlsTest, TheLaneRunsTlsAndRefusesWhomGrpcRefuses) {
  server_ = TestServer::Start({.tls = ServerTls(false), .client_tls = Trusting("ca.pem")});
  ASSERT_NE(server_, nullptr);
  std::unique_ptr<Client> on_lane = server_->Connect(/*dedicated=*/true, "auto");
  ASSERT_TRUE(on_lane->uses_data_lane()) << "a client that trusts the CA takes the TLS lane";
  // Enough steps, of pages larger than a TLS record, that every frame size
  // the lane makes crosses records: Update frames gathered into records,
  // Fetch chunks split across many.
  const engine::CacheSpec spec =
      MakeSpec({StandardLayerSpec(4, 64), StandardLayerSpec(2, 128), StandardLayerSpec(1, 8)});
  absl::StatusOr<v1::CacheInfo> cache = on_lane->CreateCache(ToWireSpec(spec));
  ASSERT_TRUE(cache.ok()) << cache.status();
  RefCache reference(spec);
  std::mt19937_64 rng(5);
  for (uint64_t tokens : {200, 1, 37, 120}) {
    const absl::Status stepped = StepBoth(*on_lane, cache->cache_id(), reference, tokens, rng);
    ASSERT_TRUE(stepped.ok()) << stepped;
  }
  EXPECT_TRUE(CacheMatchesReference(*on_lane, cache->cache_id(), reference));

  // Clients the gRPC port refuses get nothing from the lane either.
  const std::string lane = server_->server().data_lane_address();
  v1::FetchRequest fetch;
  fetch.set_cache_id(cache->cache_id());
  const auto fetch_over_lane = [&](ClientOptions options) {
    options.address = server_->server().address();
    options.deadline = absl::Seconds(5);
    options.data_lane = lane;
    return Client::Connect(options)->FetchAll(fetch).status();
  };
  const absl::Status other_ca = fetch_over_lane(Trusting("other_ca.pem"));
  EXPECT_EQ(other_ca.code(), absl::StatusCode::kUnavailable) << other_ca;
  EXPECT_THAT(other_ca.message(), HasSubstr("certificate verify failed"));
  const absl::Status plaintext = fetch_over_lane(ClientOptions{});
  EXPECT_EQ(plaintext.code(), absl::StatusCode::kUnavailable) << plaintext;
  // A certificate for 127.0.0.1 does not name another host.
  ClientOptions misnamed = Trusting("ca.pem");
  misnamed.tls_server_name = "kvcached.example";
  const absl::Status wrong_name = fetch_over_lane(misnamed);
  EXPECT_EQ(wrong_name.code(), absl::StatusCode::kUnavailable) << wrong_name;

  // A plaintext client's preamble is not a TLS hello: closed unanswered.
  absl::StatusOr<int> raw = lane::Connect(lane, absl::Seconds(5));
  ASSERT_TRUE(raw.ok()) << raw.status();
  lane::OwnedFd owned(*raw);
  char answer[64];
  EXPECT_LE(recv(owned.get(), answer, sizeof(answer), 0), 0);
  EXPECT_TRUE(CacheMatchesReference(*on_lane, cache->cache_id(), reference))
      << "the refused clients changed nothing";
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

  // The lane asks for the same certificates.
  std::unique_ptr<Client> on_lane = server_->Connect(/*dedicated=*/true, "auto");
  ASSERT_TRUE(on_lane->uses_data_lane());
  const engine::CacheSpec spec = MakeSpec({StandardLayerSpec(2, 8)});
  absl::StatusOr<v1::CacheInfo> cache = on_lane->CreateCache(ToWireSpec(spec));
  ASSERT_TRUE(cache.ok()) << cache.status();
  RefCache reference(spec);
  std::mt19937_64 rng(7);
  ASSERT_TRUE(StepBoth(*on_lane, cache->cache_id(), reference, 20, rng).ok());
  EXPECT_TRUE(CacheMatchesReference(*on_lane, cache->cache_id(), reference));
  ClientOptions no_cert = Trusting("ca.pem");
  no_cert.address = server_->server().address();
  no_cert.deadline = absl::Seconds(5);
  no_cert.data_lane = server_->server().data_lane_address();
  v1::FetchRequest fetch;
  fetch.set_cache_id(cache->cache_id());
  const absl::Status lane_without = Client::Connect(no_cert)->FetchAll(fetch).status();
  EXPECT_EQ(lane_without.code(), absl::StatusCode::kUnavailable) << lane_without;
}

TEST_F(E2eTlsTest, APlaintextLaneBeyondLoopbackNeedsAnExplicitFlag) {
  ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.data_lane_listen = "0.0.0.0:0";
  config.pool.budget_bytes = 4 << 20;
  absl::StatusOr<std::unique_ptr<KvCacheServer>> refused = KvCacheServer::Start(config);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("data_lane_listen"));
  EXPECT_THAT(refused.status().message(), HasSubstr("allow_plaintext_lane"));
  // With TLS it runs TLS, beyond loopback too.
  config.tls = ServerTls(false);
  absl::StatusOr<std::unique_ptr<KvCacheServer>> with_tls = KvCacheServer::Start(config);
  ASSERT_TRUE(with_tls.ok()) << with_tls.status();
  EXPECT_NE((*with_tls)->data_lane_address(), "");
  with_tls->reset();

  config.data_lane_listen = "127.0.0.1:0";
  config.tls = {.cert_file = File("missing.pem"), .key_file = File("server.key")};
  absl::StatusOr<std::unique_ptr<KvCacheServer>> unreadable = KvCacheServer::Start(config);
  ASSERT_FALSE(unreadable.ok());
  EXPECT_EQ(unreadable.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unreadable.status().message(), HasSubstr("tls_cert"));
}

}  // namespace
}  // namespace kvcache::testing
