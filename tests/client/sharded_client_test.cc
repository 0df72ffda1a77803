// The fleet client's parts that need no server: rendezvous ordering (a
// permutation, the same in every process, balanced, and moving only a lost
// replica's keys) and the --peers syntax. tests/e2e/e2e_fleet_test.cc
// runs the fleet itself.
#include "sharded_client.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "rendezvous.h"

namespace kvcache {
namespace {

const std::vector<std::string> kNames = {"kvcached-0", "kvcached-1", "kvcached-2"};

TEST(RendezvousTest, OrderIsAPermutationThatDependsOnTheKeyAndNames) {
  std::set<std::vector<size_t>> orders;
  for (int i = 0; i < 200; ++i) {
    const std::vector<size_t> order = RendezvousOrder(absl::StrCat("key", i), kNames);
    ASSERT_EQ(order.size(), kNames.size());
    EXPECT_EQ(std::set<size_t>(order.begin(), order.end()).size(), kNames.size());
    EXPECT_EQ(order, RendezvousOrder(absl::StrCat("key", i), kNames)) << "not deterministic";
    orders.insert(order);
  }
  EXPECT_EQ(orders.size(), 6u) << "every order of three replicas occurs";
  // Listed in another order, the replicas rank the same (by name, not place).
  const std::vector<std::string> shuffled = {kNames[2], kNames[0], kNames[1]};
  for (int i = 0; i < 50; ++i) {
    const std::string key = absl::StrCat("key", i);
    EXPECT_EQ(shuffled[RendezvousOrder(key, shuffled)[0]], kNames[RendezvousOrder(key, kNames)[0]]);
  }
}

TEST(RendezvousTest, KeysSpreadEvenlyAndALostReplicaMovesOnlyItsOwn) {
  constexpr int kKeys = 30000;
  std::map<size_t, int> owners;
  const std::vector<std::string> two = {kNames[0], kNames[2]};
  for (int i = 0; i < kKeys; ++i) {
    const std::string key = absl::StrCat("cache", i);
    const std::vector<size_t> order = RendezvousOrder(key, kNames);
    ++owners[order[0]];
    // Without kvcached-1, each key goes to the first of the others in its order.
    const size_t next = order[0] == 1 ? order[1] : order[0];
    EXPECT_EQ(two[RendezvousOrder(key, two)[0]], kNames[next]) << key;
  }
  for (const auto& [replica, count] : owners) {
    EXPECT_NEAR(count, kKeys / 3, kKeys / 3 * 0.05) << "replica " << replica;
  }
}

TEST(ParsePeersTest, NamedPlainAndDnsEntries) {
  absl::StatusOr<std::vector<Replica>> peers =
      ParsePeers("kvcached-0=10.0.0.1:50051, 10.0.0.2:50051,dns:localhost:7000");
  ASSERT_TRUE(peers.ok()) << peers.status();
  ASSERT_GE(peers->size(), 3u);
  EXPECT_EQ((*peers)[0].name, "kvcached-0");
  EXPECT_EQ((*peers)[0].address, "10.0.0.1:50051");
  EXPECT_EQ((*peers)[1].name, "");
  EXPECT_EQ((*peers)[1].address, "10.0.0.2:50051");
  for (size_t i = 2; i < peers->size(); ++i) {
    EXPECT_TRUE((*peers)[i].address == "127.0.0.1:7000" || (*peers)[i].address == "[::1]:7000")
        << (*peers)[i].address;
  }
}

TEST(ParsePeersTest, RefusalsNameTheField) {
  for (const char* bad : {"", "a:b=127.0.0.1:1", "name=", "dns:localhost", "dns:localhost:0",
                          "dns:no-such-host.invalid:50051"}) {
    absl::StatusOr<std::vector<Replica>> peers = ParsePeers(bad);
    EXPECT_FALSE(peers.ok()) << bad;
    EXPECT_NE(peers.status().message().find("peers"), absl::string_view::npos) << peers.status();
  }
}

TEST(ShardedClientTest, ConnectRefusesWhatCannotWork) {
  EXPECT_EQ(ShardedClient::Connect({}).status().code(), absl::StatusCode::kInvalidArgument);
  ShardedClientOptions lane{.replicas = {{.name = "a", .address = "127.0.0.1:1"}},
                            .client = {.data_lane = "127.0.0.1:2"}};
  EXPECT_EQ(ShardedClient::Connect(lane).status().code(), absl::StatusCode::kInvalidArgument);
  // One address for several replicas is a proxy's, and only named ones can share it.
  ShardedClientOptions twice{
      .replicas = {{.name = "a", .address = "127.0.0.1:1"}, {.address = "127.0.0.1:1"}}};
  EXPECT_EQ(ShardedClient::Connect(twice).status().code(), absl::StatusCode::kInvalidArgument);
  twice.replicas = {{.address = "127.0.0.1:1"}, {.name = "b", .address = "127.0.0.1:1"}};
  EXPECT_EQ(ShardedClient::Connect(twice).status().code(), absl::StatusCode::kInvalidArgument);
  ShardedClientOptions proxied{.replicas = {{.name = "a", .address = "127.0.0.1:1"},
                                            {.name = "b", .address = "127.0.0.1:1"}},
                               .connect_timeout = absl::Seconds(1)};
  EXPECT_TRUE(ShardedClient::Connect(proxied).ok()) << "named replicas behind a proxy (down)";
  // A replica that does not answer must be named, or its ids could not be routed.
  ShardedClientOptions nameless{.replicas = {{.address = "127.0.0.1:1"}},
                                .connect_timeout = absl::Seconds(2)};
  EXPECT_EQ(ShardedClient::Connect(nameless).status().code(), absl::StatusCode::kUnavailable);
  // A named one that is down is fine: it is passed over until it answers.
  ShardedClientOptions down{.replicas = {{.name = "a", .address = "127.0.0.1:1"}},
                            .connect_timeout = absl::Seconds(2)};
  absl::StatusOr<std::unique_ptr<ShardedClient>> fleet = ShardedClient::Connect(down);
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  EXPECT_EQ((*fleet)->CreateCache(v1::CacheSpec()).status().code(), absl::StatusCode::kUnavailable);
}

// A loopback port whose kernel accepts connections that nobody ever answers:
// a replica that hangs. Returns the socket (close it after) and its port.
std::pair<int, int> SilentPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      listen(fd, 16) != 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    return {-1, 0};
  }
  return {fd, ntohs(address.sin_port)};
}

TEST(ShardedClientTest, ReplicasThatHangAreDownAndAskedAtOnce) {
  std::vector<int> sockets;
  const absl::Cleanup closed = [&sockets] {
    for (int fd : sockets) close(fd);
  };
  std::vector<Replica> replicas;
  for (int i = 0; i < 4; ++i) {
    const auto [fd, port] = SilentPort();
    ASSERT_GE(fd, 0);
    sockets.push_back(fd);
    replicas.push_back({.name = absl::StrCat("r", i), .address = absl::StrCat("127.0.0.1:", port)});
  }
  // Connects to the first `count` replicas; returns how long it took.
  auto connect = [&](size_t count) -> absl::StatusOr<absl::Duration> {
    const absl::Time start = absl::Now();
    absl::StatusOr<std::unique_ptr<ShardedClient>> fleet = ShardedClient::Connect(
        {.replicas = std::vector<Replica>(replicas.begin(), replicas.begin() + count),
         .connect_timeout = absl::Seconds(1)});
    if (!fleet.ok()) return fleet.status();
    EXPECT_EQ((*fleet)->size(), count);
    return absl::Now() - start;
  };
  // Named replicas that time out are down, as refused ones are.
  const absl::StatusOr<absl::Duration> one = connect(1);
  ASSERT_TRUE(one.ok()) << one.status();
  const absl::StatusOr<absl::Duration> four = connect(4);
  ASSERT_TRUE(four.ok()) << four.status();
  // Asked at once: four take about as long as one, not four times as long.
  EXPECT_LT(*four, 2 * *one + absl::Milliseconds(500))
      << "one replica: " << *one << ", four: " << *four;
}

}  // namespace
}  // namespace kvcache
