// A TCP forwarder on a loopback port, so that a test can cut a client's
// connection abruptly, as a crashed worker or a broken network would. Neither
// ClientContext::TryCancel (a polite RST_STREAM) nor destroying a channel (its
// open calls keep it alive) does that.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvcache::testing {

class LoopbackProxy {
 public:
  // Listens on 127.0.0.1:<free port> and forwards to 127.0.0.1:target_port;
  // null if the socket cannot be set up.
  static std::unique_ptr<LoopbackProxy> Start(int target_port);
  ~LoopbackProxy();

  std::string address() const;
  // Resets every forwarded connection at once (both sides see RST); new
  // connections are still accepted.
  void CutConnections();
  // Stops forwarding, in both directions, on every connection, keeping them
  // open: as a peer whose host went away looks (its kernel still
  // acknowledges what reaches it here, but nothing answers).
  void Freeze() { frozen_ = true; }

 private:
  struct Link {
    int client_fd;
    int server_fd;
    bool closed = false;
    std::atomic<bool> cut{false};
  };

  LoopbackProxy(int listen_fd, int port, int target_port);
  void AcceptLoop();
  void Pump(Link* link);
  void Cut(Link& link) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const int listen_fd_;
  const int port_;
  const int target_port_;
  std::atomic<bool> frozen_{false};
  std::thread acceptor_;
  absl::Mutex mutex_;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::vector<std::unique_ptr<Link>> links_ ABSL_GUARDED_BY(mutex_);
  std::vector<std::thread> pumps_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace kvcache::testing
