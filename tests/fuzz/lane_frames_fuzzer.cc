// The data lane's frame reader as a server meets it: any bytes a client may
// send arrive over a socket (in whatever pieces the kernel hands over), the
// preamble is read, then frames until the reader refuses one or the bytes
// end; each frame's payload is parsed as the message its kind names. The
// reader must never read past its buffer, never return a frame longer than
// its limit, and never loop.
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "kvcache/v1/kvcache.pb.h"
#include "wire/lane/frame.h"
#include "wire/lane/frame_reader.h"

namespace {

constexpr uint64_t kMaxPayload = 1 << 16;

void ParsePayload(const kvcache::lane::Frame& frame) {
  const void* data = frame.payload.data();
  const int size = static_cast<int>(frame.payload.size());
  switch (frame.header.kind) {
    case kvcache::v1::LANE_FRAME_AUTH: {
      kvcache::v1::LaneAuth auth;
      (void)auth.ParseFromArray(data, size);
      break;
    }
    case kvcache::v1::LANE_FRAME_UPDATE: {
      kvcache::v1::UpdateRequest request;
      (void)request.ParseFromArray(data, size);
      break;
    }
    case kvcache::v1::LANE_FRAME_FETCH: {
      kvcache::v1::FetchRequest request;
      (void)request.ParseFromArray(data, size);
      break;
    }
    default:
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // More than a socket buffer would block the write below (one thread).
  if (size > (100 << 10)) return 0;
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) std::abort();
  const timeval timeout{.tv_sec = 5, .tv_usec = 0};
  setsockopt(fds[0], SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  for (size_t sent = 0; sent < size;) {
    const ssize_t wrote = write(fds[1], data + sent, size - sent);
    if (wrote <= 0) std::abort();
    sent += static_cast<size_t>(wrote);
  }
  shutdown(fds[1], SHUT_WR);
  {
    kvcache::lane::FrameReader reader(fds[0], kMaxPayload);
    if (reader.ReadRaw(sizeof(kvcache::lane::kMagic)).ok()) {
      // Alternate the blocking and the polling read, as the session does.
      for (int i = 0;; ++i) {
        absl::StatusOr<kvcache::lane::Frame> frame = reader.Next();
        if (!frame.ok()) break;
        if (frame->payload.size() > kMaxPayload) std::abort();
        ParsePayload(*frame);
        if (i % 2 == 1) {
          absl::StatusOr<std::optional<kvcache::lane::Frame>> polled = reader.Poll();
          if (!polled.ok()) break;
          if (polled->has_value()) ParsePayload(**polled);
        }
      }
    }
    if (reader.bytes_received() > size) std::abort();
  }
  close(fds[0]);
  close(fds[1]);
  return 0;
}
