// TLS for the gRPC port, and the rule for the data lane beside it. The lane
// has no TLS of its own yet, so it never carries what TLS protects by
// accident: with TLS on it is off unless plaintext is allowed explicitly,
// and a plaintext lane beyond loopback needs the same explicit flag.
#pragma once

#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

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

// Whether `host` (of a host:port) is a loopback address: 127/8, ::1, localhost.
bool IsLoopbackHost(const std::string& host);

}  // namespace kvcache
