#include "wire/lane/tls.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <pthread.h>
#include <signal.h>

#include <cerrno>
#include <climits>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "wire/lane/socket.h"

namespace kvcache::lane {
namespace {

// OpenSSL reads this much of the socket per call where it runs the records
// (read-ahead): many records to a system call instead of two calls each.
constexpr int kReadAheadBytes = 256 << 10;

// The reasons on OpenSSL's error queue of this thread, emptied.
std::string DrainErrors() {
  std::string reasons;
  while (const unsigned long error = ERR_get_error()) {
    char text[256];
    ERR_error_string_n(error, text, sizeof(text));
    absl::StrAppend(&reasons, reasons.empty() ? "" : "; ", text);
  }
  return reasons.empty() ? "no reason given" : reasons;
}

// The status of an SSL call that returned `result` <= 0 while doing `what`.
absl::Status SessionError(SSL* ssl, int result, const char* what) {
  const int error = SSL_get_error(ssl, result);
  switch (error) {
    case SSL_ERROR_WANT_READ:
    case SSL_ERROR_WANT_WRITE:  // a blocking socket's timeout
      ERR_clear_error();
      return absl::DeadlineExceededError(absl::StrCat("data lane: TLS ", what, " timed out"));
    case SSL_ERROR_SYSCALL:
      ERR_clear_error();  // the next call on this thread must not read these as its own
      if (errno != 0) return SocketError(what);
      return absl::UnavailableError(
          absl::StrCat("data lane: TLS ", what, ": the peer closed the connection"));
    case SSL_ERROR_ZERO_RETURN:
      return absl::UnavailableError(
          absl::StrCat("data lane: TLS ", what, ": the peer closed the connection"));
    default:
      return absl::UnavailableError(absl::StrCat("data lane: TLS ", what, ": ", DrainErrors()));
  }
}

// OpenSSL writes to its socket with write(), which raises SIGPIPE where the
// peer has gone and would end a process that did not ignore it (the client
// library's users among them). While one lives, this thread's SIGPIPE is
// held, and one raised meanwhile is taken off again.
class SigpipeHeld {
 public:
  SigpipeHeld() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &previous_);
  }
  ~SigpipeHeld() {
    if (!was_pending_) {
      sigset_t pending;
      sigpending(&pending);
      const timespec now{};
      if (sigismember(&pending, SIGPIPE) == 1) sigtimedwait(&pipe_, nullptr, &now);
    }
    pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
  }

 private:
  sigset_t pipe_;
  sigset_t previous_;
  bool was_pending_ = false;
};

// PEM text as OpenSSL's memory BIO (read-only, over the string).
struct PemBio {
  explicit PemBio(const std::string& pem)
      : bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()))) {}
  ~PemBio() { BIO_free(bio); }
  BIO* bio;
};

absl::Status UseCertificateChain(SSL_CTX* context, const TlsCredentials& own) {
  PemBio chain(own.cert_chain_pem);
  X509* leaf = PEM_read_bio_X509_AUX(chain.bio, nullptr, nullptr, nullptr);
  if (leaf == nullptr || SSL_CTX_use_certificate(context, leaf) != 1) {
    X509_free(leaf);
    return absl::InvalidArgumentError(
        absl::StrCat("TLS certificate: not a PEM certificate OpenSSL takes: ", DrainErrors()));
  }
  X509_free(leaf);
  while (X509* issuer = PEM_read_bio_X509(chain.bio, nullptr, nullptr, nullptr)) {
    if (SSL_CTX_add0_chain_cert(context, issuer) != 1) {  // owns it on success
      X509_free(issuer);
      return absl::InvalidArgumentError(
          absl::StrCat("TLS certificate: its chain: ", DrainErrors()));
    }
  }
  ERR_clear_error();  // the end of the chain reads as an error
  PemBio key_text(own.private_key_pem);
  EVP_PKEY* key = PEM_read_bio_PrivateKey(key_text.bio, nullptr, nullptr, nullptr);
  const bool used = key != nullptr && SSL_CTX_use_PrivateKey(context, key) == 1 &&
                    SSL_CTX_check_private_key(context) == 1;
  EVP_PKEY_free(key);
  if (!used) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS private key: not a PEM key of the certificate: ", DrainErrors()));
  }
  return absl::OkStatus();
}

absl::Status TrustCas(SSL_CTX* context, const std::string& pem) {
  X509_STORE* store = SSL_CTX_get_cert_store(context);
  PemBio cas(pem);
  int added = 0;
  while (X509* ca = PEM_read_bio_X509(cas.bio, nullptr, nullptr, nullptr)) {
    const int result = X509_STORE_add_cert(store, ca);
    X509_free(ca);
    if (result != 1) {
      return absl::InvalidArgumentError(absl::StrCat("TLS CA: ", DrainErrors()));
    }
    ++added;
  }
  ERR_clear_error();
  if (added == 0) return absl::InvalidArgumentError("TLS CA: no PEM certificate in it");
  return absl::OkStatus();
}

// What both sides share: TLS 1.3 with AES-GCM, the kernel's TLS where it has
// it, no tickets, no renegotiation; an end of stream without close_notify is
// an end like any other (the lane's frames carry their lengths, so a cut
// frame is seen as one).
absl::StatusOr<SSL_CTX*> NewContext(const SSL_METHOD* method) {
  SSL_CTX* context = SSL_CTX_new(method);
  if (context == nullptr) {
    return absl::InternalError(absl::StrCat("TLS: no OpenSSL context: ", DrainErrors()));
  }
  SSL_CTX_set_min_proto_version(context, TLS1_3_VERSION);
  SSL_CTX_set_ciphersuites(context, "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384");
  SSL_CTX_set_options(context,
                      SSL_OP_ENABLE_KTLS | SSL_OP_IGNORE_UNEXPECTED_EOF | SSL_OP_NO_RENEGOTIATION);
  SSL_CTX_set_num_tickets(context, 0);
  SSL_CTX_set_session_cache_mode(context, SSL_SESS_CACHE_OFF);
  SSL_CTX_set_default_read_buffer_len(context, kReadAheadBytes);
  return context;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const TlsContext>> TlsContext::ForServer(const TlsCredentials& own) {
  absl::StatusOr<SSL_CTX*> made = NewContext(TLS_server_method());
  if (!made.ok()) return made.status();
  std::shared_ptr<const TlsContext> context(new TlsContext(*made));
  if (absl::Status status = UseCertificateChain(*made, own); !status.ok()) return status;
  if (!own.trusted_ca_pem.empty()) {
    if (absl::Status status = TrustCas(*made, own.trusted_ca_pem); !status.ok()) return status;
    SSL_CTX_set_verify(*made, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return context;
}

absl::StatusOr<std::shared_ptr<const TlsContext>> TlsContext::ForClient(const TlsCredentials& own) {
  absl::StatusOr<SSL_CTX*> made = NewContext(TLS_client_method());
  if (!made.ok()) return made.status();
  std::shared_ptr<const TlsContext> context(new TlsContext(*made));
  if (!own.cert_chain_pem.empty()) {
    if (absl::Status status = UseCertificateChain(*made, own); !status.ok()) return status;
  }
  if (own.trusted_ca_pem.empty()) {
    if (SSL_CTX_set_default_verify_paths(*made) != 1) {
      return absl::InternalError(absl::StrCat("TLS: the system's CAs: ", DrainErrors()));
    }
  } else if (absl::Status status = TrustCas(*made, own.trusted_ca_pem); !status.ok()) {
    return status;
  }
  SSL_CTX_set_verify(*made, SSL_VERIFY_PEER, nullptr);
  return context;
}

TlsContext::~TlsContext() { SSL_CTX_free(context_); }

absl::StatusOr<std::unique_ptr<TlsSession>> TlsSession::Accept(const TlsContext& context, int fd) {
  SSL* ssl = SSL_new(context.get());
  if (ssl == nullptr || SSL_set_fd(ssl, fd) != 1) {
    SSL_free(ssl);
    return absl::InternalError(absl::StrCat("data lane: TLS: ", DrainErrors()));
  }
  return Handshake(ssl, /*server=*/true);
}

absl::StatusOr<std::unique_ptr<TlsSession>> TlsSession::Connect(const TlsContext& context, int fd,
                                                                const std::string& server_host) {
  SSL* ssl = SSL_new(context.get());
  if (ssl == nullptr || SSL_set_fd(ssl, fd) != 1) {
    SSL_free(ssl);
    return absl::InternalError(absl::StrCat("data lane: TLS: ", DrainErrors()));
  }
  // An address is checked against the certificate's IP names, a host name
  // against its DNS names (and sent, so a server of many names can choose).
  in6_addr ip;
  const bool is_ip = inet_pton(AF_INET, server_host.c_str(), &ip) == 1 ||
                     inet_pton(AF_INET6, server_host.c_str(), &ip) == 1;
  X509_VERIFY_PARAM* checks = SSL_get0_param(ssl);
  const int named = is_ip ? X509_VERIFY_PARAM_set1_ip_asc(checks, server_host.c_str())
                          : X509_VERIFY_PARAM_set1_host(checks, server_host.c_str(), 0) == 1 &&
                                SSL_set_tlsext_host_name(ssl, server_host.c_str()) == 1;
  if (named != 1) {
    SSL_free(ssl);
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("data lane: TLS: \"", server_host, "\" is not a host name to check"));
  }
  return Handshake(ssl, /*server=*/false);
}

absl::StatusOr<std::unique_ptr<TlsSession>> TlsSession::Handshake(SSL* ssl, bool server) {
  std::unique_ptr<TlsSession> session(new TlsSession(ssl));
  SigpipeHeld held;
  ERR_clear_error();
  errno = 0;
  const int result = server ? SSL_accept(ssl) : SSL_connect(ssl);
  if (result != 1) return SessionError(ssl, result, "handshake");
  // Where the kernel does not decrypt, OpenSSL reads ahead: set earlier, it
  // would keep the kernel from taking the receive side.
  if (!session->kernel_receives()) SSL_set_read_ahead(ssl, 1);
  return session;
}

TlsSession::~TlsSession() { SSL_free(ssl_); }

bool TlsSession::kernel_sends() const { return BIO_get_ktls_send(SSL_get_wbio(ssl_)) != 0; }

bool TlsSession::kernel_receives() const { return BIO_get_ktls_recv(SSL_get_rbio(ssl_)) != 0; }

std::string TlsSession::Describe() const {
  const auto where = [](bool kernel) { return kernel ? "kernel" : "OpenSSL"; };
  return absl::StrCat(SSL_get_version(ssl_), " ", SSL_get_cipher_name(ssl_), ", records by ",
                      where(kernel_sends()), " (send) and ", where(kernel_receives()),
                      " (receive)");
}

bool TlsSession::HasBuffered() const { return SSL_has_pending(ssl_) == 1; }

// Marks the session in use while it lives; `overlapped()`: it already was.
class TlsSession::InUse {
 public:
  explicit InUse(std::atomic<bool>& flag)
      : flag_(flag), overlapped_(flag.exchange(true, std::memory_order_acquire)) {}
  ~InUse() {
    if (!overlapped_) flag_.store(false, std::memory_order_release);
  }
  absl::Status overlapped() const {
    if (!overlapped_) return absl::OkStatus();
    return absl::InternalError("data lane: a TLS session was used by two threads at once");
  }

 private:
  std::atomic<bool>& flag_;
  const bool overlapped_;
};

// SSL_read may write too (an alert, an answer to a key update): SIGPIPE is
// held around it as around SSL_write.
absl::StatusOr<size_t> TlsSession::Read(std::byte* data, size_t size) {
  const InUse in_use(in_use_);
  if (absl::Status alone = in_use.overlapped(); !alone.ok()) return alone;
  SigpipeHeld held;
  ERR_clear_error();
  errno = 0;
  size_t got = 0;
  const int result = SSL_read_ex(ssl_, data, size, &got);
  if (result == 1) return got;
  if (SSL_get_error(ssl_, result) == SSL_ERROR_ZERO_RETURN) return 0;
  return SessionError(ssl_, result, "receive");
}

// The socket is non-blocking for this one read: a record of which only a
// part has arrived makes OpenSSL want more instead of waiting for it.
absl::StatusOr<std::optional<size_t>> TlsSession::ReadWithoutWaiting(std::byte* data, size_t size) {
  const InUse in_use(in_use_);
  if (absl::Status alone = in_use.overlapped(); !alone.ok()) return alone;
  const int fd = SSL_get_fd(ssl_);
  const int blocking_flags = fcntl(fd, F_GETFL);
  if (blocking_flags < 0 || fcntl(fd, F_SETFL, blocking_flags | O_NONBLOCK) != 0) {
    return SocketError("fcntl");
  }
  SigpipeHeld held;
  ERR_clear_error();
  errno = 0;
  size_t got = 0;
  const int result = SSL_read_ex(ssl_, data, size, &got);
  const int error = result == 1 ? SSL_ERROR_NONE : SSL_get_error(ssl_, result);
  const int read_errno = errno;
  fcntl(fd, F_SETFL, blocking_flags);
  errno = read_errno;
  switch (error) {
    case SSL_ERROR_NONE:
      return got;
    case SSL_ERROR_WANT_READ:
    case SSL_ERROR_WANT_WRITE:
      ERR_clear_error();
      return std::nullopt;
    case SSL_ERROR_ZERO_RETURN:
      return 0;
    default:
      return SessionError(ssl_, result, "receive");
  }
}

absl::Status TlsSession::Write(absl::Span<const std::byte> bytes) {
  const InUse in_use(in_use_);
  if (absl::Status alone = in_use.overlapped(); !alone.ok()) return alone;
  SigpipeHeld held;
  while (!bytes.empty()) {
    ERR_clear_error();
    errno = 0;
    size_t sent = 0;
    const int result = SSL_write_ex(ssl_, bytes.data(), bytes.size(), &sent);
    if (result != 1) return SessionError(ssl_, result, "send");
    bytes.remove_prefix(sent);
  }
  return absl::OkStatus();
}

}  // namespace kvcache::lane
