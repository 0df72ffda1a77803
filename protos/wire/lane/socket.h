// The data lane's TCP sockets: connecting (preamble sent), listening, closing,
// and the errors of a failed socket call as the lane reports them.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "wire/lane/frame.h"

namespace kvcache::lane {

// A connected TCP socket to host:port, with TCP_NODELAY, `preamble` sent
// (none when empty: a TLS connection sends its own after the handshake), and send / receive
// timeouts of `timeout` (0: none). The caller closes it.
absl::StatusOr<int> Connect(const std::string& address, absl::Duration timeout,
                            absl::string_view preamble = {kMagic, sizeof(kMagic)});
// A listening TCP socket on host:port (port 0: any free one); `port` is set
// to the port bound.
absl::StatusOr<int> Listen(const std::string& address, int& port);

// How a connection whose peer went away (its host down, the network cut,
// no FIN or RST ever coming) is found: after `time` without a byte from the
// peer it is probed, and it is dropped once `timeout` more passes with no
// answer (SetKeepalive: on the lane within a probe interval, timeout / 3,
// after that). The kernel's own default finds such a peer after more than
// two hours. The default timeout is gRPC's own (its server sockets' bound
// on unacknowledged bytes is 20 s too).
struct Keepalive {
  absl::Duration time = absl::Seconds(30);
  absl::Duration timeout = absl::Seconds(20);

  // InvalidArgument naming keepalive_time or keepalive_timeout where one is
  // not from 1 ms to 32767 s (the kernel's bound on its probe times).
  absl::Status Validate() const;
};

// SO_KEEPALIVE with TCP_KEEPIDLE (time), TCP_KEEPINTVL (timeout / 3),
// TCP_KEEPCNT (3), all in whole seconds of at least one, and
// TCP_USER_TIMEOUT of time + timeout: bytes sent and unacknowledged that
// long, or a peer's receive window shut that long, end the connection too.
// `keepalive` must be valid.
absl::Status SetKeepalive(int fd, const Keepalive& keepalive);

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

// Whether `error` (an errno) means a non-blocking call found nothing to do,
// or a blocking one ran past the socket's timeout.
bool WouldBlock(int error);
// errno after a failed socket call `what`: DEADLINE_EXCEEDED where the
// socket's timeout passed, else UNAVAILABLE with the system's words.
absl::Status SocketError(const char* what);

}  // namespace kvcache::lane
