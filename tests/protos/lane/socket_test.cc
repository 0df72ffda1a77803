// Listening, connecting with the preamble, and addresses that are refused.
#include "lane/socket.h"

#include <sys/socket.h>

#include <string>

#include "gtest/gtest.h"
#include "lane/frame_reader.h"

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

}  // namespace
}  // namespace kvcache::lane
