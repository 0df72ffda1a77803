// The data lane's wire (kvcache.proto, LaneFrameKind): frame headers and the
// socket reads and writes both ends share. The server (service/data_lane.h)
// and the client library each build their calls on these.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcache::lane {

// What a client sends first on a connection: the current version, whose
// Fetch calls announce their length (FETCH_LENGTH) and which the server
// answers with the same 8 bytes, and the first, which it still serves.
inline constexpr char kMagic[8] = {'K', 'V', 'L', 'A', 'N', 'E', '0', '2'};
inline constexpr char kMagicV1[8] = {'K', 'V', 'L', 'A', 'N', 'E', '0', '1'};
inline constexpr size_t kHeaderBytes = 8;

struct FrameHeader {
  uint32_t length = 0;  // payload bytes
  int kind = 0;         // a v1::LaneFrameKind, as received
};

void EncodeHeader(const FrameHeader& header, std::byte out[kHeaderBytes]);
FrameHeader DecodeHeader(const std::byte in[kHeaderBytes]);

// A frame as read: its header and payload, valid until the next read.
struct Frame {
  FrameHeader header;
  absl::Span<const std::byte> payload;
};

// Reads frames from a socket through one buffer, so small frames arrive many
// to a system call and a large one's payload lands contiguous. Blocking.
class FrameReader {
 public:
  // Frames longer than `max_payload` are refused (INVALID_ARGUMENT). The
  // socket's receive timeout (SO_RCVTIMEO) must be set before.
  FrameReader(int fd, uint64_t max_payload);

  // Whether a whole frame is already buffered (Next will not block).
  bool HasBufferedFrame() const;
  // The next `bytes` raw bytes (the connection's preamble).
  absl::StatusOr<absl::Span<const std::byte>> ReadRaw(size_t bytes);
  // The next frame. OUT_OF_RANGE when the peer closed the connection between
  // frames; UNAVAILABLE when it closed or failed within one;
  // DEADLINE_EXCEEDED when the socket's receive timeout passed.
  absl::StatusOr<Frame> Next();
  // The next frame if it is buffered or arrives whole without waiting, else
  // nullopt; errors as Next.
  absl::StatusOr<std::optional<Frame>> Poll();
  // The peer promises `bytes` more bytes after the frame last returned (a
  // Fetch's FETCH_LENGTH), so reads may wait for many frames at once; a peer
  // that breaks the promise must close the connection. 0 withdraws it. The
  // last frame's payload may move: read it before.
  void Expect(uint64_t bytes);

 private:
  // Makes `bytes` bytes past start_ available, reading as needed.
  absl::Status Fill(size_t bytes);
  // At least `room` bytes free after end_, moving the unread bytes to the
  // front or into a larger buffer.
  void Reserve(size_t room);
  // A buffer of `capacity` bytes holding the unread ones at its front.
  void Regrow(size_t capacity);
  // `bytes` more were received.
  void Received(size_t bytes);
  // Waits until `bytes` can be read without blocking, or the peer closed or
  // failed (DEADLINE_EXCEEDED past the receive timeout).
  absl::Status AwaitReadable(size_t bytes);
  // The socket's SO_RCVLOWAT, set only when it changes.
  void SetLowWater(size_t bytes);

  int fd_;
  uint64_t max_payload_;
  int receive_timeout_ms_;  // the socket's SO_RCVTIMEO when the reader was made; -1: none
  std::unique_ptr<std::byte[]> buffer_;
  size_t capacity_ = 0;
  size_t start_ = 0;  // the first unread byte
  size_t end_ = 0;    // one past the last received byte
  size_t consumed_ = 0;  // bytes of the last returned frame, dropped on the next read
  size_t low_water_ = 1;
  uint64_t promised_ = 0;  // bytes the peer promised that are not received yet
};

// Frames queued for sending; Send writes them all in one system call where
// it can. Parts added by reference must stay unchanged until Send returns.
class FrameWriter {
 public:
  explicit FrameWriter(int fd) : fd_(fd) {}

  // A frame whose payload is `message`, serialized into the writer's buffer.
  void AddMessage(v1::LaneFrameKind kind, const google::protobuf::MessageLite& message);
  // A frame's header, its payload to follow as `length` bytes of Add* calls.
  void AddHeader(v1::LaneFrameKind kind, uint32_t length);
  // Bytes copied into the writer's buffer.
  void AddCopy(absl::Span<const std::byte> bytes);
  // Bytes sent from where they lie.
  void AddReference(absl::Span<const std::byte> bytes);
  bool empty() const { return parts_.empty(); }
  // Writes everything queued, then forgets it.
  absl::Status Send();

 private:
  struct Part {
    bool owned;        // in owned_ at [offset, offset + size), else at data
    size_t offset;
    const std::byte* data;
    size_t size;
  };

  int fd_;
  std::string owned_;
  std::vector<Part> parts_;
  std::vector<iovec> iov_;  // Send's, kept to spare an allocation per send
};

// A v1::LaneStatus frame's payload as an absl::Status, and back.
absl::Status StatusFromLane(const v1::LaneStatus& status);
v1::LaneStatus LaneStatusOf(const absl::Status& status);

// A connected TCP socket to host:port, with TCP_NODELAY, `preamble` (8
// bytes) sent, and send / receive timeouts of `timeout` (0: none). The
// caller closes it.
absl::StatusOr<int> Connect(const std::string& address, absl::Duration timeout,
                            absl::string_view preamble = {kMagic, sizeof(kMagic)});
// A listening TCP socket on host:port (port 0: any free one); `port` is set
// to the port bound.
absl::StatusOr<int> Listen(const std::string& address, int& port);

// Closes a file descriptor when it goes out of scope.
class OwnedFd {
 public:
  OwnedFd() = default;
  explicit OwnedFd(int fd) : fd_(fd) {}
  OwnedFd(OwnedFd&& other) noexcept : fd_(other.release()) {}
  OwnedFd& operator=(OwnedFd&& other) noexcept;
  ~OwnedFd();
  int get() const { return fd_; }
  int release();

 private:
  int fd_ = -1;
};

}  // namespace kvcache::lane
