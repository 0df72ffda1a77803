// What the server holds, read when Prometheus scrapes (nothing is counted on
// a hot path for it): the pool's pages per tier and the pages moved between
// tiers, and per tenant its caches, snapshots, leases, pins, metadata,
// prefix index, admitted calls and lane connections, and the bytes its calls
// moved over each transport. Names follow the field's conventions
// (kvcached_ prefix, units and _total in names); the anonymous tenant (no
// tokens file) is tenant="anonymous".
#pragma once

#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "service/tenants.h"

namespace kvcache::service {

class StateMetrics final : public prometheus::Collectable {
 public:
  explicit StateMetrics(const Tenants& tenants) : tenants_(tenants) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const Tenants& tenants_;
};

}  // namespace kvcache::service
