// How the command-line tools (kvcachectl, the demo, the service benches)
// turn their connection flags into ClientOptions, in one place. Each binary
// declares its own absl flags and hands their values over in a
// ConnectionFlags, so this library reads no flags itself.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "kvcache_client.h"

namespace kvcache {

// The values of a tool's --server (or --address), --token and --tls* flags.
struct ConnectionFlags {
  std::string address;
  std::string token;
  // TLS trusting the system's CAs; a tls_ca_file implies TLS too.
  bool tls = false;
  // PEM files: the CA bundle to trust, and a client certificate and its key
  // for mutual TLS. Empty: none.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
};

// The ClientOptions the flags describe, the PEM files read (ClientOptions
// holds their text); the rest of the options keep their defaults.
// INVALID_ARGUMENT naming the flag (--tls_ca, --tls_cert, --tls_key) for a
// file that cannot be read.
absl::StatusOr<ClientOptions> ClientOptionsFrom(const ConnectionFlags& flags);

// `value`, or where it is empty the environment variable's (a token there
// stays out of the process list, where other users could read a flag).
std::string OrEnvironment(std::string value, const char* variable);

}  // namespace kvcache
