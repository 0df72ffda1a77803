#include "wire/lane/frame_reader.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "wire/lane/socket.h"

namespace kvcache::lane {
namespace {

// A read asks for at least this much, so small frames come many per call.
constexpr size_t kGreedyRead = 128 << 10;
constexpr size_t kInitialCapacity = 256 << 10;
// A read that still needs at least kLowWaterFloor bytes of a frame, or is
// promised that many (Expect), first waits in poll() with the socket's
// SO_RCVLOWAT at that many (at most kLowWaterCap), so the kernel wakes it
// once they are all there instead of once per arriving segment or frame: on
// loopback every wake-up costs the sending side an inter-processor
// interrupt. (A blocking recv cannot wait this way: the kernel measures the
// low-water mark against the bytes not yet copied, so a recv that copied
// part of a frame could sleep forever.)
constexpr size_t kLowWaterFloor = 32 << 10;
constexpr size_t kLowWaterCap = 1 << 20;
constexpr size_t kPromisedCapacity = 2 * kLowWaterCap;

// The socket's receive timeout in milliseconds, -1 for none (poll's forever).
int ReceiveTimeoutMs(int fd) {
  timeval tv{};
  socklen_t size = sizeof(tv);
  if (getsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, &size) != 0) return -1;
  const int64_t ms = int64_t{tv.tv_sec} * 1000 + (tv.tv_usec + 999) / 1000;
  return ms == 0 ? -1 : static_cast<int>(std::min<int64_t>(ms, INT32_MAX));
}

}  // namespace

FrameReader::FrameReader(int fd, uint64_t max_payload, TlsSession* tls)
    : fd_(fd),
      tls_(tls != nullptr && !tls->kernel_receives() ? tls : nullptr),
      max_payload_(max_payload),
      receive_timeout_ms_(ReceiveTimeoutMs(fd)),
      buffer_(new std::byte[kInitialCapacity]),
      capacity_(kInitialCapacity) {}

bool FrameReader::HasBufferedFrame() const {
  const size_t start = start_ + consumed_;
  if (end_ - start < kHeaderBytes) return false;
  return end_ - start >= kHeaderBytes + DecodeHeader(buffer_.get() + start).length;
}

absl::Status FrameReader::Fill(size_t bytes) {
  if (end_ - start_ >= bytes) return absl::OkStatus();
  if (start_ == end_) start_ = end_ = 0;
  Reserve(start_ + bytes - end_);  // the frame lands contiguous
  if (tls_ != nullptr) return FillThroughTls(bytes);
  while (end_ - start_ < bytes) {
    const size_t need = start_ + bytes - end_;
    // Bytes sure to come: the rest of this frame, or more that were promised
    // as far as the buffer has room for them where they land.
    const size_t promised = static_cast<size_t>(std::min<uint64_t>(promised_, capacity_ - end_));
    const size_t awaited = std::min(std::max(need, promised), kLowWaterCap);
    // No read-ahead while a header check is set: a peer not yet trusted gets
    // no more of its bytes read than the frame it is on.
    size_t want = std::min(capacity_ - end_, header_check_ ? need : std::max(need, kGreedyRead));
    int flags = 0;
    if (awaited >= kLowWaterFloor) {
      absl::Status ready = AwaitReadable(awaited);
      if (!ready.ok()) return ready;
      flags = MSG_DONTWAIT;
      // Whatever else is there, the next frame's start too.
      if (!header_check_) want = capacity_ - end_;
    } else {
      SetLowWater(1);  // a blocking recv returns once this much is there
    }
    const ssize_t got = recv(fd_, buffer_.get() + end_, want, flags);
    if (got > 0) {
      Received(static_cast<size_t>(got));
    } else if (got == 0) {
      return Closed();
    } else if (errno != EINTR && !(flags == MSG_DONTWAIT && WouldBlock(errno))) {
      return SocketError("receive");  // else interrupted, or poll's readiness went to nothing
    }
  }
  return absl::OkStatus();
}

absl::Status FrameReader::FillThroughTls(size_t bytes) {
  while (end_ - start_ < bytes) {
    const size_t want = header_check_ ? start_ + bytes - end_ : capacity_ - end_;
    absl::StatusOr<size_t> got = tls_->Read(buffer_.get() + end_, want);
    if (!got.ok()) return got.status();
    if (*got == 0) return Closed();
    Received(*got);
  }
  return absl::OkStatus();
}

absl::Status FrameReader::Closed() const {
  if (end_ == start_) return absl::OutOfRangeError("data lane: the peer closed the connection");
  return absl::UnavailableError("data lane: the peer closed the connection within a frame");
}

absl::Status FrameReader::ReadAvailable() {
  if (tls_ != nullptr) {
    pollfd readable{.fd = fd_, .events = POLLIN, .revents = 0};
    if (!tls_->HasBuffered() && poll(&readable, 1, 0) <= 0) return absl::OkStatus();
    absl::StatusOr<std::optional<size_t>> got =
        tls_->ReadWithoutWaiting(buffer_.get() + end_, capacity_ - end_);
    if (!got.ok()) return got.status();
    if (!got->has_value()) return absl::OkStatus();  // part of a record so far
    if (**got == 0) return Closed();
    Received(**got);
    return absl::OkStatus();
  }
  const ssize_t got = recv(fd_, buffer_.get() + end_, capacity_ - end_, MSG_DONTWAIT);
  if (got > 0) {
    Received(static_cast<size_t>(got));
  } else if (got == 0) {
    return Closed();
  } else if (!WouldBlock(errno) && errno != EINTR) {
    return SocketError("receive");
  }
  return absl::OkStatus();
}

void FrameReader::Reserve(size_t room) {
  if (capacity_ - end_ >= room) return;
  const size_t unread = end_ - start_;
  if (unread + room > capacity_) return Regrow(std::max(unread + room, 2 * capacity_));
  std::memmove(buffer_.get(), buffer_.get() + start_, unread);
  start_ = 0;
  end_ = unread;
}

void FrameReader::Regrow(size_t capacity) {
  const size_t unread = end_ - start_;
  std::unique_ptr<std::byte[]> grown(new std::byte[capacity]);
  std::memcpy(grown.get(), buffer_.get() + start_, unread);
  buffer_ = std::move(grown);
  capacity_ = capacity;
  start_ = 0;
  end_ = unread;
}

void FrameReader::Received(size_t bytes) {
  end_ += bytes;
  bytes_received_ += bytes;
  promised_ -= std::min<uint64_t>(promised_, bytes);
}

void FrameReader::Expect(uint64_t bytes) {
  const size_t buffered = end_ - (start_ + consumed_);  // past the frame last returned
  promised_ = bytes > buffered ? bytes - buffered : 0;
  // Room for the frame being read and the longest wait's bytes after it.
  if (promised_ >= kLowWaterFloor && capacity_ < kPromisedCapacity) Regrow(kPromisedCapacity);
}

absl::Status FrameReader::AwaitReadable(size_t bytes) {
  SetLowWater(bytes);
  pollfd readable{.fd = fd_, .events = POLLIN, .revents = 0};
  const int ready = poll(&readable, 1, receive_timeout_ms_);
  if (ready == 0) return absl::DeadlineExceededError("data lane: receive timed out");
  if (ready < 0 && errno != EINTR) return SocketError("poll");
  return absl::OkStatus();  // errors and the peer's close show in the recv that follows
}

void FrameReader::SetLowWater(size_t bytes) {
  if (bytes == low_water_) return;
  const int value = static_cast<int>(bytes);
  // Best effort: where it fails, reads wake on every segment as before.
  if (setsockopt(fd_, SOL_SOCKET, SO_RCVLOWAT, &value, sizeof(value)) == 0) low_water_ = bytes;
}

absl::StatusOr<absl::Span<const std::byte>> FrameReader::ReadRaw(size_t bytes) {
  start_ += consumed_;
  consumed_ = 0;
  if (absl::Status status = Fill(bytes); !status.ok()) return status;
  consumed_ = bytes;
  return absl::Span<const std::byte>(buffer_.get() + start_, bytes);
}

absl::StatusOr<Frame> FrameReader::Next() {
  start_ += consumed_;
  consumed_ = 0;
  if (absl::Status status = Fill(kHeaderBytes); !status.ok()) return status;
  const FrameHeader header = DecodeHeader(buffer_.get() + start_);
  if (header_check_) {
    if (absl::Status checked = header_check_(header); !checked.ok()) return checked;
  }
  if (header.length > max_payload_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data lane: a frame of ", header.length, " bytes is over the limit of ", max_payload_,
        " (max_message_bytes)"));
  }
  if (absl::Status status = Fill(kHeaderBytes + header.length); !status.ok()) return status;
  consumed_ = kHeaderBytes + header.length;
  return Frame{header, {buffer_.get() + start_ + kHeaderBytes, header.length}};
}

absl::StatusOr<std::optional<Frame>> FrameReader::Poll() {
  start_ += consumed_;
  consumed_ = 0;
  if (start_ == end_) {
    start_ = end_ = 0;
  } else if (capacity_ - end_ < kGreedyRead) {
    std::memmove(buffer_.get(), buffer_.get() + start_, end_ - start_);
    end_ -= start_;
    start_ = 0;
  }
  if (!HasBufferedFrame() && end_ < capacity_ && !header_check_) {
    if (absl::Status status = ReadAvailable(); !status.ok()) return status;
  }
  // A frame only partly here (or one past the space left) waits for Next.
  if (!HasBufferedFrame()) return std::nullopt;
  absl::StatusOr<Frame> frame = Next();
  if (!frame.ok()) return frame.status();
  return std::optional<Frame>(*frame);
}

}  // namespace kvcache::lane
