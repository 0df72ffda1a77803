// The Prometheus endpoint (--metrics_listen): GET /metrics answers with the
// text exposition of every RPC's counts and latencies (service/grpc/rpc_observer.h)
// and of what the server holds (state_metrics.h). It carries tenant
// names and counts, never tokens, ids or data; put it on an operators'
// network.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "wire/net/address.h"

namespace kvcache {

class MetricsExporter {
 public:
  // Listens on `listen` ("HOST:PORT"; port 0 picks one); UNAVAILABLE when it
  // cannot.
  static absl::StatusOr<std::unique_ptr<MetricsExporter>> Start(
      const std::string& listen, std::vector<std::shared_ptr<prometheus::Collectable>> sources);

  // Stops listening at once (see the .cc on CivetWeb's stop).
  ~MetricsExporter();

  // HOST:PORT as a scraper reaches it (the port picked, when 0 was asked).
  std::string address() const { return address_; }

 private:
  MetricsExporter() = default;
  std::vector<std::shared_ptr<prometheus::Collectable>> sources_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string address_;
  net::HostPort wake_at_;  // where a connection reaches the listener from this host
};

}  // namespace kvcache
