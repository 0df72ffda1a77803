// The lane's frames over TLS (wire/lane/tls.h), on a Unix socket pair and on
// loopback TCP, with certificates made here in memory: every frame size
// crosses records whole both ways, Poll still returns only whole frames, a
// connection ends as it does in plaintext, and a handshake with a peer of
// another certificate, another name or no TLS at all fails naming why.
#include "wire/lane/tls.h"

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "socket_pair.h"
#include "wire/lane/frame_writer.h"

namespace kvcache::lane {
namespace {

using ::testing::HasSubstr;

// A self-signed P-256 certificate for IP 127.0.0.1, and its key, as PEM.
TlsCredentials SelfSigned(const char* common_name) {
  EVP_PKEY* key = EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256");
  X509* cert = X509_new();
  X509_set_version(cert, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert), 1);
  X509_gmtime_adj(X509_getm_notBefore(cert), -60);
  X509_gmtime_adj(X509_getm_notAfter(cert), 3600);
  X509_set_pubkey(cert, key);
  X509_NAME* name = X509_get_subject_name(cert);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(common_name), -1, -1, 0);
  X509_set_issuer_name(cert, name);
  X509V3_CTX context;
  X509V3_set_ctx_nodb(&context);
  X509V3_set_ctx(&context, cert, cert, nullptr, nullptr, 0);
  for (auto [nid, value] : {std::pair{NID_subject_alt_name, "IP:127.0.0.1"},
                            std::pair{NID_basic_constraints, "critical,CA:TRUE"}}) {
    X509_EXTENSION* extension = X509V3_EXT_conf_nid(nullptr, &context, nid, value);
    X509_add_ext(cert, extension, -1);
    X509_EXTENSION_free(extension);
  }
  X509_sign(cert, key, EVP_sha256());
  const auto pem = [](auto write) {
    BIO* bio = BIO_new(BIO_s_mem());
    write(bio);
    char* data = nullptr;
    const long size = BIO_get_mem_data(bio, &data);
    std::string text(data, static_cast<size_t>(size));
    BIO_free(bio);
    return text;
  };
  TlsCredentials made{.cert_chain_pem = pem([&](BIO* bio) { PEM_write_bio_X509(bio, cert); }),
                      .private_key_pem = pem([&](BIO* bio) {
                        PEM_write_bio_PrivateKey(bio, key, nullptr, nullptr, 0, nullptr, nullptr);
                      })};
  X509_free(cert);
  EVP_PKEY_free(key);
  return made;
}

class LaneTlsTest : public SocketPairTest {
 protected:
  static void SetUpTestSuite() {
    server_ = new TlsCredentials(SelfSigned("kvcached"));
    stranger_ = new TlsCredentials(SelfSigned("stranger"));
  }
  static void TearDownTestSuite() {
    delete server_;
    delete stranger_;
  }
  // Handshakes: far_ as the server of `server_`, near_ as a client trusting
  // `trusted` and expecting `host`. Returns the client's result; the
  // server's goes to far_session_.
  absl::StatusOr<std::unique_ptr<TlsSession>> Handshake(const TlsCredentials& trusted,
                                                        const std::string& host = "127.0.0.1") {
    absl::StatusOr<std::shared_ptr<const TlsContext>> server = TlsContext::ForServer(*server_);
    EXPECT_TRUE(server.ok()) << server.status();
    absl::StatusOr<std::shared_ptr<const TlsContext>> client =
        TlsContext::ForClient({.trusted_ca_pem = trusted.cert_chain_pem});
    EXPECT_TRUE(client.ok()) << client.status();
    if (!server.ok() || !client.ok()) return absl::InternalError("no contexts");
    server_context_ = *server;
    std::thread accepting([&] { far_session_ = TlsSession::Accept(**server, far_.get()); });
    absl::StatusOr<std::unique_ptr<TlsSession>> near =
        TlsSession::Connect(**client, near_.get(), host);
    if (!near.ok()) shutdown(near_.get(), SHUT_RDWR);  // the server's side ends too
    accepting.join();
    return near;
  }

  static TlsCredentials* server_;
  static TlsCredentials* stranger_;
  std::shared_ptr<const TlsContext> server_context_;
  absl::StatusOr<std::unique_ptr<TlsSession>> far_session_ = absl::UnknownError("no handshake");
};

TlsCredentials* LaneTlsTest::server_ = nullptr;
TlsCredentials* LaneTlsTest::stranger_ = nullptr;

TEST_P(LaneTlsTest, FramesOfEverySizeCrossRecordsWholeBothWays) {
  absl::StatusOr<std::unique_ptr<TlsSession>> near = Handshake(*server_);
  ASSERT_TRUE(near.ok()) << near.status();
  ASSERT_TRUE(far_session_.ok()) << far_session_.status();
  EXPECT_THAT((*near)->Describe(), HasSubstr("TLSv1.3"));

  std::mt19937_64 rng(11);
  std::vector<std::string> payloads;
  for (int i = 0; i < 400; ++i) {
    const size_t size = i % 60 == 9 ? (700 << 10) + i : i % 7 == 3 ? 16384 + i % 5 : rng() % 3000;
    payloads.push_back(RandomBytes(size, rng));
  }
  // Far to near: sent as copies and as references, several frames a Send.
  std::thread sending([&] {
    FrameWriter writer(far_.get(), far_session_->get());
    for (size_t i = 0; i < payloads.size(); ++i) {
      const auto& payload = payloads[i];
      writer.AddHeader(v1::LANE_FRAME_FETCH_CHUNK, static_cast<uint32_t>(payload.size()));
      const absl::Span<const std::byte> bytes(reinterpret_cast<const std::byte*>(payload.data()),
                                              payload.size());
      if (i % 2 == 0) {
        writer.AddCopy(bytes);
      } else {
        writer.AddReference(bytes);
      }
      if (i % 3 == 2 || i + 1 == payloads.size()) {
        ASSERT_TRUE(writer.Send().ok());
      }
    }
  });
  FrameReader reader(near_.get(), 1 << 20, near->get());
  for (size_t i = 0; i < payloads.size(); ++i) {
    // Every other frame looked for with Poll first: whole frames or none.
    if (i % 2 == 1) {
      absl::StatusOr<std::optional<Frame>> polled = reader.Poll();
      ASSERT_TRUE(polled.ok()) << polled.status();
      if (polled->has_value()) {
        ASSERT_TRUE(PayloadOf(**polled) == payloads[i]) << "polled frame " << i;
        continue;
      }
    }
    ASSERT_TRUE(NextPayload(reader) == payloads[i]) << "frame " << i;
  }
  sending.join();
  EXPECT_GT(reader.bytes_received(), 0u);

  // Near to far: small frames, one per Send.
  FrameWriter back(near_.get(), near->get());
  FrameReader far_reader(far_.get(), 1 << 20, far_session_->get());
  for (int i = 0; i < 50; ++i) {
    const std::string payload = RandomBytes(rng() % 200, rng);
    back.AddHeader(v1::LANE_FRAME_UPDATE, static_cast<uint32_t>(payload.size()));
    back.AddCopy({reinterpret_cast<const std::byte*>(payload.data()), payload.size()});
    ASSERT_TRUE(back.Send().ok());
    ASSERT_TRUE(NextPayload(far_reader) == payload) << "frame " << i;
  }
}

TEST_P(LaneTlsTest, EndsAsInPlaintext) {
  absl::StatusOr<std::unique_ptr<TlsSession>> near = Handshake(*server_);
  ASSERT_TRUE(near.ok()) << near.status();
  ASSERT_TRUE(far_session_.ok()) << far_session_.status();
  SetReceiveTimeout(std::chrono::milliseconds(200));
  FrameReader reader(near_.get(), 1 << 20, near->get());
  absl::StatusOr<Frame> waited = reader.Next();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kDeadlineExceeded) << waited.status();

  FrameWriter writer(far_.get(), far_session_->get());
  writer.AddHeader(v1::LANE_FRAME_STATUS, 10);
  writer.AddCopy({reinterpret_cast<const std::byte*>("abc"), 3});  // 7 bytes short
  ASSERT_TRUE(writer.Send().ok());
  shutdown(far_.get(), SHUT_WR);
  absl::StatusOr<Frame> cut = reader.Next();
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kUnavailable) << cut.status();
}

// Poll never waits for the rest of a record begun: the far session's
// records are caught on a socket pair of their own and handed on in halves.
TEST_P(LaneTlsTest, PollWithHalfARecordReturnsAtOnce) {
  absl::StatusOr<std::unique_ptr<TlsSession>> near = Handshake(*server_);
  ASSERT_TRUE(near.ok()) << near.status();
  ASSERT_TRUE(far_session_.ok()) << far_session_.status();
  const OwnedFd to_near(dup(far_.get()));
  int catcher[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, catcher), 0);
  const OwnedFd caught(catcher[1]);
  ASSERT_EQ(dup2(catcher[0], far_.get()), far_.get());  // the session now writes to the catcher
  close(catcher[0]);
  FrameWriter writer(far_.get(), far_session_->get());
  const std::string payload(3000, 'k');
  writer.AddHeader(v1::LANE_FRAME_UPDATE_ACK, static_cast<uint32_t>(payload.size()));
  writer.AddCopy({reinterpret_cast<const std::byte*>(payload.data()), payload.size()});
  ASSERT_TRUE(writer.Send().ok());
  std::string record(8192, '\0');
  const ssize_t size = recv(caught.get(), record.data(), record.size(), 0);
  ASSERT_GT(size, static_cast<ssize_t>(payload.size()));
  record.resize(static_cast<size_t>(size));

  SetReceiveTimeout(std::chrono::seconds(10));
  FrameReader reader(near_.get(), 1 << 20, near->get());
  ASSERT_EQ(send(to_near.get(), record.data(), record.size() / 2, MSG_NOSIGNAL),
            static_cast<ssize_t>(record.size() / 2));
  const absl::Time start = absl::Now();
  absl::StatusOr<std::optional<Frame>> half = reader.Poll();
  ASSERT_TRUE(half.ok()) << half.status();
  EXPECT_FALSE(half->has_value());
  EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << "Poll waited for the record's rest";
  const size_t rest = record.size() - record.size() / 2;
  ASSERT_EQ(send(to_near.get(), record.data() + record.size() / 2, rest, MSG_NOSIGNAL),
            static_cast<ssize_t>(rest));
  EXPECT_EQ(NextPayload(reader), payload);
}

TEST_P(LaneTlsTest, ClosedBetweenFramesIsOutOfRange) {
  absl::StatusOr<std::unique_ptr<TlsSession>> near = Handshake(*server_);
  ASSERT_TRUE(near.ok()) << near.status();
  ASSERT_TRUE(far_session_.ok()) << far_session_.status();
  FrameWriter writer(far_.get(), far_session_->get());
  writer.AddHeader(v1::LANE_FRAME_STATUS, 0);
  ASSERT_TRUE(writer.Send().ok());
  shutdown(far_.get(), SHUT_WR);
  FrameReader reader(near_.get(), 1 << 20, near->get());
  EXPECT_TRUE(reader.Next().ok());
  EXPECT_EQ(reader.Next().status().code(), absl::StatusCode::kOutOfRange);
}

TEST_P(LaneTlsTest, AClientTrustingAnotherCertificateGetsNothing) {
  absl::StatusOr<std::unique_ptr<TlsSession>> near = Handshake(*stranger_);
  ASSERT_FALSE(near.ok());
  EXPECT_EQ(near.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(near.status().message(), HasSubstr("certificate verify failed"));
  EXPECT_FALSE(far_session_.ok());
}

TEST_P(LaneTlsTest, TheCertificateMustNameTheHost) {
  absl::StatusOr<std::unique_ptr<TlsSession>> near = Handshake(*server_, "kvcached.example");
  ASSERT_FALSE(near.ok());
  EXPECT_THAT(near.status().message(), HasSubstr("certificate verify failed"));
  SetUp();  // a fresh socket pair
  near = Handshake(*server_, "127.0.0.2");
  EXPECT_FALSE(near.ok());
}

TEST_P(LaneTlsTest, APlaintextPeerFailsTheHandshake) {
  absl::StatusOr<std::shared_ptr<const TlsContext>> server = TlsContext::ForServer(*server_);
  ASSERT_TRUE(server.ok()) << server.status();
  std::thread plaintext([&] { Feed(std::string(kMagic, sizeof(kMagic)) + std::string(300, 'x')); });
  absl::StatusOr<std::unique_ptr<TlsSession>> session = TlsSession::Accept(**server, near_.get());
  plaintext.join();
  ASSERT_FALSE(session.ok());
  EXPECT_EQ(session.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(session.status().message(), HasSubstr("TLS handshake"));
}

TEST(LaneTlsContextTest, RefusesPemItCannotUse) {
  const TlsCredentials good = SelfSigned("kvcached");
  absl::StatusOr<std::shared_ptr<const TlsContext>> no_cert = TlsContext::ForServer(
      {.cert_chain_pem = "not a certificate", .private_key_pem = good.private_key_pem});
  EXPECT_EQ(no_cert.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_cert.status().message(), HasSubstr("TLS certificate"));
  const TlsCredentials other = SelfSigned("other");
  absl::StatusOr<std::shared_ptr<const TlsContext>> wrong_key = TlsContext::ForServer(
      {.cert_chain_pem = good.cert_chain_pem, .private_key_pem = other.private_key_pem});
  EXPECT_EQ(wrong_key.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong_key.status().message(), HasSubstr("TLS private key"));
  absl::StatusOr<std::shared_ptr<const TlsContext>> bad_ca =
      TlsContext::ForClient({.trusted_ca_pem = "no PEM here"});
  EXPECT_EQ(bad_ca.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_ca.status().message(), HasSubstr("TLS CA"));
}

INSTANTIATE_TEST_SUITE_P(Transports, LaneTlsTest,
                         ::testing::Values(Transport::kUnixPair, Transport::kTcpLoopback),
                         TransportName);

}  // namespace
}  // namespace kvcache::lane
