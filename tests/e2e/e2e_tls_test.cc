// TLS on the gRPC port and the data lane (server/transport_security.h,
// protos/wire/lane/tls.h) with certificates the test makes with Debian's openssl
// (never committed keys): a client that trusts the CA works, over streams
// and over the lane; one that trusts another CA, or speaks plaintext, gets
// nothing on either; mutual TLS refuses a client without a certificate of
// the CA on both; a plaintext lane refuses a non-loopback address unless
// allowed, a TLS one takes it.
#include <openssl/bio.h>
#include <openssl/ssl.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference_quantized.h"
#include "service/lane/data_lane.h"
#include "wire/lane/socket.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;

std::string ReadText(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The first flight of a TLS client, as OpenSSL makes it.
std::string ClientHello() {
  SSL_CTX* context = SSL_CTX_new(TLS_client_method());
  SSL* ssl = SSL_new(context);
  BIO* sent = BIO_new(BIO_s_mem());
  SSL_set_bio(ssl, BIO_new(BIO_s_mem()), sent);
  SSL_connect(ssl);  // wants the server's answer; its hello is in `sent`
  char* data = nullptr;
  const long size = BIO_get_mem_data(sent, &data);
  std::string hello(data, static_cast<size_t>(size));
  SSL_free(ssl);
  SSL_CTX_free(context);
  return hello;
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

// OpenSSL's sessions take no reads and writes at once: acknowledged_count
// on one thread while another writes must not break the stream.
TEST_F(E2eTlsTest, AcknowledgementsCountedWhileWritingOverTheTlsLane) {
  server_ = TestServer::Start({.tls = ServerTls(false), .client_tls = Trusting("ca.pem")});
  ASSERT_NE(server_, nullptr);
  std::unique_ptr<Client> on_lane = server_->Connect(/*dedicated=*/true, "auto");
  ASSERT_TRUE(on_lane->uses_data_lane());
  const engine::CacheSpec spec = MakeSpec({StandardLayerSpec(2, 64)});
  absl::StatusOr<v1::CacheInfo> cache = on_lane->CreateCache(ToWireSpec(spec));
  ASSERT_TRUE(cache.ok()) << cache.status();
  RefCache reference(spec);
  std::mt19937_64 rng(11);
  constexpr int kMessages = 3000;
  std::vector<KvTensors> sent;
  sent.reserve(kMessages);
  std::unique_ptr<UpdateStream> stream = on_lane->OpenUpdate(cache->cache_id());
  std::atomic<bool> writing{true};
  std::atomic<uint64_t> polls{0};
  std::thread counter([&] {
    uint64_t last = 0;
    while (writing.load()) {
      const uint64_t now = stream->acknowledged_count();
      EXPECT_GE(now, last);
      last = now;
      polls.fetch_add(1);
    }
  });
  int written = 0;
  for (; written < kMessages; ++written) {
    sent.push_back(RandomLayerKv(spec, 0, 1 + written % 3, rng));
    if (!stream->Write(MakeLayerUpdate(spec, 0, sent.back()))) break;
  }
  writing.store(false);
  counter.join();
  ASSERT_EQ(written, kMessages) << stream->Finish().status();
  absl::StatusOr<std::vector<v1::UpdateResponse>> acks = stream->Finish();
  ASSERT_TRUE(acks.ok()) << acks.status();
  EXPECT_EQ(acks->size(), size_t{kMessages});
  EXPECT_GT(polls.load(), 0u);
  for (int i = 0; i < kMessages; ++i) {
    reference.Update(0,
                     TokensFromTensors(ShapeOf(spec, 0), sent[i].keys, sent[i].values, 1 + i % 3));
  }
  EXPECT_TRUE(CacheMatchesReference(*on_lane, cache->cache_id(), reference));
}

// A peer gets the opening timeout for its handshake, preamble and AUTH
// together, however it spaces its bytes; a connection that opened may then
// idle as long as it likes.
TEST_F(E2eTlsTest, ALaneConnectionThatDoesNotOpenInTimeIsClosed) {
  server_ = TestServer::Start({.tls = ServerTls(false),
                               .client_tls = Trusting("ca.pem"),
                               .lane_limits = {.opening_timeout = absl::Seconds(1)}});
  ASSERT_NE(server_, nullptr);
  std::unique_ptr<Client> on_lane = server_->Connect(/*dedicated=*/true, "auto");
  ASSERT_TRUE(on_lane->uses_data_lane());
  const engine::CacheSpec spec = MakeSpec({StandardLayerSpec(1, 8)});
  absl::StatusOr<v1::CacheInfo> cache = on_lane->CreateCache(ToWireSpec(spec));
  ASSERT_TRUE(cache.ok()) << cache.status();
  RefCache reference(spec);
  std::mt19937_64 rng(13);
  ASSERT_TRUE(StepBoth(*on_lane, cache->cache_id(), reference, 4, rng).ok());
  service::DataLane& lane = *server_->server().data_lane();
  const int opened = lane.open_connections();
  EXPECT_GE(opened, 1);

  // A real ClientHello, all but its last bytes at once, then one byte every
  // 200 ms: each read is quick (the socket's timeout is the opening
  // timeout), the whole is not.
  absl::StatusOr<int> raw =
      lane::Connect(server_->server().data_lane_address(), absl::Seconds(5), /*preamble=*/"");
  ASSERT_TRUE(raw.ok()) << raw.status();
  lane::OwnedFd slow(*raw);
  const std::string hello = ClientHello();
  ASSERT_GT(hello.size(), 100u);
  const absl::Time start = absl::Now();
  ASSERT_EQ(send(slow.get(), hello.data(), hello.size() - 20, MSG_NOSIGNAL),
            static_cast<ssize_t>(hello.size() - 20));
  absl::Duration closed_after = absl::InfiniteDuration();
  for (size_t i = hello.size() - 20; i < hello.size(); ++i) {
    absl::SleepFor(absl::Milliseconds(200));
    char byte;
    const ssize_t got = recv(slow.get(), &byte, 1, MSG_DONTWAIT);
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK) ||
        send(slow.get(), &hello[i], 1, MSG_NOSIGNAL) != 1) {
      closed_after = absl::Now() - start;
      break;
    }
  }
  // Closed by the opening deadline (1 s), not before: the bytes were a valid start.
  EXPECT_GE(closed_after, absl::Milliseconds(900));
  EXPECT_LT(closed_after, absl::Seconds(3));
  for (int i = 0; i < 300 && lane.open_connections() > opened; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(lane.open_connections(), opened);
  // The client's connection, idle for longer than that, is still served.
  ASSERT_TRUE(StepBoth(*on_lane, cache->cache_id(), reference, 3, rng).ok());
  EXPECT_TRUE(CacheMatchesReference(*on_lane, cache->cache_id(), reference));
  EXPECT_EQ(lane.open_connections(), opened) << "the idle connection was kept, not replaced";
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

// Replicas of a fleet with mutual TLS pull from each other: the puller
// trusts the fleet's CA (its --tls_client_ca) and shows the owner its own
// certificate. One that trusts another CA (--peer_ca) reaches nothing.
TEST_F(E2eTlsTest, ReplicasPullSnapshotsFromEachOtherOverMutualTls) {
  ClientOptions with_cert = Trusting("ca.pem");
  with_cert.tls_client_cert_pem = ReadText(*dir_ / "client.pem");
  with_cert.tls_client_key_pem = ReadText(*dir_ / "client.key");
  server_ = TestServer::Start(
      {.tls = ServerTls(true), .client_tls = with_cert, .replica_name = "owner"});
  ASSERT_NE(server_, nullptr);
  const engine::CacheSpec spec = MakeSpec({StandardLayerSpec(2, 8), StandardLayerSpec(2, 8)});
  absl::StatusOr<v1::CacheInfo> cache = server_->client().CreateCache(ToWireSpec(spec));
  ASSERT_TRUE(cache.ok()) << cache.status();
  RefCache reference(spec);
  std::mt19937_64 rng(17);
  ASSERT_TRUE(StepBoth(server_->client(), cache->cache_id(), reference, 40, rng).ok());
  absl::StatusOr<v1::SnapshotInfo> snapshot = server_->client().Snapshot(cache->cache_id());
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();

  const std::string peers = "owner=" + server_->server().address();
  std::unique_ptr<TestServer> puller = TestServer::Start({.tls = ServerTls(true),
                                                          .client_tls = with_cert,
                                                          .replica_name = "puller",
                                                          .peers = peers});
  ASSERT_NE(puller, nullptr);
  absl::StatusOr<v1::LoadSnapshotResponse> pulled =
      puller->client().PullSnapshot(snapshot->snapshot_id());
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  absl::StatusOr<v1::CacheInfo> copy = puller->client().CreateCache(ToWireSpec(spec));
  ASSERT_TRUE(copy.ok()) << copy.status();
  ASSERT_TRUE(
      puller->client().Restore(copy->cache_id(), pulled->snapshot().snapshot_id(), 40).ok());
  EXPECT_TRUE(CacheMatchesReference(puller->client(), copy->cache_id(), reference));

  std::unique_ptr<TestServer> misled = TestServer::Start({.tls = ServerTls(true),
                                                          .client_tls = with_cert,
                                                          .replica_name = "misled",
                                                          .peers = peers,
                                                          .peer_ca_file = File("other_ca.pem")});
  ASSERT_NE(misled, nullptr);
  const absl::Status refused = misled->client().PullSnapshot(snapshot->snapshot_id()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;

  // A client certificate of its own (--peer_cert), where the fleet's PKI
  // keeps server and client certificates apart: one the owner's CA signed
  // is admitted; one it did not sign is refused (its server certificate,
  // which the owner would admit, is then not shown).
  const auto showing = [&](const std::string& name, const std::string& cert) {
    return TestServer::Start({.tls = ServerTls(true),
                              .client_tls = with_cert,
                              .replica_name = name,
                              .peers = peers,
                              .peer_cert_file = File(cert + ".pem"),
                              .peer_key_file = File(cert + ".key")});
  };
  std::unique_ptr<TestServer> client_cert = showing("client-cert", "client");
  ASSERT_NE(client_cert, nullptr);
  absl::StatusOr<v1::LoadSnapshotResponse> shown =
      client_cert->client().PullSnapshot(snapshot->snapshot_id());
  EXPECT_TRUE(shown.ok()) << shown.status();
  std::unique_ptr<TestServer> stranger = showing("stranger", "other_ca");
  ASSERT_NE(stranger, nullptr);
  const absl::Status unknown = stranger->client().PullSnapshot(snapshot->snapshot_id()).status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kUnavailable) << unknown;
  if (shown.ok()) {
    ASSERT_TRUE(client_cert->client().ReleaseSnapshot(shown->snapshot().snapshot_id()).ok());
  }
  puller->CleanUpAndCheck();
  misled->CleanUpAndCheck();
  client_cert->CleanUpAndCheck();
  stranger->CleanUpAndCheck();
}

TEST_F(E2eTlsTest, HalfAPeerCertificatePairIsRefusedByName) {
  ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.pool.budget_bytes = 4 << 20;
  config.tls = ServerTls(true);
  config.peers = "owner=127.0.0.1:1";
  config.peer_cert_file = File("client.pem");
  absl::StatusOr<std::unique_ptr<KvCacheServer>> refused = KvCacheServer::Start(config);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("peer_key"));
  config.tls = {};
  config.peer_key_file = File("client.key");
  refused = KvCacheServer::Start(config);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("peer_cert: peers are called over TLS only"));
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
