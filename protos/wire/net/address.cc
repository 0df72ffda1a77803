#include "wire/net/address.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <optional>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvcache::net {
namespace {

// The most bytes of a refused address that its message quotes.
constexpr size_t kMostQuoted = 64;

// ZeroMQ's spelling of every interface: a wildcard host that is neither a
// name nor a literal.
constexpr char kAnyInterface[] = "*";

std::string WithoutBrackets(const std::string& host) {
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    return host.substr(1, host.size() - 2);
  }
  return host;
}

bool IsNameOrIpv4(absl::string_view host) {
  return !host.empty() && absl::c_all_of(host, [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_';
  });
}

// The host part of host:port without its brackets; none where it is neither
// a name, an IPv4 literal, a bracketed IPv6 literal nor a wildcard.
std::optional<std::string> ParseHost(absl::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    std::string bare(host.substr(1, host.size() - 2));
    in6_addr v6;
    if (inet_pton(AF_INET6, bare.c_str(), &v6) != 1) return std::nullopt;
    return bare;
  }
  if (host.empty() || host == kAnyInterface || IsNameOrIpv4(host)) return std::string(host);
  return std::nullopt;
}

// The port's number; none where `digits` is not 1 to 5 decimal digits of at
// most 65535 (absl::SimpleAtoi would take a sign and spaces).
std::optional<int> ParsePort(absl::string_view digits) {
  if (digits.empty() || digits.size() > 5) return std::nullopt;
  int port = 0;
  for (const char digit : digits) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(digit))) return std::nullopt;
    port = port * 10 + (digit - '0');
  }
  if (port > 65535) return std::nullopt;
  return port;
}

absl::Status NotHostPort(absl::string_view text, absl::string_view field) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": \"", text.substr(0, kMostQuoted),
                                                 "\" is not host:port (e.g. 127.0.0.1:50051)"));
}

absl::Status OnlyToListen(absl::string_view text, absl::string_view field) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": \"", text.substr(0, kMostQuoted),
                   "\" names no host and port to connect to (a wildcard host and port 0 are "
                   "for listening only)"));
}

}  // namespace

std::string HostPort::ToString() const {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<HostPort> ParseHostPort(absl::string_view text, absl::string_view field,
                                       AddressUse use) {
  // The last colon: a bracketed IPv6 host holds colons of its own.
  const size_t colon = text.rfind(':');
  if (colon == absl::string_view::npos) return NotHostPort(text, field);
  std::optional<std::string> host = ParseHost(text.substr(0, colon));
  const std::optional<int> port = ParsePort(text.substr(colon + 1));
  if (!host.has_value() || !port.has_value()) return NotHostPort(text, field);
  if (use == AddressUse::kConnect && (*port == 0 || IsWildcardHost(*host))) {
    return OnlyToListen(text, field);
  }
  return HostPort{.host = *std::move(host), .port = *port};
}

bool IsLoopbackHost(const std::string& host) {
  if (host == "localhost") return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  return inet_pton(AF_INET6, WithoutBrackets(host).c_str(), &v6) == 1 &&
         IN6_IS_ADDR_LOOPBACK(&v6);
}

bool IsWildcardHost(const std::string& host) {
  if (host.empty() || host == kAnyInterface) return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return v4.s_addr == htonl(INADDR_ANY);
  in6_addr v6;
  return inet_pton(AF_INET6, WithoutBrackets(host).c_str(), &v6) == 1 &&
         IN6_IS_ADDR_UNSPECIFIED(&v6);
}

}  // namespace kvcache::net
