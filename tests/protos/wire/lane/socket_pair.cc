#include "socket_pair.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

namespace kvcache::lane {

void SocketPairTest::SetUp() {
  if (GetParam() == Transport::kUnixPair) {
    int fds[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    near_ = OwnedFd(fds[0]);
    far_ = OwnedFd(fds[1]);
    return;
  }
  int port = 0;
  absl::StatusOr<int> listener = Listen("127.0.0.1:0", port);
  ASSERT_TRUE(listener.ok()) << listener.status();
  OwnedFd listening(*listener);
  absl::StatusOr<int> near = Connect("127.0.0.1:" + std::to_string(port), absl::ZeroDuration());
  ASSERT_TRUE(near.ok()) << near.status();
  near_ = OwnedFd(*near);
  far_ = OwnedFd(accept(listening.get(), nullptr, nullptr));
  ASSERT_GE(far_.get(), 0);
  const int one = 1;
  setsockopt(far_.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  char preamble[sizeof(kMagic)];  // Connect's, not part of any test's stream
  ASSERT_EQ(recv(far_.get(), preamble, sizeof(preamble), MSG_WAITALL), ssize_t{sizeof(preamble)});
}

void SocketPairTest::SetReceiveTimeout(std::chrono::milliseconds timeout) {
  const timeval tv{.tv_sec = static_cast<time_t>(timeout.count() / 1000),
                   .tv_usec = static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  ASSERT_EQ(setsockopt(near_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
}

void SocketPairTest::Feed(const std::string& bytes, size_t step) {
  for (size_t at = 0; at < bytes.size();) {
    const size_t n = step == 0 ? bytes.size() - at : std::min(step, bytes.size() - at);
    const ssize_t wrote = write(far_.get(), bytes.data() + at, n);
    ASSERT_GT(wrote, 0);
    at += static_cast<size_t>(wrote);
  }
}

std::string TransportName(const ::testing::TestParamInfo<Transport>& info) {
  return info.param == Transport::kUnixPair ? "UnixPair" : "TcpLoopback";
}

std::string Framed(int kind, const std::string& payload) {
  std::byte header[kHeaderBytes];
  EncodeHeader({.length = static_cast<uint32_t>(payload.size()), .kind = kind}, header);
  return std::string(reinterpret_cast<const char*>(header), kHeaderBytes) + payload;
}

std::string RandomBytes(size_t size, std::mt19937_64& rng) {
  std::string bytes(size, '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  return bytes;
}

std::string PayloadOf(const Frame& frame) {
  return std::string(reinterpret_cast<const char*>(frame.payload.data()), frame.payload.size());
}

std::string NextPayload(FrameReader& reader) {
  absl::StatusOr<Frame> frame = reader.Next();
  EXPECT_TRUE(frame.ok()) << frame.status();
  return frame.ok() ? PayloadOf(*frame) : std::string();
}

}  // namespace kvcache::lane
