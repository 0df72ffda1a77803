// The data lane's frames over a Unix socket pair and over loopback TCP (where
// the reader waits for large frames with SO_RCVLOWAT): headers both ways,
// frames that arrive many to a read or a byte at a time, payloads larger than
// the reader's buffer, sends the kernel takes in parts, and each way a
// connection can end.
#include "lane/frame_reader.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>

#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::lane {
namespace {

using ::testing::HasSubstr;

enum class Transport { kUnixPair, kTcpLoopback };

class LaneWireTest : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
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
  // A receive timeout on the near end, so that a reader that waits for bytes
  // which never come fails instead of hanging the test.
  void SetReceiveTimeout(std::chrono::milliseconds timeout) {
    const timeval tv{.tv_sec = static_cast<time_t>(timeout.count() / 1000),
                     .tv_usec = static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
    ASSERT_EQ(setsockopt(near_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
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

// The next frame's payload; a failure (and "") where it cannot be read.
std::string NextPayload(FrameReader& reader) {
  absl::StatusOr<Frame> frame = reader.Next();
  EXPECT_TRUE(frame.ok()) << frame.status();
  return frame.ok() ? PayloadOf(*frame) : std::string();
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
TEST_P(LaneWireTest, ReadsFramesWhateverCutsTheyArriveIn) {
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

TEST_P(LaneWireTest, PollReturnsOnlyWholeFramesWithoutWaiting) {
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

TEST_P(LaneWireTest, RefusesFramesOverTheLimit) {
  FrameReader reader(near_.get(), 100);
  Feed(Framed(v1::LANE_FRAME_UPDATE, std::string(101, 'x')));
  absl::StatusOr<Frame> frame = reader.Next();
  EXPECT_TRUE(absl::IsInvalidArgument(frame.status()));
  EXPECT_THAT(frame.status().message(), HasSubstr("101 bytes"));
}

TEST_P(LaneWireTest, TellsACleanEndFromOneWithinAFrame) {
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

TEST_P(LaneWireTest, ReceiveTimeoutIsDeadlineExceeded) {
  SetReceiveTimeout(std::chrono::milliseconds(50));
  FrameReader reader(near_.get(), 1 << 20);
  EXPECT_TRUE(absl::IsDeadlineExceeded(reader.Next().status()));
  // Also while the most of a large frame is still to come.
  Feed(Framed(v1::LANE_FRAME_UPDATE, std::string(600 << 10, 'x')).substr(0, 70 << 10));
  EXPECT_TRUE(absl::IsDeadlineExceeded(reader.Next().status()));
}

// A large frame whose bytes come in pieces with pauses between, then a frame
// far smaller than the large one's wait: both arrive whole, none waits for
// bytes that are not coming, and a close within a large frame is told. (A
// reader that waited for bytes that never come would sit out the receive
// timeout, after which a recv hands over what it has: the frames would still
// arrive, so the test looks at how long they took against that timeout.)
TEST_P(LaneWireTest, LargeFramesInPiecesThenSmallOnes) {
  const auto timeout = std::chrono::seconds(20);
  SetReceiveTimeout(timeout);
  std::mt19937_64 rng(3);
  FrameReader reader(near_.get(), 4 << 20);
  for (size_t large : {size_t{40 << 10}, size_t{300 << 10}, size_t{3 << 20}}) {
    SCOPED_TRACE(large);
    const std::string payload = RandomBytes(large, rng);
    const std::string stream = Framed(v1::LANE_FRAME_FETCH_CHUNK, payload) +
                               Framed(v1::LANE_FRAME_STATUS, "ok");
    // Half at once (so a read finds part of the frame there), then quarters.
    std::thread feeder([&] {
      const size_t quarter = stream.size() / 4;
      Feed(stream.substr(0, 2 * quarter));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      Feed(stream.substr(2 * quarter, quarter));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      Feed(stream.substr(3 * quarter));
    });
    const auto start = std::chrono::steady_clock::now();
    EXPECT_TRUE(NextPayload(reader) == payload);
    EXPECT_EQ(NextPayload(reader), "ok");
    EXPECT_LT(std::chrono::steady_clock::now() - start, timeout / 2)
        << "a read waited for bytes not coming";
    feeder.join();
  }
  Feed(Framed(v1::LANE_FRAME_FETCH_CHUNK, std::string(500 << 10, 'x')).substr(0, 200 << 10));
  far_ = OwnedFd();
  absl::StatusOr<Frame> frame = reader.Next();
  EXPECT_TRUE(absl::IsUnavailable(frame.status())) << frame.status();
  EXPECT_THAT(frame.status().message(), HasSubstr("within a frame"));
}

// A Fetch's chunks after its FETCH_LENGTH, in pieces with pauses between:
// every frame arrives whole, and the reader, waiting for many at once,
// never waits past what was promised (the STATUS after them comes too).
TEST_P(LaneWireTest, PromisedBytesArriveAsWholeFrames) {
  const auto timeout = std::chrono::seconds(20);
  SetReceiveTimeout(timeout);
  std::mt19937_64 rng(4);
  FrameReader reader(near_.get(), 4 << 20);
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    std::vector<std::string> payloads;
    std::string chunks;
    for (int i = 0; i < 12; ++i) {
      payloads.push_back(RandomBytes(i % 4 == 3 ? 5000 : (200 << 10) + rng() % 1000, rng));
      chunks += Framed(v1::LANE_FRAME_FETCH_CHUNK, payloads.back());
    }
    v1::LaneFetchLength length;
    length.set_chunk_frame_bytes(chunks.size());
    // Its announcement and the first bytes of its chunks in one write.
    const std::string head = Framed(v1::LANE_FRAME_FETCH_LENGTH, length.SerializeAsString());
    std::thread feeder([&] {
      Feed(head + chunks.substr(0, 70 << 10));
      for (size_t at = 70 << 10; at < chunks.size(); at += 300 << 10) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        Feed(chunks.substr(at, 300 << 10));
      }
      Feed(Framed(v1::LANE_FRAME_STATUS, "ok"));
    });
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<Frame> frame = reader.Next();
    ASSERT_TRUE(frame.ok()) << frame.status();
    ASSERT_EQ(frame->header.kind, v1::LANE_FRAME_FETCH_LENGTH);
    reader.Expect(length.chunk_frame_bytes());
    for (size_t i = 0; i < payloads.size(); ++i) {
      ASSERT_TRUE(NextPayload(reader) == payloads[i]) << "frame " << i;
    }
    EXPECT_EQ(NextPayload(reader), "ok");
    EXPECT_LT(std::chrono::steady_clock::now() - start, timeout / 2)
        << "a read waited for bytes not coming";
    feeder.join();
  }
}

// A peer that promised more than it sends: over TCP the reader waits for
// the promise (here until its receive timeout), and the peer's close ends
// the wait with every frame that did come. (A Unix socket's poll ignores
// SO_RCVLOWAT, so there it does not wait at all. The frames are small: TCP
// also wakes a reader whose receive window is nearly full.)
TEST_P(LaneWireTest, ABrokenPromiseWaitsUntilThePeerCloses) {
  SetReceiveTimeout(std::chrono::milliseconds(300));
  FrameReader reader(near_.get(), 4 << 20);
  const std::string payload(1000, 'c');
  Feed(Framed(v1::LANE_FRAME_FETCH_CHUNK, payload) + Framed(v1::LANE_FRAME_STATUS, "failed"));
  reader.Expect(1 << 20);
  absl::StatusOr<Frame> frame = reader.Next();
  if (GetParam() == Transport::kTcpLoopback) {
    EXPECT_TRUE(absl::IsDeadlineExceeded(frame.status())) << frame.status();
    far_ = OwnedFd();
    frame = reader.Next();
  }
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_TRUE(PayloadOf(*frame) == payload);
  EXPECT_EQ(NextPayload(reader), "failed");
  far_ = OwnedFd();
  EXPECT_TRUE(absl::IsOutOfRange(reader.Next().status()));
}

// A small send buffer makes the kernel take each send in parts: every byte
// of every part (copied or referenced) still arrives, in order.
TEST_P(LaneWireTest, WriterSendsEverythingThroughPartialSends) {
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
TEST_P(LaneWireTest, SendingToAClosedPeerIsUnavailable) {
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

INSTANTIATE_TEST_SUITE_P(Transports, LaneWireTest,
                         ::testing::Values(Transport::kUnixPair, Transport::kTcpLoopback),
                         [](const ::testing::TestParamInfo<Transport>& info) {
                           return info.param == Transport::kUnixPair ? "UnixPair" : "TcpLoopback";
                         });

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
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(magic->data()), magic->size()), "KVLANE02");

  EXPECT_TRUE(absl::IsInvalidArgument(Connect("no-port", absl::Seconds(1)).status()));
  EXPECT_FALSE(Listen("127.0.0.1:" + std::to_string(port), port).ok());  // taken
}

}  // namespace
}  // namespace kvcache::lane
