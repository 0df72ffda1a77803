#include "loopback_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcache::testing {
namespace {

sockaddr_in Loopback(int port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return address;
}

int ConnectTo(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  const sockaddr_in address = Loopback(port);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

// Copies what `from` has to `to`; false once `from` has ended or failed.
bool Forward(int from, int to) {
  char buffer[64 << 10];
  const ssize_t got = read(from, buffer, sizeof(buffer));
  if (got <= 0) return false;
  for (ssize_t sent = 0; sent < got;) {
    // MSG_NOSIGNAL: a peer already cut off must fail the send, not raise
    // SIGPIPE and kill the test binary.
    const ssize_t n = send(to, buffer + sent, got - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += n;
  }
  return true;
}

}  // namespace

std::unique_ptr<LoopbackProxy> LoopbackProxy::Start(int target_port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return nullptr;
  sockaddr_in address = Loopback(0);
  socklen_t length = sizeof(address);
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      listen(fd, 16) != 0 || getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    close(fd);
    return nullptr;
  }
  auto proxy =
      std::unique_ptr<LoopbackProxy>(new LoopbackProxy(fd, ntohs(address.sin_port), target_port));
  proxy->acceptor_ = std::thread([p = proxy.get()] { p->AcceptLoop(); });
  return proxy;
}

LoopbackProxy::LoopbackProxy(int listen_fd, int port, int target_port)
    : listen_fd_(listen_fd), port_(port), target_port_(target_port) {}

LoopbackProxy::~LoopbackProxy() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  shutdown(listen_fd_, SHUT_RDWR);  // wakes accept() (Linux)
  acceptor_.join();
  close(listen_fd_);
  CutConnections();
  std::vector<std::thread> pumps;
  {
    absl::MutexLock lock(&mutex_);
    pumps.swap(pumps_);
  }
  for (std::thread& pump : pumps) pump.join();
}

std::string LoopbackProxy::address() const { return absl::StrCat("127.0.0.1:", port_); }

void LoopbackProxy::AcceptLoop() {
  while (true) {
    const int client_fd = accept(listen_fd_, nullptr, nullptr);
    if (client_fd < 0) return;  // shut down
    const int server_fd = ConnectTo(target_port_);
    absl::MutexLock lock(&mutex_);
    if (server_fd < 0 || stopping_) {
      close(client_fd);
      if (server_fd >= 0) close(server_fd);
      continue;
    }
    auto link = std::make_unique<Link>();
    link->client_fd = client_fd;
    link->server_fd = server_fd;
    links_.push_back(std::move(link));
    pumps_.emplace_back([this, link = links_.back().get()] { Pump(link); });
  }
}

void LoopbackProxy::Pump(Link* link) {
  pollfd fds[2] = {{link->client_fd, POLLIN, 0}, {link->server_fd, POLLIN, 0}};
  bool open = true;
  while (open && poll(fds, 2, -1) > 0) {
    while (frozen_ && !link->cut) absl::SleepFor(absl::Milliseconds(10));
    if (link->cut) break;
    if (fds[0].revents != 0) open = Forward(link->client_fd, link->server_fd);
    if (open && fds[1].revents != 0) open = Forward(link->server_fd, link->client_fd);
  }
  absl::MutexLock lock(&mutex_);
  Cut(*link);
  close(link->client_fd);
  close(link->server_fd);
  link->closed = true;
}

void LoopbackProxy::CutConnections() {
  absl::MutexLock lock(&mutex_);
  for (auto& link : links_) {
    if (!link->closed) Cut(*link);
  }
}

// A zero linger makes the close send RST; the shutdown wakes the pump.
void LoopbackProxy::Cut(Link& link) {
  link.cut = true;
  const linger reset{.l_onoff = 1, .l_linger = 0};
  for (int fd : {link.client_fd, link.server_fd}) {
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
    shutdown(fd, SHUT_RDWR);
  }
}

}  // namespace kvcache::testing
