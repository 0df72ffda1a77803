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
