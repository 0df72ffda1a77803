#include "transport_security.h"

#include <grpcpp/security/server_credentials.h>

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvcache {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path);
  std::stringstream text;
  if (in) text << in.rdbuf();
  if (!in || text.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read a PEM file at \"", path, "\""));
  }
  return text.str();
}

struct KeyPair {
  std::string cert_chain;
  std::string private_key;
};

// A certificate and its key, each read as ReadPem reads it.
absl::StatusOr<KeyPair> ReadKeyPair(const std::string& cert_file, const char* cert_flag,
                                    const std::string& key_file, const char* key_flag) {
  KeyPair pair;
  absl::StatusOr<std::string> cert = ReadPem(cert_file, cert_flag);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(key_file, key_flag);
  if (!key.ok()) return key.status();
  pair.cert_chain = *std::move(cert);
  pair.private_key = *std::move(key);
  return pair;
}


}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> GrpcServerCredentials(
    const TlsConfig& tls) {
  if (!tls.enabled()) {
    if (!tls.key_file.empty() || !tls.client_ca_file.empty()) {
      return absl::InvalidArgumentError("tls_cert: needed by tls_key and tls_client_ca");
    }
    return grpc::InsecureServerCredentials();
  }
  if (tls.key_file.empty()) return absl::InvalidArgumentError("tls_key: needed with tls_cert");
  grpc::SslServerCredentialsOptions options;
  absl::StatusOr<KeyPair> own = ReadKeyPair(tls.cert_file, "tls_cert", tls.key_file, "tls_key");
  if (!own.ok()) return own.status();
  options.pem_key_cert_pairs.push_back(
      {.private_key = std::move(own->private_key), .cert_chain = std::move(own->cert_chain)});
  if (!tls.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(tls.client_ca_file, "tls_client_ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> GrpcPeerCredentials(
    const TlsConfig& tls, const PeerTlsConfig& peer) {
  if (!tls.enabled()) {
    for (const auto& [file, flag] :
         {std::pair(&peer.ca_file, "peer_ca"), std::pair(&peer.cert_file, "peer_cert"),
          std::pair(&peer.key_file, "peer_key")}) {
      if (!file->empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(flag, ": peers are called over TLS only with tls_cert"));
      }
    }
    return grpc::InsecureChannelCredentials();
  }
  if (peer.cert_file.empty() != peer.key_file.empty()) {
    return absl::InvalidArgumentError(peer.cert_file.empty() ? "peer_cert: needed with peer_key"
                                                             : "peer_key: needed with peer_cert");
  }
  grpc::SslCredentialsOptions options;
  const bool ca_given = !peer.ca_file.empty();
  const std::string& ca_file = ca_given ? peer.ca_file : tls.client_ca_file;
  if (!ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(ca_file, ca_given ? "peer_ca" : "tls_client_ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
  }
  absl::StatusOr<KeyPair> shown;
  if (!peer.cert_file.empty()) {
    shown = ReadKeyPair(peer.cert_file, "peer_cert", peer.key_file, "peer_key");
  } else if (!tls.client_ca_file.empty()) {
    shown = ReadKeyPair(tls.cert_file, "tls_cert", tls.key_file, "tls_key");
  } else {
    return grpc::SslCredentials(options);  // a fleet that asks no certificates
  }
  if (!shown.ok()) return shown.status();
  options.pem_cert_chain = std::move(shown->cert_chain);
  options.pem_private_key = std::move(shown->private_key);
  return grpc::SslCredentials(options);
}

absl::StatusOr<std::shared_ptr<const lane::TlsContext>> LaneTlsContext(const TlsConfig& tls) {
  if (!tls.enabled()) return nullptr;
  lane::TlsCredentials own;
  absl::StatusOr<KeyPair> pair = ReadKeyPair(tls.cert_file, "tls_cert", tls.key_file, "tls_key");
  if (!pair.ok()) return pair.status();
  own.cert_chain_pem = std::move(pair->cert_chain);
  own.private_key_pem = std::move(pair->private_key);
  if (!tls.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(tls.client_ca_file, "tls_client_ca");
    if (!ca.ok()) return ca.status();
    own.trusted_ca_pem = *std::move(ca);
  }
  absl::StatusOr<std::shared_ptr<const lane::TlsContext>> context =
      lane::TlsContext::ForServer(own);
  if (!context.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls_cert, tls_key or tls_client_ca: ", context.status().message()));
  }
  return context;
}

}  // namespace kvcache
