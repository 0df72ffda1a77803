#include "metrics_exporter.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <exception>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace kvcache {
namespace {

// Opens and closes one TCP connection to `at`, ignoring failure: all it is
// for is to wake a listener's poll.
void ConnectOnce(const net::HostPort& at) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(at.host.c_str(), std::to_string(at.port).c_str(), &hints, &found) != 0) return;
  for (addrinfo* each = found; each != nullptr; each = each->ai_next) {
    const int socket_fd = socket(each->ai_family, each->ai_socktype | SOCK_CLOEXEC, 0);
    if (socket_fd < 0) continue;
    const bool connected = connect(socket_fd, each->ai_addr, each->ai_addrlen) == 0;
    close(socket_fd);
    if (connected) break;
  }
  freeaddrinfo(found);
}

}  // namespace

MetricsExporter::~MetricsExporter() {
  // CivetWeb's listening thread sees its stop flag only between polls, which
  // wait up to 2 s for a connection: every server stop (and every test's)
  // took 2 s longer. Connections made while it stops end the wait at once.
  std::atomic<bool> stopped = false;
  std::thread waker([&] {
    while (!stopped.load()) {
      ConnectOnce(wake_at_);
      absl::SleepFor(absl::Milliseconds(5));
    }
  });
  exposer_.reset();
  stopped = true;
  waker.join();
}

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(
    const std::string& listen, std::vector<std::shared_ptr<prometheus::Collectable>> sources) {
  absl::StatusOr<net::HostPort> address =
      net::ParseHostPort(listen, "metrics_listen", net::AddressUse::kListen);
  if (!address.ok()) return address.status();
  if (address->host.empty()) {
    // Refused as before the one rule: CivetWeb is given a host, 0.0.0.0 for every interface.
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics_listen: \"", listen.substr(0, 64), "\" names no host (0.0.0.0: every interface)"));
  }
  auto exporter = std::unique_ptr<MetricsExporter>(new MetricsExporter());
  exporter->sources_ = std::move(sources);
  try {
    // CivetWeb (under prometheus-cpp) throws when it cannot listen. One
    // thread: scrapes come every few seconds from a handful of scrapers.
    exporter->exposer_ = std::make_unique<prometheus::Exposer>(listen, /*num_threads=*/1);
  } catch (const std::exception& error) {
    return absl::UnavailableError(
        absl::StrCat("metrics_listen: cannot listen on ", listen, ": ", error.what()));
  }
  for (const auto& source : exporter->sources_) exporter->exposer_->RegisterCollectable(source);
  const std::vector<int> ports = exporter->exposer_->GetListeningPorts();
  if (ports.empty()) {
    return absl::UnavailableError(absl::StrCat("metrics_listen: cannot listen on ", listen));
  }
  exporter->address_ = net::HostPort{address->host, ports.front()}.ToString();
  const bool ipv6 = address->host.find(':') != std::string::npos;
  exporter->wake_at_ = {net::IsWildcardHost(address->host) ? (ipv6 ? "::1" : "127.0.0.1")
                                                           : address->host,
                        ports.front()};
  return exporter;
}

}  // namespace kvcache
