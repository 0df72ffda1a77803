// The peer list's parsing (service/peers.h): name=host:port entries with
// replica names, each once, and never this replica's own name.
#include "service/peers.h"

#include <grpcpp/security/credentials.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::service {
namespace {

using ::testing::HasSubstr;

TEST(PeersTest, ParsesNamedAddresses) {
  absl::StatusOr<std::map<std::string, std::string>> peers =
      ParsePeerList(" a=10.0.0.1:50051, b-1=kvcached-1.kvcached:50051 ,c=[::1]:7", "peers");
  ASSERT_TRUE(peers.ok()) << peers.status();
  EXPECT_EQ(*peers,
            (std::map<std::string, std::string>{
                {"a", "10.0.0.1:50051"}, {"b-1", "kvcached-1.kvcached:50051"}, {"c", "[::1]:7"}}));
  EXPECT_TRUE(ParsePeerList("", "peers").value().empty());
}

TEST(PeersTest, RefusesEntriesThatAreNotNamedAddresses) {
  // An address is host:port only: no other gRPC target (a unix socket, a
  // resolver's scheme) can be named, nor a port out of range.
  for (const char* bad :
       {"10.0.0.1:50051", "a=", "=10.0.0.1:1", "a/b=h:1", "a=h:1,a=h:2", "a=unix:/tmp/socket",
        "a=dns:///h:1", "a=h", "a=h:0", "a=h:65536", "a=h:x"}) {
    absl::StatusOr<std::map<std::string, std::string>> peers = ParsePeerList(bad, "peers");
    EXPECT_EQ(peers.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(peers.status().message(), HasSubstr("peers")) << bad;
  }
}

// The fleet's one list serves every replica: each skips its own name.
TEST(PeersTest, SkipsItsOwnName) {
  const auto make = [](std::map<std::string, std::string> listed) {
    return Peers::Make({.self = "a",
                        .listed = std::move(listed),
                        .credentials = grpc::InsecureChannelCredentials()})
        .value();
  };
  EXPECT_TRUE(make({{"a", "127.0.0.1:1"}})->empty());
  EXPECT_FALSE(make({{"a", "127.0.0.1:1"}, {"b", "127.0.0.1:2"}})->empty());
}

}  // namespace
}  // namespace kvcache::service
