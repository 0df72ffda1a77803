#include "metrics_exporter.h"

#include <exception>

#include "absl/strings/str_cat.h"

namespace kvcache {

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(
    const std::string& listen, std::vector<std::shared_ptr<prometheus::Collectable>> sources) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_listen: \"", listen, "\" is not HOST:PORT"));
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
  exporter->address_ = absl::StrCat(listen.substr(0, colon), ":", ports.front());
  return exporter;
}

}  // namespace kvcache
