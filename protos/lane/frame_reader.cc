#include "lane/frame_reader.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

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

bool WouldBlock(int error) { return error == EAGAIN || error == EWOULDBLOCK; }

absl::Status SocketError(const char* what) {
  const int error = errno;
  if (WouldBlock(error)) {
    return absl::DeadlineExceededError(absl::StrCat("data lane: ", what, " timed out"));
  }
  return absl::UnavailableError(absl::StrCat("data lane: ", what, ": ", std::strerror(error)));
}

absl::StatusOr<std::pair<std::string, std::string>> SplitAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("data lane address \"", address, "\" is not host:port"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return std::make_pair(host, address.substr(colon + 1));
}

// The addresses of host:port, for connecting or (passive) for listening.
absl::StatusOr<addrinfo*> Resolve(const std::string& address, bool passive) {
  auto host_port = SplitAddress(address);
  if (!host_port.ok()) return host_port.status();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const char* host = host_port->first.empty() ? nullptr : host_port->first.c_str();
  if (const int error = getaddrinfo(host, host_port->second.c_str(), &hints, &found); error != 0) {
    return absl::UnavailableError(
        absl::StrCat("data lane: cannot resolve \"", address, "\": ", gai_strerror(error)));
  }
  return found;
}

void SetTimeouts(int fd, absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return;
  const timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

}  // namespace

void EncodeHeader(const FrameHeader& header, std::byte out[kHeaderBytes]) {
  for (int i = 0; i < 4; ++i) out[i] = std::byte((header.length >> (8 * i)) & 0xff);
  out[4] = std::byte(header.kind & 0xff);
  out[5] = out[6] = out[7] = std::byte{0};
}

FrameHeader DecodeHeader(const std::byte in[kHeaderBytes]) {
  FrameHeader header;
  for (int i = 0; i < 4; ++i) header.length |= std::to_integer<uint32_t>(in[i]) << (8 * i);
  header.kind = std::to_integer<int>(in[4]);
  // Reserved bytes set make the kind unknown, so they are refused, not ignored.
  if (in[5] != std::byte{0} || in[6] != std::byte{0} || in[7] != std::byte{0}) header.kind = -1;
  return header;
}

FrameReader::FrameReader(int fd, uint64_t max_payload)
    : fd_(fd), max_payload_(max_payload), receive_timeout_ms_(ReceiveTimeoutMs(fd)),
      buffer_(new std::byte[kInitialCapacity]), capacity_(kInitialCapacity) {}

bool FrameReader::HasBufferedFrame() const {
  const size_t start = start_ + consumed_;
  if (end_ - start < kHeaderBytes) return false;
  return end_ - start >= kHeaderBytes + DecodeHeader(buffer_.get() + start).length;
}

absl::Status FrameReader::Fill(size_t bytes) {
  if (end_ - start_ >= bytes) return absl::OkStatus();
  if (start_ == end_) start_ = end_ = 0;
  Reserve(start_ + bytes - end_);  // the frame lands contiguous
  while (end_ - start_ < bytes) {
    const size_t need = start_ + bytes - end_;
    // Bytes sure to come: the rest of this frame, or more that were promised
    // as far as the buffer has room for them where they land.
    const size_t promised = static_cast<size_t>(std::min<uint64_t>(promised_, capacity_ - end_));
    const size_t awaited = std::min(std::max(need, promised), kLowWaterCap);
    size_t want = std::min(capacity_ - end_, std::max(need, kGreedyRead));
    int flags = 0;
    if (awaited >= kLowWaterFloor) {
      absl::Status ready = AwaitReadable(awaited);
      if (!ready.ok()) return ready;
      flags = MSG_DONTWAIT;
      want = capacity_ - end_;  // whatever else is there, the next frame's start too
    } else {
      SetLowWater(1);  // a blocking recv returns once this much is there
    }
    const ssize_t got = recv(fd_, buffer_.get() + end_, want, flags);
    if (got > 0) {
      Received(static_cast<size_t>(got));
    } else if (got == 0) {
      if (end_ == start_) return absl::OutOfRangeError("data lane: the peer closed the connection");
      return absl::UnavailableError("data lane: the peer closed the connection within a frame");
    } else if (errno != EINTR && !(flags == MSG_DONTWAIT && WouldBlock(errno))) {
      return SocketError("receive");  // else interrupted, or poll's readiness went to nothing
    }
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
  if (!HasBufferedFrame() && end_ < capacity_) {
    const ssize_t got = recv(fd_, buffer_.get() + end_, capacity_ - end_, MSG_DONTWAIT);
    if (got > 0) {
      Received(static_cast<size_t>(got));
    } else if (got == 0) {
      return absl::OutOfRangeError("data lane: the peer closed the connection");
    } else if (!WouldBlock(errno) && errno != EINTR) {
      return SocketError("receive");
    }
  }
  // A frame only partly here (or one past the space left) waits for Next.
  if (!HasBufferedFrame()) return std::nullopt;
  absl::StatusOr<Frame> frame = Next();
  if (!frame.ok()) return frame.status();
  return std::optional<Frame>(*frame);
}

void FrameWriter::AddMessage(v1::LaneFrameKind kind, const google::protobuf::MessageLite& message) {
  const size_t length = message.ByteSizeLong();
  AddHeader(kind, static_cast<uint32_t>(length));
  const size_t at = owned_.size();
  owned_.resize(at + length);
  message.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(owned_.data() + at));
  parts_.back().size += length;  // AddHeader's part, owned and just before
}

void FrameWriter::AddHeader(v1::LaneFrameKind kind, uint32_t length) {
  std::byte header[kHeaderBytes];
  EncodeHeader({.length = length, .kind = kind}, header);
  AddCopy(header);
}

void FrameWriter::AddCopy(absl::Span<const std::byte> bytes) {
  const size_t at = owned_.size();
  owned_.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  // Adjacent copies form one part (many acknowledgements, one iovec).
  if (!parts_.empty() && parts_.back().owned &&
      parts_.back().offset + parts_.back().size == at) {
    parts_.back().size += bytes.size();
    return;
  }
  parts_.push_back({.owned = true, .offset = at, .data = nullptr, .size = bytes.size()});
}

void FrameWriter::AddReference(absl::Span<const std::byte> bytes) {
  if (bytes.empty()) return;
  parts_.push_back({.owned = false, .offset = 0, .data = bytes.data(), .size = bytes.size()});
}

absl::Status FrameWriter::Send() {
  std::vector<iovec>& iov = iov_;
  iov.clear();
  for (const Part& part : parts_) {
    const std::byte* data = part.owned ? reinterpret_cast<const std::byte*>(owned_.data()) + part.offset
                                       : part.data;
    iov.push_back({const_cast<std::byte*>(data), part.size});
  }
  // Forgotten on every way out; owned_ only after the sends, which read it.
  parts_.clear();
  struct ClearOnExit {
    std::string& owned;
    ~ClearOnExit() { owned.clear(); }
  } clear_on_exit{owned_};
  size_t first = 0;
  while (first < iov.size()) {
    msghdr message{};
    message.msg_iov = iov.data() + first;
    message.msg_iovlen = std::min<size_t>(iov.size() - first, IOV_MAX);
    const ssize_t sent = sendmsg(fd_, &message, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return SocketError("send");
    }
    // Skip what went out; the first part left may have gone partly.
    size_t left = static_cast<size_t>(sent);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<std::byte*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return absl::OkStatus();
}

absl::Status StatusFromLane(const v1::LaneStatus& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.code()), status.message());
}

v1::LaneStatus LaneStatusOf(const absl::Status& status) {
  v1::LaneStatus lane;
  lane.set_code(static_cast<int>(status.code()));
  lane.set_message(std::string(status.message()));
  return lane;
}

absl::StatusOr<int> Connect(const std::string& address, absl::Duration timeout,
                            absl::string_view preamble) {
  auto found = Resolve(address, /*passive=*/false);
  if (!found.ok()) return found.status();
  absl::Status last = absl::UnavailableError(absl::StrCat("data lane: no address for ", address));
  for (addrinfo* at = *found; at != nullptr; at = at->ai_next) {
    OwnedFd fd(socket(at->ai_family, at->ai_socktype | SOCK_CLOEXEC, at->ai_protocol));
    if (fd.get() < 0 || connect(fd.get(), at->ai_addr, at->ai_addrlen) != 0) {
      last = SocketError(absl::StrCat("connect to ", address).c_str());
      continue;
    }
    const int one = 1;
    setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    SetTimeouts(fd.get(), timeout);
    FrameWriter writer(fd.get());
    writer.AddCopy({reinterpret_cast<const std::byte*>(preamble.data()), preamble.size()});
    if (absl::Status sent = writer.Send(); !sent.ok()) {
      last = sent;
      continue;
    }
    freeaddrinfo(*found);
    return fd.release();
  }
  freeaddrinfo(*found);
  return last;
}

absl::StatusOr<int> Listen(const std::string& address, int& port) {
  auto found = Resolve(address, /*passive=*/true);
  if (!found.ok()) return found.status();
  absl::Status last = absl::UnavailableError(absl::StrCat("data lane: no address for ", address));
  for (addrinfo* at = *found; at != nullptr; at = at->ai_next) {
    OwnedFd fd(socket(at->ai_family, at->ai_socktype | SOCK_CLOEXEC, at->ai_protocol));
    const int one = 1;
    if (fd.get() >= 0) setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (fd.get() < 0 || bind(fd.get(), at->ai_addr, at->ai_addrlen) != 0 ||
        listen(fd.get(), 128) != 0) {
      last = SocketError(absl::StrCat("listen on ", address).c_str());
      continue;
    }
    sockaddr_storage bound{};
    socklen_t length = sizeof(bound);
    getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &length);
    port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6&>(bound).sin6_port
                                             : reinterpret_cast<sockaddr_in&>(bound).sin_port);
    freeaddrinfo(*found);
    return fd.release();
  }
  freeaddrinfo(*found);
  return last;
}

OwnedFd& OwnedFd::operator=(OwnedFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = other.release();
  }
  return *this;
}

OwnedFd::~OwnedFd() {
  if (fd_ >= 0) close(fd_);
}

int OwnedFd::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

}  // namespace kvcache::lane
