// The one loopback rule (wire/net/address.h), as every flag that asks it
// (the lane's plaintext gate, KV-event endpoints, etcd listings) now does.
#include "wire/net/address.h"

#include <string>

#include "gtest/gtest.h"

namespace kvcache::net {
namespace {

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
