// TLS for the gRPC port (grpc++'s credentials) and the data lane beside it
// (OpenSSL's, wire/lane/tls.h), from the same files: the lane is no way around
// what TLS protects, and mutual TLS asks its connections for the same
// certificates. A plaintext lane beyond loopback needs an explicit flag.
#pragma once

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "wire/lane/tls.h"

namespace kvcache {

struct TlsConfig {
  std::string cert_file;       // PEM certificate chain; empty: plaintext gRPC
  std::string key_file;        // PEM private key of cert_file
  std::string client_ca_file;  // PEM CA bundle: set, clients must present a certificate it signed
  bool enabled() const { return !cert_file.empty(); }
};

// grpc++'s own TLS credentials from the files (INVALID_ARGUMENT naming the
// flag of a file that cannot be read), or insecure ones without a cert.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> GrpcServerCredentials(
    const TlsConfig& tls);

// What this replica shows and trusts when it calls its peers; each empty:
// what its own TLS uses (GrpcPeerCredentials).
struct PeerTlsConfig {
  std::string ca_file;    // PEM CA of the peers' certificates
  std::string cert_file;  // PEM client certificate chain, for fleets whose PKI
  std::string key_file;   // keeps server and client certificates apart
};

// How this replica calls its peers (PullSnapshot): plaintext where it serves
// plaintext; else TLS trusting peer.ca_file (empty: tls.client_ca_file, the
// fleet's CA where it asks clients for certificates; else the system's
// roots), presenting peer.cert_file where given, else its own server
// certificate where it asks clients for one (a fleet with mutual TLS asks
// its peers too). INVALID_ARGUMENT naming the flag of a file that cannot be
// read, or of half a pair.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> GrpcPeerCredentials(
    const TlsConfig& tls, const PeerTlsConfig& peer);

// The data lane's TLS from the same files: null where TLS is off.
absl::StatusOr<std::shared_ptr<const lane::TlsContext>> LaneTlsContext(const TlsConfig& tls);

}  // namespace kvcache
