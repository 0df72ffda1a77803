// A connected pair of stream sockets for the frame reader and writer tests:
// a Unix socket pair, or loopback TCP (where the reader waits for large
// frames with SO_RCVLOWAT), with helpers that feed bytes from the far end.
#pragma once

#include <chrono>
#include <cstddef>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "wire/lane/frame.h"
#include "wire/lane/frame_reader.h"
#include "wire/lane/socket.h"

namespace kvcache::lane {

enum class Transport { kUnixPair, kTcpLoopback };

class SocketPairTest : public ::testing::TestWithParam<Transport> {
 protected:
  // Connects near_ and far_ afresh (tests call it again for a second pair).
  void SetUp() override;
  // A receive timeout on the near end, so that a reader that waits for bytes
  // which never come fails instead of hanging the test.
  void SetReceiveTimeout(std::chrono::milliseconds timeout);
  // Writes `bytes` to the far end, `step` bytes per write (0: all at once).
  void Feed(const std::string& bytes, size_t step = 0);

  OwnedFd near_;
  OwnedFd far_;
};

// The name of a SocketPairTest instantiation's parameter.
std::string TransportName(const ::testing::TestParamInfo<Transport>& info);

// `payload` behind a frame header of `kind`.
std::string Framed(int kind, const std::string& payload);
std::string RandomBytes(size_t size, std::mt19937_64& rng);
std::string PayloadOf(const Frame& frame);
// The next frame's payload; a failure (and "") where it cannot be read.
std::string NextPayload(FrameReader& reader);

}  // namespace kvcache::lane
