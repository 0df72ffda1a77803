// The data lane's TCP sockets: connecting (preamble sent), listening, closing,
// and the errors of a failed socket call as the lane reports them.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "lane/frame.h"

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
// peer it is probed, and it is dropped when `timeout` passes with no answer,
// or when bytes sent stay unacknowledged for time + timeout. The kernel's
// own default finds such a peer after more than two hours.
struct Keepalive {
  absl::Duration time = absl::Seconds(30);
  absl::Duration timeout = absl::Seconds(10);

  // InvalidArgument naming keepalive_time or keepalive_timeout where one is not positive.
  absl::Status Validate() const;
};

// SO_KEEPALIVE with TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT and
// TCP_USER_TIMEOUT from `keepalive` (whole seconds, at least one, for the
// first three).
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
