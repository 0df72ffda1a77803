// Reading frames over a Unix socket pair and over loopback TCP (where the
// reader waits for large frames with SO_RCVLOWAT): frames that arrive many to
// a read or a byte at a time, payloads larger than the reader's buffer, and
// each way a connection can end.
#include "wire/lane/frame_reader.h"

#include <chrono>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "socket_pair.h"

namespace kvcache::lane {
namespace {

using ::testing::HasSubstr;

using FrameReaderTest = SocketPairTest;

// All at once, a byte per write, and in odd cuts; mostly small frames, and
// (but for the byte-a-write round) some far larger than the reader's buffer.
TEST_P(FrameReaderTest, ReadsFramesWhateverCutsTheyArriveIn) {
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

TEST_P(FrameReaderTest, PollReturnsOnlyWholeFramesWithoutWaiting) {
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

// A peer that closes with part of a frame sent broke it: UNAVAILABLE, as
// from Next, not the OUT_OF_RANGE of a close between frames.
TEST_P(FrameReaderTest, PollSaysAPeerThatClosedWithinAFrameBrokeIt) {
  FrameReader reader(near_.get(), 1 << 20);
  Feed(Framed(v1::LANE_FRAME_UPDATE_ACK, "ack!").substr(0, 7));
  absl::StatusOr<std::optional<Frame>> polled = reader.Poll();
  ASSERT_TRUE(polled.ok());
  EXPECT_FALSE(polled->has_value());
  far_ = OwnedFd();
  EXPECT_TRUE(absl::IsUnavailable(reader.Poll().status()));
}

TEST_P(FrameReaderTest, RefusesFramesOverTheLimit) {
  FrameReader reader(near_.get(), 100);
  Feed(Framed(v1::LANE_FRAME_UPDATE, std::string(101, 'x')));
  absl::StatusOr<Frame> frame = reader.Next();
  EXPECT_TRUE(absl::IsInvalidArgument(frame.status()));
  EXPECT_THAT(frame.status().message(), HasSubstr("101 bytes"));
}

TEST_P(FrameReaderTest, TellsACleanEndFromOneWithinAFrame) {
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

TEST_P(FrameReaderTest, ReceiveTimeoutIsDeadlineExceeded) {
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
TEST_P(FrameReaderTest, LargeFramesInPiecesThenSmallOnes) {
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
TEST_P(FrameReaderTest, PromisedBytesArriveAsWholeFrames) {
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
TEST_P(FrameReaderTest, ABrokenPromiseWaitsUntilThePeerCloses) {
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

// A header check refuses a frame from its 8 header bytes: the payload is
// never read (it is still in the socket), and frames it lets through are
// read as ever; without the check the same frame would be read whole.
TEST_P(FrameReaderTest, AHeaderCheckRefusesAFrameBeforeItsPayloadIsRead) {
  FrameReader reader(near_.get(), 64 << 20);
  reader.set_header_check([](const FrameHeader& header) {
    return header.length <= 16 ? absl::OkStatus()
                               : absl::UnauthenticatedError("too long before AUTH");
  });
  const std::string small = Framed(v1::LANE_FRAME_AUTH, "token");
  const std::string large = Framed(v1::LANE_FRAME_UPDATE, std::string(1 << 20, 'x'));
  std::thread feeder([&] { Feed(small + large.substr(0, 16 << 10)); });
  absl::StatusOr<Frame> first = reader.Next();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(PayloadOf(*first), "token");
  const absl::StatusOr<Frame> refused = reader.Next();
  feeder.join();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  EXPECT_EQ(reader.bytes_received(), small.size() + kHeaderBytes)
      << "read past the refused frame's header";
}

INSTANTIATE_TEST_SUITE_P(Transports, FrameReaderTest,
                         ::testing::Values(Transport::kUnixPair, Transport::kTcpLoopback),
                         TransportName);

}  // namespace
}  // namespace kvcache::lane
