// Host names and host:port as both ends of kvcached judge them: the one
// parser of every host:port a flag, a listing or a server gives, and which
// hosts are loopback (reachable only from this machine) or wildcards.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcache::net {

// What an address is for. Listening takes two things connecting cannot:
// a wildcard host (every interface) and port 0 (any free port, which the
// listener then reports).
enum class AddressUse { kListen, kConnect };

// host:port, parsed. The one rule (ParseHostPort):
// - host: a DNS name or an IPv4 literal (letters, digits, '.', '-', '_'; a
//   name that looks like an address is a name: nothing is resolved here), or
//   an IPv6 literal in brackets ("[::1]", no zone: "[fe80::1%eth0]" is
//   refused). An IPv6 literal without brackets is refused: in "::1:80" the
//   port cannot be told from the address.
// - port: 1 to 5 decimal digits, nothing else (no sign, no spaces), at most
//   65535.
// - only to listen: port 0, and a wildcard host (IsWildcardHost: empty,
//   "*", 0.0.0.0, [::]). Each listener passes the text on to its library,
//   and one that does not know a spelling ("*" is ZeroMQ's, an empty host is
//   getaddrinfo's) fails to listen there, as an unknown name does.
struct HostPort {
  std::string host;  // without brackets
  int port = 0;

  // host:port again, an IPv6 host in brackets.
  std::string ToString() const;
  bool operator==(const HostPort&) const = default;
};

// `text` as host:port for `use`, or INVALID_ARGUMENT naming `field` and
// quoting at most 64 bytes of `text`.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view text, absl::string_view field,
                                       AddressUse use);

// "localhost" exactly, an IPv4 literal in 127.0.0.0/8, or the IPv6 loopback
// ::1 (bracketed or not). Names are not resolved: "127.example.com" is not
// loopback, and neither is an IPv4-mapped "::ffff:127.0.0.1".
bool IsLoopbackHost(const std::string& host);

// A host that means every interface of this machine: empty, "*", the IPv4
// 0.0.0.0 or the IPv6 :: (bracketed or not). Only a listener can use one; a
// client given one by a server reaches that server at the host it already
// knows.
bool IsWildcardHost(const std::string& host);

}  // namespace kvcache::net
