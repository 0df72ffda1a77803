// TLS on the data lane's sockets, from OpenSSL. After the handshake either
// the kernel runs the records (kernel TLS: OpenSSL sets TCP_ULP "tls" where
// the kernel has it), so frames go through recv and sendmsg on the socket as
// in plaintext and are copied no more often; or, where it has not, OpenSSL
// does in user space (Read and Write below). Either way the rest of the lane
// sees only plaintext frames. TLS 1.3 only, AES-GCM only (the ciphers kernel
// TLS takes), no session tickets (a ticket is a record the kernel's receive
// side could not hand to a plain recv; pooled connections need no resumption).
#pragma once

#include <openssl/types.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvcache::lane {

// PEM text of one side's certificates.
struct TlsCredentials {
  std::string cert_chain_pem;   // ours: a server's; a client's for mutual TLS (else empty)
  std::string private_key_pem;  // of cert_chain_pem
  // Whom we trust. A client: the server's CA (empty: the system's CAs). A
  // server: the CA of its clients' certificates, which it then requires
  // (mutual TLS); empty: clients present none.
  std::string trusted_ca_pem;
};

// An OpenSSL context: settings shared by the connections of one side.
class TlsContext {
 public:
  // INVALID_ARGUMENT naming the PEM that OpenSSL refused, and why.
  static absl::StatusOr<std::shared_ptr<const TlsContext>> ForServer(const TlsCredentials& own);
  static absl::StatusOr<std::shared_ptr<const TlsContext>> ForClient(const TlsCredentials& own);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  SSL_CTX* get() const { return context_; }

 private:
  explicit TlsContext(SSL_CTX* context) : context_(context) {}
  SSL_CTX* context_;
};

// One connection's TLS. The socket stays the caller's (closed after this).
class TlsSession {
 public:
  // The server's side of the handshake on a connected blocking socket; its
  // receive and send timeouts bound it. UNAVAILABLE with OpenSSL's reason
  // (a certificate refused, a peer that does not speak TLS).
  static absl::StatusOr<std::unique_ptr<TlsSession>> Accept(const TlsContext& context, int fd);
  // The client's side: the server's certificate must name `server_host` (a
  // DNS name, sent as SNI, or an IP address).
  static absl::StatusOr<std::unique_ptr<TlsSession>> Connect(const TlsContext& context, int fd,
                                                             const std::string& server_host);
  ~TlsSession();
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  // The kernel encrypts what send and sendmsg on the socket write.
  bool kernel_sends() const;
  // The kernel decrypts: recv on the socket reads plaintext.
  bool kernel_receives() const;
  // "TLSv1.3 TLS_AES_128_GCM_SHA256, kernel TLS send and receive" and the like.
  std::string Describe() const;
  // Whether OpenSSL holds received bytes (decrypted or not) that a Read
  // would return or complete without the socket.
  bool HasBuffered() const;
  // Read, ReadWithoutWaiting and Write must not overlap (OpenSSL's rule for
  // one connection): one that starts while another runs fails with INTERNAL
  // instead of corrupting the session.
  // Up to `size` plaintext bytes, blocking until some arrive: 0 when the
  // peer closed. DEADLINE_EXCEEDED past the socket's receive timeout,
  // UNAVAILABLE on a failed socket or a bad record.
  absl::StatusOr<size_t> Read(std::byte* data, size_t size);
  // Read's bytes if a whole record's worth can be had now, else nullopt
  // (never waits, also not for the rest of a record begun).
  absl::StatusOr<std::optional<size_t>> ReadWithoutWaiting(std::byte* data, size_t size);
  // All of `bytes`, as TLS records; errors as Read's.
  absl::Status Write(absl::Span<const std::byte> bytes);

 private:
  class InUse;
  explicit TlsSession(SSL* ssl) : ssl_(ssl) {}
  static absl::StatusOr<std::unique_ptr<TlsSession>> Handshake(SSL* ssl, bool server);
  SSL* ssl_;
  std::atomic<bool> in_use_{false};  // a Read or Write runs
};

}  // namespace kvcache::lane
