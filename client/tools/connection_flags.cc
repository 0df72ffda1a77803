#include "tools/connection_flags.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace kvcache {
namespace {

// The text of the PEM file `path` names; "" for no file.
absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  if (path.empty()) return std::string();
  std::ifstream in(path);
  std::stringstream text;
  if (in) text << in.rdbuf();
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read ", path));
  return text.str();
}

}  // namespace

absl::StatusOr<ClientOptions> ClientOptionsFrom(const ConnectionFlags& flags) {
  ClientOptions options{.address = flags.address, .token = flags.token};
  options.tls = flags.tls || !flags.tls_ca_file.empty();
  if (!options.tls) return options;
  absl::StatusOr<std::string> ca = ReadPem(flags.tls_ca_file, "tls_ca");
  absl::StatusOr<std::string> cert = ReadPem(flags.tls_cert_file, "tls_cert");
  absl::StatusOr<std::string> key = ReadPem(flags.tls_key_file, "tls_key");
  for (const auto* read : {&ca, &cert, &key}) {
    if (!read->ok()) return read->status();
  }
  options.tls_root_certs_pem = *ca;
  options.tls_client_cert_pem = *cert;
  options.tls_client_key_pem = *key;
  options.tls_server_name = flags.tls_server_name;
  return options;
}

std::string OrEnvironment(std::string value, const char* variable) {
  if (const char* from_env = std::getenv(variable); value.empty() && from_env != nullptr) {
    value = from_env;
  }
  return value;
}

}  // namespace kvcache
