// Reading the data lane's frames from a blocking socket.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "wire/lane/frame.h"
#include "wire/lane/tls.h"

namespace kvcache::lane {

// Reads frames from a socket through one buffer, so small frames arrive many
// to a system call and a large one's payload lands contiguous. Blocking.
class FrameReader {
 public:
  // Frames longer than `max_payload` are refused (INVALID_ARGUMENT). The
  // socket's receive timeout (SO_RCVTIMEO) must be set before. With `tls`
  // (which must outlive the reader) the socket carries TLS records: where
  // the kernel decrypts them, reads are as in plaintext; else OpenSSL reads.
  FrameReader(int fd, uint64_t max_payload, TlsSession* tls = nullptr);

  // Asked of each frame's header before any of its payload is read: a
  // failure is what Next (or Poll) returns, the payload left unread. While
  // one is set, reads take only the bytes the frame needs, none ahead: a
  // peer not yet trusted (before it authenticates) makes the reader hold no
  // more than one small frame. Empty: every frame within max_payload.
  using HeaderCheck = std::function<absl::Status(const FrameHeader&)>;
  void set_header_check(HeaderCheck check) { header_check_ = std::move(check); }

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
  // Bytes read from the socket since the reader was made.
  uint64_t bytes_received() const { return bytes_received_; }

 private:
  // Makes `bytes` bytes past start_ available, reading as needed.
  absl::Status Fill(size_t bytes);
  // Fill's reads where OpenSSL decrypts: no low-water waits (the socket's
  // bytes are records, not frames), each read as much as OpenSSL has.
  absl::Status FillThroughTls(size_t bytes);
  // Poll's look without waiting: whatever the socket or OpenSSL has now.
  absl::Status ReadAvailable();
  // The peer closed: OUT_OF_RANGE between frames, else UNAVAILABLE.
  absl::Status Closed() const;
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
  TlsSession* tls_;  // null for plaintext and where the kernel decrypts
  uint64_t max_payload_;
  HeaderCheck header_check_;
  int receive_timeout_ms_;  // the socket's SO_RCVTIMEO when the reader was made; -1: none
  std::unique_ptr<std::byte[]> buffer_;
  size_t capacity_ = 0;
  size_t start_ = 0;  // the first unread byte
  size_t end_ = 0;    // one past the last received byte
  size_t consumed_ = 0;  // bytes of the last returned frame, dropped on the next read
  size_t low_water_ = 1;
  uint64_t bytes_received_ = 0;
  uint64_t promised_ = 0;  // bytes the peer promised that are not received yet
};

}  // namespace kvcache::lane
