// Host names as both ends of kvcached judge them: which hosts are loopback
// (reachable only from this machine), the one rule every flag and listing
// that cares uses.
#pragma once

#include <string>

namespace kvcache::net {

// "localhost" exactly, an IPv4 literal in 127.0.0.0/8, or the IPv6 loopback
// ::1 (bracketed or not). Names are not resolved: "127.example.com" is not
// loopback, and neither is an IPv4-mapped "::ffff:127.0.0.1".
bool IsLoopbackHost(const std::string& host);

}  // namespace kvcache::net
