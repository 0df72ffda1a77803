// What the server holds, read when Prometheus scrapes (nothing is counted on
// a hot path for it): the pool's pages per tier and the pages moved between
// tiers, and per tenant its caches, snapshots, leases, pins, metadata,
// prefix index, admitted calls and lane connections, and the bytes its calls
// moved over each transport; and the data lane's connections that are
// opening or were closed before they opened. Names follow the field's conventions
// (kvcached_ prefix, units and _total in names); the anonymous tenant (no
// tokens file) is tenant="anonymous".
#pragma once

#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "service/lane/data_lane.h"
#include "service/tenants.h"

namespace kvcache::service {

class StateMetrics final : public prometheus::Collectable {
 public:
  // `lane` (null: none) must outlive this, as `tenants` must.
  explicit StateMetrics(const Tenants& tenants, DataLane* lane = nullptr)
      : tenants_(tenants), lane_(lane) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const Tenants& tenants_;
  DataLane* const lane_;
};

}  // namespace kvcache::service
