// A client's first call (ClientOptions::first_connect_wait): made before its
// server listens, it waits for the connection and goes through; against a
// server that never comes it fails after the wait, and without a wait it
// fails at once, as every call does once the channel has connected.
#include <netinet/in.h>
#include <sys/socket.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "e2e_test_util.h"
#include "gtest/gtest.h"
#include "wire/lane/socket.h"

namespace kvcache::testing {
namespace {

// A loopback port nothing listens on now.
int UnusedLoopbackPort() {
  lane::OwnedFd fd(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in address{.sin_family = AF_INET, .sin_port = 0, .sin_addr = {htonl(INADDR_LOOPBACK)}};
  EXPECT_EQ(bind(fd.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  socklen_t length = sizeof(address);
  EXPECT_EQ(getsockname(fd.get(), reinterpret_cast<sockaddr*>(&address), &length), 0);
  return ntohs(address.sin_port);
}

// Reconnecting every 200 ms at most: gRPC's own backoff (1 s, growing 1.6x)
// could put its next attempt past the wait on a slow machine.
std::unique_ptr<Client> ConnectTo(const std::string& address, absl::Duration first_connect_wait) {
  return Client::Connect({.address = address,
                          .dedicated_connection = true,
                          .max_reconnect_backoff = absl::Milliseconds(200),
                          .first_connect_wait = first_connect_wait});
}

const v1::CacheSpec kSpec = ToWireSpec(MakeSpec({StandardLayerSpec(1, 8)}));

TEST(E2eClientConnectTest, AClientMadeBeforeItsServerListensGetsItsFirstCallThrough) {
  const std::string address = absl::StrCat("127.0.0.1:", UnusedLoopbackPort());
  std::unique_ptr<Client> failing_fast = ConnectTo(address, absl::ZeroDuration());
  std::unique_ptr<Client> waiting = ConnectTo(address, absl::Seconds(10));
  // Without a wait a create is not sent: nothing listens yet.
  const absl::Time start = absl::Now();
  EXPECT_EQ(failing_fast->CreateCache(kSpec).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));

  std::unique_ptr<TestServer> server;
  std::thread starter([&] {
    absl::SleepFor(absl::Milliseconds(300));
    server = TestServer::Start({.data_lane = false, .listen = address});
  });
  absl::StatusOr<v1::CacheInfo> cache = waiting->CreateCache(kSpec);
  starter.join();
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(cache.ok()) << cache.status();
  absl::StatusOr<std::vector<v1::CacheInfo>> caches = waiting->ListCaches();
  ASSERT_TRUE(caches.ok()) << caches.status();
  EXPECT_EQ(caches->size(), 1u) << "created once";
  EXPECT_TRUE(waiting->DeleteCache(cache->cache_id()).ok());
  server->CleanUpAndCheck();
}

TEST(E2eClientConnectTest, AServerThatNeverComesFailsTheFirstCallAfterTheWait) {
  const std::string address = absl::StrCat("127.0.0.1:", UnusedLoopbackPort());
  std::unique_ptr<Client> client = ConnectTo(address, absl::Milliseconds(500));
  const absl::Time start = absl::Now();
  EXPECT_EQ(client->CreateCache(kSpec).status().code(), absl::StatusCode::kUnavailable);
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(450));
  EXPECT_LT(took, absl::Seconds(5));
}

}  // namespace
}  // namespace kvcache::testing
