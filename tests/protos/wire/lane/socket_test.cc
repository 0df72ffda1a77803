// Listening, connecting with the preamble, and addresses that are refused.
#include "wire/lane/socket.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <string>

#include "gtest/gtest.h"
#include "wire/lane/frame_reader.h"

namespace kvcache::lane {
namespace {

TEST(LaneConnectTest, ListensOnAFreePortAndSendsThePreamble) {
  int port = 0;
  absl::StatusOr<int> listener = Listen("127.0.0.1:0", port);
  ASSERT_TRUE(listener.ok()) << listener.status();
  OwnedFd listening(*listener);
  EXPECT_GT(port, 0);
  absl::StatusOr<int> client = Connect("127.0.0.1:" + std::to_string(port), absl::Seconds(5));
  ASSERT_TRUE(client.ok()) << client.status();
  OwnedFd connected(*client);
  OwnedFd accepted(accept(listening.get(), nullptr, nullptr));
  FrameReader reader(accepted.get(), 1 << 20);
  absl::StatusOr<absl::Span<const std::byte>> magic = reader.ReadRaw(sizeof(kMagic));
  ASSERT_TRUE(magic.ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(magic->data()), magic->size()), "KVLANE02");

  EXPECT_TRUE(absl::IsInvalidArgument(Connect("no-port", absl::Seconds(1)).status()));
  EXPECT_FALSE(Listen("127.0.0.1:" + std::to_string(port), port).ok());  // taken
}

int IntOption(int fd, int level, int name) {
  int value = -1;
  socklen_t size = sizeof(value);
  EXPECT_EQ(getsockopt(fd, level, name, &value, &size), 0);
  return value;
}

// Whole seconds, rounded up, for the kernel's keepalive; milliseconds for
// the unacknowledged-data timeout.
TEST(LaneKeepaliveTest, SetsTheProbesAndTheTimeoutOfUnacknowledgedBytes) {
  int port = 0;
  absl::StatusOr<int> listener = Listen("127.0.0.1:0", port);
  ASSERT_TRUE(listener.ok()) << listener.status();
  OwnedFd listening(*listener);
  absl::StatusOr<int> client = Connect("127.0.0.1:" + std::to_string(port), absl::Seconds(5));
  ASSERT_TRUE(client.ok()) << client.status();
  OwnedFd connected(*client);
  EXPECT_EQ(IntOption(connected.get(), SOL_SOCKET, SO_KEEPALIVE), 0);

  ASSERT_TRUE(SetKeepalive(connected.get(), {.time = absl::Milliseconds(1500),
                                             .timeout = absl::Seconds(2)})
                  .ok());
  EXPECT_EQ(IntOption(connected.get(), SOL_SOCKET, SO_KEEPALIVE), 1);
  EXPECT_EQ(IntOption(connected.get(), IPPROTO_TCP, TCP_KEEPIDLE), 2);
  EXPECT_EQ(IntOption(connected.get(), IPPROTO_TCP, TCP_KEEPINTVL), 1);
  EXPECT_EQ(IntOption(connected.get(), IPPROTO_TCP, TCP_KEEPCNT), 3);
  EXPECT_EQ(IntOption(connected.get(), IPPROTO_TCP, TCP_USER_TIMEOUT), 3500);

  ASSERT_TRUE(SetKeepalive(connected.get(), {}).ok());  // the defaults: 30 s, 20 s
  EXPECT_EQ(IntOption(connected.get(), IPPROTO_TCP, TCP_KEEPIDLE), 30);
  EXPECT_EQ(IntOption(connected.get(), IPPROTO_TCP, TCP_KEEPINTVL), 7);
  EXPECT_EQ(IntOption(connected.get(), IPPROTO_TCP, TCP_USER_TIMEOUT), 50000);
  // The kernel's most, both ways.
  const Keepalive longest{.time = absl::Seconds(32767), .timeout = absl::Seconds(32767)};
  ASSERT_TRUE(longest.Validate().ok());
  ASSERT_TRUE(SetKeepalive(connected.get(), longest).ok());
  EXPECT_EQ(IntOption(connected.get(), IPPROTO_TCP, TCP_KEEPIDLE), 32767);
  EXPECT_EQ(IntOption(connected.get(), IPPROTO_TCP, TCP_USER_TIMEOUT), 65534000);

  EXPECT_FALSE(SetKeepalive(-1, {}).ok());
  const absl::Status no_time = Keepalive{.time = absl::ZeroDuration()}.Validate();
  EXPECT_TRUE(absl::IsInvalidArgument(no_time));
  EXPECT_NE(no_time.message().find("keepalive_time"), std::string::npos) << no_time;
  const absl::Status no_timeout = Keepalive{.timeout = absl::Seconds(-1)}.Validate();
  EXPECT_NE(no_timeout.message().find("keepalive_timeout"), std::string::npos) << no_timeout;
  for (const Keepalive& too_long : {Keepalive{.time = absl::Seconds(32768)},
                                    Keepalive{.timeout = absl::InfiniteDuration()}}) {
    EXPECT_TRUE(absl::IsInvalidArgument(too_long.Validate())) << too_long.Validate();
  }
  EXPECT_TRUE(absl::IsInvalidArgument(Keepalive{.time = absl::Microseconds(10)}.Validate()));
  EXPECT_TRUE(Keepalive{}.Validate().ok());
}

}  // namespace
}  // namespace kvcache::lane
