#include "metrics_exporter.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "wire/net/address.h"

namespace kvcache {

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
  return exporter;
}

}  // namespace kvcache
