// The peer list (fleet/peers.h): name=host:port entries with replica
// names, each once, and never this replica's own name; lookups in it, and
// an etcd list that is not there yet.
#include "fleet/peers.h"

#include <grpcpp/security/credentials.h>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
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

TEST(PeersTest, FindsListedPeersAndNamesTheListThatLacksOne) {
  std::unique_ptr<Peers> peers = Peers::Make({.self = "a",
                                              .listed = {{"b", "127.0.0.1:2"}},
                                              .credentials = grpc::InsecureChannelCredentials()})
                                     .value();
  EXPECT_TRUE(peers->Find("b").ok());
  const absl::Status missing = peers->Find("c").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_THAT(missing.message(), HasSubstr("--peers"));
}

// etcd away: the replica starts at once (its --peers still serve), a name
// only etcd could list is UNAVAILABLE until its list is read, and the
// watch that keeps trying stops with the replica.
TEST(PeersTest, AnEtcdThatIsAwayHoldsUpNothing) {
  absl::Time start = absl::Now();
  std::unique_ptr<Peers> peers = Peers::Make({.self = "a",
                                              .listed = {{"b", "127.0.0.1:2"}},
                                              .etcd = {.endpoints = "127.0.0.1:1"},
                                              .credentials = grpc::InsecureChannelCredentials()})
                                     .value();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "Make waited for etcd (a read waits 5 s)";
  EXPECT_FALSE(peers->empty());
  EXPECT_TRUE(peers->Find("b").ok());
  absl::Status unread = peers->Find("c").status();
  EXPECT_EQ(unread.code(), absl::StatusCode::kUnavailable) << unread;
  EXPECT_THAT(unread.message(), HasSubstr("not read the fleet's list from etcd yet"));
  // Once a read has failed, the answer says why.
  for (const absl::Time deadline = absl::Now() + absl::Seconds(10);
       absl::Now() < deadline && !absl::StrContains(unread.message(), "etcd at 127.0.0.1:1");
       absl::SleepFor(absl::Milliseconds(20))) {
    unread = peers->Find("c").status();
  }
  EXPECT_THAT(unread.message(), HasSubstr("etcd at 127.0.0.1:1")) << unread;
  start = absl::Now();
  peers.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "the watch did not stop with the replica";
}

}  // namespace
}  // namespace kvcache::service
