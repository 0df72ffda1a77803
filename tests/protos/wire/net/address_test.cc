// The one host:port parser and the loopback and wildcard rules
// (wire/net/address.h), as every flag, listing and server address that
// names a host now uses them.
#include "wire/net/address.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::net {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

struct AddressCase {
  const char* text;
  bool listen;   // ParseHostPort takes it for AddressUse::kListen
  bool connect;  // and for AddressUse::kConnect
  // Where it parses: the host without brackets, the port, IsLoopbackHost(host).
  const char* host = "";
  int port = 0;
  bool loopback = false;
};

constexpr bool kYes = true;
constexpr bool kNo = false;

const AddressCase kAddresses[] = {
    // text                        listen  connect host                   port   loopback
    {"127.0.0.1:50051",            kYes,   kYes,   "127.0.0.1",           50051, kYes},
    {"127.1.2.3:1",                kYes,   kYes,   "127.1.2.3",           1,     kYes},
    {"10.0.0.1:65535",             kYes,   kYes,   "10.0.0.1",            65535, kNo},
    {"localhost:80",               kYes,   kYes,   "localhost",           80,    kYes},
    {"kvcached-1.kvcached:50051",  kYes,   kYes,   "kvcached-1.kvcached", 50051, kNo},
    {"under_score.example:7",      kYes,   kYes,   "under_score.example", 7,     kNo},
    // A name that starts like an address is a name, not loopback.
    {"127.example.com:80",         kYes,   kYes,   "127.example.com",     80,    kNo},
    {"[::1]:80",                   kYes,   kYes,   "::1",                 80,    kYes},
    {"[0:0:0:0:0:0:0:1]:80",       kYes,   kYes,   "0:0:0:0:0:0:0:1",     80,    kYes},
    {"[::ffff:127.0.0.1]:80",      kYes,   kYes,   "::ffff:127.0.0.1",    80,    kNo},
    {"[2001:db8::7]:443",          kYes,   kYes,   "2001:db8::7",         443,   kNo},
    // Only to listen: any free port, every interface.
    {"127.0.0.1:0",                kYes,   kNo,    "127.0.0.1",           0,     kYes},
    {"0.0.0.0:50051",              kYes,   kNo,    "0.0.0.0",             50051, kNo},
    {"[::]:50051",                 kYes,   kNo,    "::",                  50051, kNo},
    {"*:5557",                     kYes,   kNo,    "*",                   5557,  kNo},
    {":80",                        kYes,   kNo,    "",                    80,    kNo},
    {"[::]:0",                     kYes,   kNo,    "::",                  0,     kNo},
    // The port: 1 to 5 decimal digits, at most 65535, nothing else.
    {"127.0.0.1:65536",            kNo,    kNo},
    {"127.0.0.1:123456",           kNo,    kNo},
    {"127.0.0.1:+80",              kNo,    kNo},
    {"127.0.0.1:-1",               kNo,    kNo},
    {"127.0.0.1: 80",              kNo,    kNo},
    {"127.0.0.1:80 ",              kNo,    kNo},
    {"127.0.0.1:8o",               kNo,    kNo},
    {"127.0.0.1:0x50",             kNo,    kNo},
    {"127.0.0.1",                  kNo,    kNo},
    {"127.0.0.1:",                 kNo,    kNo},
    {"host:",                      kNo,    kNo},
    {"localhost:*",                kNo,    kNo},
    // The host: a name, an IPv4 literal or a bracketed IPv6 literal.
    {"::1:80",                     kNo,    kNo},
    {"::1",                        kNo,    kNo},
    {"[::1]",                      kNo,    kNo},
    {"[::1]:",                     kNo,    kNo},
    {"[::1:80",                    kNo,    kNo},
    {"::1]:80",                    kNo,    kNo},
    {"[[::1]]:80",                 kNo,    kNo},
    {"[]:80",                      kNo,    kNo},
    {"[127.0.0.1]:80",             kNo,    kNo},
    {"[localhost]:80",             kNo,    kNo},
    {"[*]:80",                     kNo,    kNo},
    {"[fe80::1%eth0]:80",          kNo,    kNo},
    {" 127.0.0.1:80",              kNo,    kNo},
    {"h:1:2",                      kNo,    kNo},
    {"**:80",                      kNo,    kNo},
    // No other gRPC target, URL or socket path.
    {"unix:/tmp/socket",           kNo,    kNo},
    {"dns:///h:1",                 kNo,    kNo},
    {"http://h:1",                 kNo,    kNo},
    {"user@h:1",                   kNo,    kNo},
    {"h:1/v3",                     kNo,    kNo},
    {"",                           kNo,    kNo},
    {":",                          kNo,    kNo},
};

TEST(ParseHostPortTest, OneTableForListeningAndConnecting) {
  for (const AddressCase& address : kAddresses) {
    for (const AddressUse use : {AddressUse::kListen, AddressUse::kConnect}) {
      const bool listen = use == AddressUse::kListen;
      const std::string context = absl::StrCat("\"", address.text, "\" to ",
                                               listen ? "listen" : "connect");
      absl::StatusOr<HostPort> parsed = ParseHostPort(address.text, "field", use);
      ASSERT_EQ(parsed.ok(), listen ? address.listen : address.connect)
          << context << ": " << parsed.status();
      if (!parsed.ok()) {
        EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << context;
        EXPECT_THAT(std::string(parsed.status().message()),
                    StartsWith(absl::StrCat("field: \"", address.text, "\"")))
            << context;
        continue;
      }
      EXPECT_EQ(parsed->host, address.host) << context;
      EXPECT_EQ(parsed->port, address.port) << context;
      EXPECT_EQ(IsLoopbackHost(parsed->host), address.loopback) << context;
      EXPECT_EQ(parsed->ToString(), address.text) << context << ": printed back";
    }
  }
}

TEST(ParseHostPortTest, RefusalsSayWhyAndQuoteAtMost64Bytes) {
  absl::StatusOr<HostPort> garbled = ParseHostPort("x", "listen", AddressUse::kListen);
  EXPECT_EQ(garbled.status().message(), "listen: \"x\" is not host:port (e.g. 127.0.0.1:50051)");
  absl::StatusOr<HostPort> any_port = ParseHostPort("h:0", "peers", AddressUse::kConnect);
  EXPECT_THAT(std::string(any_port.status().message()), StartsWith("peers: \"h:0\" names no host"));
  EXPECT_THAT(any_port.status().message(), HasSubstr("for listening only"));

  const std::string long_host(200, 'a');
  absl::StatusOr<HostPort> long_text =
      ParseHostPort(long_host + ":x", "advertise_address", AddressUse::kConnect);
  EXPECT_THAT(std::string(long_text.status().message()),
              StartsWith(absl::StrCat("advertise_address: \"", std::string(64, 'a'), "\" is")));
}

TEST(IsWildcardHostTest, EveryInterfaceInEachSpelling) {
  for (const char* host : {"", "*", "0.0.0.0", "::", "[::]", "0:0:0:0:0:0:0:0"}) {
    EXPECT_TRUE(IsWildcardHost(host)) << host;
  }
  for (const char* host : {"127.0.0.1", "localhost", "::1", "[::1]", "0", "0.0.0.0.example",
                           "[*]", "**", "[[::]]", "example.com"}) {
    EXPECT_FALSE(IsWildcardHost(host)) << host;
  }
}

TEST(IsLoopbackHostTest, OnlyAddressesOfThisMachine) {
  for (const char* host : {"localhost", "127.0.0.1", "127.1.2.3", "127.255.255.255", "::1",
                           "[::1]", "[0:0:0:0:0:0:0:1]"}) {
    EXPECT_TRUE(IsLoopbackHost(host)) << host;
  }
  // Names are not resolved, and a name that starts like an address is a name.
  for (const char* host : {"127.example.com", "LOCALHOST", "localhost.", "", "0.0.0.0", "::",
                           "[::]", "10.0.0.1", "128.0.0.1", "[::ffff:127.0.0.1]", "[::1",
                           "::1]", "[[::1]]", "example.com"}) {
    EXPECT_FALSE(IsLoopbackHost(host)) << host;
  }
}

}  // namespace
}  // namespace kvcache::net
