#include "wire/lane/socket.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "wire/lane/frame_writer.h"
#include "wire/net/address.h"

namespace kvcache::lane {
namespace {

// The addresses of host:port, for connecting or (passive) for listening.
absl::StatusOr<addrinfo*> Resolve(const std::string& address, bool passive) {
  absl::StatusOr<net::HostPort> host_port = net::ParseHostPort(
      address, "data lane address", passive ? net::AddressUse::kListen : net::AddressUse::kConnect);
  if (!host_port.ok()) return host_port.status();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const char* host = host_port->host.empty() ? nullptr : host_port->host.c_str();
  const std::string port = absl::StrCat(host_port->port);
  if (const int error = getaddrinfo(host, port.c_str(), &hints, &found); error != 0) {
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

absl::Status Keepalive::Validate() const {
  // TCP_KEEPIDLE and TCP_KEEPINTVL take at most 32767 s.
  constexpr absl::Duration kMost = absl::Seconds(32767);
  const struct {
    const char* name;
    absl::Duration value;
  } fields[] = {{"keepalive_time", time}, {"keepalive_timeout", timeout}};
  for (const auto& field : fields) {
    if (field.value < absl::Milliseconds(1) || field.value > kMost) {
      return absl::InvalidArgumentError(
          absl::StrCat(field.name, ": ", absl::FormatDuration(field.value),
                       " is not from 1ms to 32767s"));
    }
  }
  return absl::OkStatus();
}

absl::Status SetKeepalive(int fd, const Keepalive& keepalive) {
  constexpr int kProbes = 3;
  auto whole_seconds = [](absl::Duration duration) {
    const int64_t seconds = absl::ToInt64Seconds(absl::Ceil(duration, absl::Seconds(1)));
    return static_cast<int>(std::clamp<int64_t>(seconds, 1, 32767));
  };
  const int on = 1;
  const int idle = whole_seconds(keepalive.time);
  const int interval = whole_seconds(keepalive.timeout / kProbes);
  const int probes = kProbes;
  const int user_timeout = static_cast<int>(std::clamp<int64_t>(
      absl::ToInt64Milliseconds(keepalive.time + keepalive.timeout), 1, INT32_MAX));
  if (setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on)) != 0 ||
      setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle)) != 0 ||
      setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval)) != 0 ||
      setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes)) != 0 ||
      setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof(user_timeout)) != 0) {
    return SocketError("keepalive");
  }
  return absl::OkStatus();
}

bool WouldBlock(int error) { return error == EAGAIN || error == EWOULDBLOCK; }

absl::Status SocketError(const char* what) {
  const int error = errno;
  if (WouldBlock(error)) {
    return absl::DeadlineExceededError(absl::StrCat("data lane: ", what, " timed out"));
  }
  return absl::UnavailableError(absl::StrCat("data lane: ", what, ": ", std::strerror(error)));
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
    if (!preamble.empty()) {
      FrameWriter writer(fd.get());
      writer.AddCopy({reinterpret_cast<const std::byte*>(preamble.data()), preamble.size()});
      if (absl::Status sent = writer.Send(); !sent.ok()) {
        last = sent;
        continue;
      }
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
