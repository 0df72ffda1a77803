// Writing frames over a Unix socket pair and over loopback TCP: sends the
// kernel takes in parts, and a peer that is gone.
#include "wire/lane/frame_writer.h"

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "socket_pair.h"

namespace kvcache::lane {
namespace {

using FrameWriterTest = SocketPairTest;

// A small send buffer makes the kernel take each send in parts: every byte
// of every part (copied or referenced) still arrives, in order.
TEST_P(FrameWriterTest, WriterSendsEverythingThroughPartialSends) {
  const int small = 4096;
  setsockopt(near_.get(), SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  std::mt19937_64 rng(2);
  const std::string referenced = RandomBytes(300 << 10, rng);
  v1::LaneStatus status;
  status.set_code(3);
  status.set_message("a message");
  std::string expected;
  FrameWriter writer(near_.get());
  for (int i = 0; i < 40; ++i) {
    writer.AddMessage(v1::LANE_FRAME_STATUS, status);
    expected += Framed(v1::LANE_FRAME_STATUS, status.SerializeAsString());
  }
  writer.AddHeader(v1::LANE_FRAME_UPDATE, static_cast<uint32_t>(referenced.size() + 3));
  writer.AddCopy({reinterpret_cast<const std::byte*>("abc"), 3});
  writer.AddReference({reinterpret_cast<const std::byte*>(referenced.data()), referenced.size()});
  expected += Framed(v1::LANE_FRAME_UPDATE, "abc" + referenced);

  std::string received;
  std::thread reader([&] {
    char buffer[8192];
    while (received.size() < expected.size()) {
      const ssize_t got = read(far_.get(), buffer, sizeof(buffer));
      if (got <= 0) break;
      received.append(buffer, static_cast<size_t>(got));
    }
  });
  ASSERT_TRUE(writer.Send().ok());
  EXPECT_TRUE(writer.empty());
  reader.join();
  EXPECT_TRUE(received == expected);
}

// Over TCP the first send after the peer's close may still be taken (the
// peer's reset comes back to it); the one after that is refused.
TEST_P(FrameWriterTest, SendingToAClosedPeerIsUnavailable) {
  far_ = OwnedFd();
  FrameWriter writer(near_.get());
  writer.AddHeader(v1::LANE_FRAME_UPDATE_END, 0);
  absl::Status status = writer.Send();
  EXPECT_TRUE(writer.empty());
  if (GetParam() == Transport::kTcpLoopback && status.ok()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    writer.AddHeader(v1::LANE_FRAME_UPDATE_END, 0);
    status = writer.Send();
  }
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
}

INSTANTIATE_TEST_SUITE_P(Transports, FrameWriterTest,
                         ::testing::Values(Transport::kUnixPair, Transport::kTcpLoopback),
                         TransportName);

}  // namespace
}  // namespace kvcache::lane
