// The data lane's frames over a socket pair: headers both ways, frames that
// arrive many to a read or a byte at a time, payloads larger than the
// reader's buffer, sends the kernel takes in parts, and each way a
// connection can end.
#include "kvcache/v1/lane_wire.h"

#include <sys/socket.h>
#include <unistd.h>

#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::lane {
namespace {

using ::testing::HasSubstr;

class LaneWireTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int fds[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    near_ = OwnedFd(fds[0]);
    far_ = OwnedFd(fds[1]);
  }
  // Writes `bytes` to the far end, `step` bytes per write (0: all at once).
  void Feed(const std::string& bytes, size_t step = 0) {
    for (size_t at = 0; at < bytes.size();) {
      const size_t n = step == 0 ? bytes.size() - at : std::min(step, bytes.size() - at);
      const ssize_t wrote = write(far_.get(), bytes.data() + at, n);
      ASSERT_GT(wrote, 0);
      at += static_cast<size_t>(wrote);
    }
  }

  OwnedFd near_;
  OwnedFd far_;
};

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

TEST(LaneHeaderTest, RoundTripsAndRefusesReservedBytes) {
  std::byte header[kHeaderBytes];
  EncodeHeader({.length = 0x01020304, .kind = v1::LANE_FRAME_FETCH_CHUNK}, header);
  EXPECT_EQ(std::to_integer<int>(header[0]), 0x04);  // little-endian
  EXPECT_EQ(std::to_integer<int>(header[3]), 0x01);
  const FrameHeader decoded = DecodeHeader(header);
  EXPECT_EQ(decoded.length, 0x01020304u);
  EXPECT_EQ(decoded.kind, v1::LANE_FRAME_FETCH_CHUNK);
  header[6] = std::byte{1};
  EXPECT_EQ(DecodeHeader(header).kind, -1);
}

// All at once, a byte per write, and in odd cuts; mostly small frames, and
// (but for the byte-a-write round) some far larger than the reader's buffer.
TEST_F(LaneWireTest, ReadsFramesWhateverCutsTheyArriveIn) {
  std::mt19937_64 rng(1);
  for (size_t step : {size_t{0}, size_t{1}, size_t{4093}}) {
    SCOPED_TRACE(step);
    SetUp();  // a fresh socket pair
    std::vector<std::string> payloads;
    std::string stream;
    for (int i = 0; i < (step == 1 ? 40 : 300); ++i) {
      const size_t size = step != 1 && i % 50 == 7 ? (600 << 10) + i : rng() % 3000;
      payloads.push_back(RandomBytes(size, rng));
      stream += Framed(v1::LANE_FRAME_UPDATE, payloads.back());
    }
    FrameReader reader(near_.get(), 1 << 20);
    std::thread feeder([&] { Feed(stream, step); });
    for (size_t i = 0; i < payloads.size(); ++i) {
      absl::StatusOr<Frame> frame = reader.Next();
      ASSERT_TRUE(frame.ok()) << frame.status();
      EXPECT_EQ(frame->header.kind, v1::LANE_FRAME_UPDATE);
      ASSERT_TRUE(PayloadOf(*frame) == payloads[i]) << "frame " << i;
    }
    feeder.join();
  }
}

TEST_F(LaneWireTest, PollReturnsOnlyWholeFramesWithoutWaiting) {
  FrameReader reader(near_.get(), 1 << 20);
  absl::StatusOr<std::optional<Frame>> polled = reader.Poll();
  ASSERT_TRUE(polled.ok());
  EXPECT_FALSE(polled->has_value());
  const std::string frame = Framed(v1::LANE_FRAME_UPDATE_ACK, "ack!");
  Feed(frame.substr(0, 5));
  polled = reader.Poll();
  ASSERT_TRUE(polled.ok());
  EXPECT_FALSE(polled->has_value());
  Feed(frame.substr(5) + Framed(v1::LANE_FRAME_STATUS, "done"));
  polled = reader.Poll();
  ASSERT_TRUE(polled.ok() && polled->has_value());
  EXPECT_EQ(PayloadOf(**polled), "ack!");
  polled = reader.Poll();
  ASSERT_TRUE(polled.ok() && polled->has_value());
  EXPECT_EQ((*polled)->header.kind, v1::LANE_FRAME_STATUS);
  far_ = OwnedFd();
  EXPECT_TRUE(absl::IsOutOfRange(reader.Poll().status()));
}

TEST_F(LaneWireTest, RefusesFramesOverTheLimit) {
  FrameReader reader(near_.get(), 100);
  Feed(Framed(v1::LANE_FRAME_UPDATE, std::string(101, 'x')));
  absl::StatusOr<Frame> frame = reader.Next();
  EXPECT_TRUE(absl::IsInvalidArgument(frame.status()));
  EXPECT_THAT(frame.status().message(), HasSubstr("101 bytes"));
}

TEST_F(LaneWireTest, TellsACleanEndFromOneWithinAFrame) {
  FrameReader reader(near_.get(), 1 << 20);
  Feed(Framed(v1::LANE_FRAME_UPDATE, "whole"));
  ASSERT_TRUE(reader.Next().ok());
  far_ = OwnedFd();
  EXPECT_TRUE(absl::IsOutOfRange(reader.Next().status()));

  SetUp();
  FrameReader cut(near_.get(), 1 << 20);
  Feed(Framed(v1::LANE_FRAME_UPDATE, "whole").substr(0, 10));
  far_ = OwnedFd();
  absl::StatusOr<Frame> frame = cut.Next();
  EXPECT_TRUE(absl::IsUnavailable(frame.status()));
  EXPECT_THAT(frame.status().message(), HasSubstr("within a frame"));
}

TEST_F(LaneWireTest, ReceiveTimeoutIsDeadlineExceeded) {
  const timeval timeout{.tv_sec = 0, .tv_usec = 50000};
  setsockopt(near_.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  FrameReader reader(near_.get(), 1 << 20);
  EXPECT_TRUE(absl::IsDeadlineExceeded(reader.Next().status()));
}

// A small send buffer makes the kernel take each send in parts: every byte
// of every part (copied or referenced) still arrives, in order.
TEST_F(LaneWireTest, WriterSendsEverythingThroughPartialSends) {
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

TEST_F(LaneWireTest, SendingToAClosedPeerIsUnavailable) {
  far_ = OwnedFd();
  FrameWriter writer(near_.get());
  writer.AddHeader(v1::LANE_FRAME_UPDATE_END, 0);
  const absl::Status status = writer.Send();
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_TRUE(writer.empty());
}

TEST(LaneStatusTest, CarriesCodeAndMessage) {
  const absl::Status status = absl::NotFoundError("cache_id: no cache");
  EXPECT_EQ(StatusFromLane(LaneStatusOf(status)), status);
  EXPECT_TRUE(StatusFromLane(LaneStatusOf(absl::OkStatus())).ok());
}

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
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(magic->data()), magic->size()), "KVLANE01");

  EXPECT_TRUE(absl::IsInvalidArgument(Connect("no-port", absl::Seconds(1)).status()));
  EXPECT_FALSE(Listen("127.0.0.1:" + std::to_string(port), port).ok());  // taken
}

}  // namespace
}  // namespace kvcache::lane
