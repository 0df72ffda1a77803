#include "state_metrics.h"

#include <algorithm>
#include <string>
#include <utility>

#include "engine/engine.h"

namespace kvcache::service {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

class FamilyBuilder {
 public:
  explicit FamilyBuilder(std::vector<MetricFamily>& out) : out_(out) {}

  // A new family; the samples that follow belong to it.
  FamilyBuilder& Family(std::string name, std::string help, MetricType type) {
    out_.push_back({.name = std::move(name), .help = std::move(help), .type = type});
    return *this;
  }
  FamilyBuilder& Sample(double value, std::vector<ClientMetric::Label> labels = {}) {
    MetricFamily& family = out_.back();
    ClientMetric& metric = family.metric.emplace_back();
    metric.label = std::move(labels);
    if (family.type == MetricType::Counter) {
      metric.counter.value = value;
    } else {
      metric.gauge.value = value;
    }
    return *this;
  }

 private:
  std::vector<MetricFamily>& out_;
};

void CollectPool(const gpu::PoolStats& pool, FamilyBuilder& out) {
  const double page = static_cast<double>(pool.page_bytes);
  out.Family("kvcached_page_bytes", "Bytes of one pool page", MetricType::Gauge).Sample(page);
  out.Family("kvcached_tier_pages", "Pages held in each tier", MetricType::Gauge)
      .Sample(pool.used_pages, {{"tier", "device"}})
      .Sample(pool.host_pages, {{"tier", "host"}})
      .Sample(pool.disk_pages, {{"tier", "disk"}});
  out.Family("kvcached_tier_pages_capacity", "Pages each tier's budget holds", MetricType::Gauge)
      .Sample(pool.max_pages, {{"tier", "device"}})
      .Sample(pool.max_host_pages, {{"tier", "host"}})
      .Sample(pool.max_disk_pages, {{"tier", "disk"}});
  out.Family("kvcached_tier_bytes", "Bytes held in each tier", MetricType::Gauge)
      .Sample(pool.used_pages * page, {{"tier", "device"}})
      .Sample(pool.host_pages * page, {{"tier", "host"}})
      .Sample(pool.disk_pages * page, {{"tier", "disk"}});
  out.Family("kvcached_tier_bytes_capacity", "Bytes of each tier's budget", MetricType::Gauge)
      .Sample(pool.max_pages * page, {{"tier", "device"}})
      .Sample(pool.max_host_pages * page, {{"tier", "host"}})
      .Sample(pool.max_disk_pages * page, {{"tier", "disk"}});
  out.Family("kvcached_device_pages_peak", "The most device pages in use at once",
             MetricType::Gauge)
      .Sample(pool.peak_used_pages);
  out.Family("kvcached_pages_evicted_total", "Pages moved off the device to a lower tier",
             MetricType::Counter)
      .Sample(static_cast<double>(pool.evictions));
  out.Family("kvcached_pages_demoted_total", "Pages moved from host memory to disk",
             MetricType::Counter)
      .Sample(static_cast<double>(pool.demotions));
  out.Family("kvcached_pages_promoted_total", "Pages brought back to the device, by source tier",
             MetricType::Counter)
      .Sample(static_cast<double>(pool.promotions_from_host), {{"from_tier", "host"}})
      .Sample(static_cast<double>(pool.promotions_from_disk), {{"from_tier", "disk"}});
}

struct TenantSample {
  std::string label;
  const Tenant* tenant;
  engine::EngineStats stats;
  RequestLogCounts request_log;
};

// One family with a sample per tenant.
void PerTenant(FamilyBuilder& out, const std::vector<TenantSample>& tenants, std::string name,
               std::string help, MetricType type, double (*value)(const TenantSample&)) {
  out.Family(std::move(name), std::move(help), type);
  for (const TenantSample& sample : tenants) out.Sample(value(sample), {{"tenant", sample.label}});
}

void CollectTenants(const std::vector<TenantSample>& tenants, FamilyBuilder& out) {
  using T = const TenantSample&;
  constexpr MetricType kGauge = MetricType::Gauge;
  constexpr MetricType kCounter = MetricType::Counter;
  PerTenant(out, tenants, "kvcached_caches", "Live caches", kGauge,
            [](T t) { return double(t.stats.caches); });
  PerTenant(out, tenants, "kvcached_snapshots", "Live snapshots (prefix entries included)", kGauge,
            [](T t) { return double(t.stats.snapshots); });
  out.Family("kvcached_leases_expired_total", "Caches and snapshots released by their lease",
             kCounter);
  for (T t : tenants) {
    out.Sample(double(t.stats.caches_expired), {{"tenant", t.label}, {"kind", "cache"}});
    out.Sample(double(t.stats.snapshots_expired), {{"tenant", t.label}, {"kind", "snapshot"}});
  }
  PerTenant(out, tenants, "kvcached_pinned_bytes", "Bytes of pinned snapshots", kGauge,
            [](T t) { return double(t.stats.pinned_bytes); });
  PerTenant(out, tenants, "kvcached_pinned_bytes_limit", "The most pinned bytes (0: no limit)",
            kGauge, [](T t) { return double(t.stats.max_pinned_bytes); });
  PerTenant(out, tenants, "kvcached_metadata_bytes",
            "Host bytes charged to caches, snapshots and page tables", kGauge,
            [](T t) { return double(t.stats.metadata_bytes); });
  PerTenant(out, tenants, "kvcached_metadata_bytes_limit", "The most metadata bytes", kGauge,
            [](T t) { return double(t.stats.max_metadata_bytes); });
  PerTenant(out, tenants, "kvcached_prefix_entries", "Published prefixes", kGauge,
            [](T t) { return double(t.stats.prefixes.entries); });
  PerTenant(out, tenants, "kvcached_prefix_tokens", "Tokens the prefix index stores", kGauge,
            [](T t) { return double(t.stats.prefixes.stored_tokens); });
  PerTenant(out, tenants, "kvcached_prefix_lookups_total", "Prefix lookups", kCounter,
            [](T t) { return double(t.stats.prefixes.lookups); });
  PerTenant(out, tenants, "kvcached_prefix_hits_total", "Prefix lookups that matched a token",
            kCounter, [](T t) { return double(t.stats.prefixes.hits); });
  PerTenant(out, tenants, "kvcached_prefix_misses_total", "Prefix lookups that matched nothing",
            kCounter, [](T t) { return double(t.stats.prefixes.lookups - t.stats.prefixes.hits); });
  PerTenant(out, tenants, "kvcached_prefix_matched_tokens_total", "Tokens matched by lookups",
            kCounter, [](T t) { return double(t.stats.prefixes.matched_tokens); });
  PerTenant(out, tenants, "kvcached_prefix_entries_dropped_total",
            "Prefix entries dropped to make room", kCounter,
            [](T t) { return double(t.stats.prefixes.dropped); });
  PerTenant(out, tenants, "kvcached_requests_in_flight", "gRPC calls admitted and not finished",
            kGauge, [](T t) { return double(t.tenant->requests_in_flight.load()); });
  PerTenant(out, tenants, "kvcached_calls_admitted_total", "gRPC calls admitted", kCounter,
            [](T t) { return double(t.tenant->calls_admitted.load()); });
  PerTenant(out, tenants, "kvcached_lane_connections", "Open data-lane connections", kGauge,
            [](T t) { return double(t.tenant->lane_connections.load()); });
  PerTenant(out, tenants, "kvcached_lane_connections_total", "Data-lane connections admitted",
            kCounter, [](T t) { return double(t.tenant->lane_connections_admitted.load()); });
  PerTenant(out, tenants, "kvcached_request_log_entries",
            "Answers kept for requests sent again with their request_id", kGauge,
            [](T t) { return double(t.request_log.entries); });
  PerTenant(out, tenants, "kvcached_request_log_bytes", "Bytes those answers hold", kGauge,
            [](T t) { return double(t.request_log.bytes); });
  PerTenant(out, tenants, "kvcached_requests_replayed_total",
            "Requests answered from the request log instead of run again", kCounter,
            [](T t) { return double(t.request_log.replayed); });
  for (const bool received : {true, false}) {
    out.Family(received ? "kvcached_received_bytes_total" : "kvcached_sent_bytes_total",
               received ? "Bytes of Update and import requests, by transport"
                        : "Bytes of Fetch and export responses, by transport",
               kCounter);
    for (T t : tenants) {
      for (const Transport transport : kTransports) {
        const TransportBytes& bytes = t.tenant->bytes[static_cast<size_t>(transport)];
        out.Sample(double((received ? bytes.received : bytes.sent).load()),
                   {{"tenant", t.label}, {"transport", TransportName(transport)}});
      }
    }
  }
}

// The lane's connections that are still opening, and those it closed
// before they opened: a peer that connects and never authenticates shows
// here, and nowhere per tenant.
void CollectLane(const LaneCounts& lane, FamilyBuilder& out) {
  out.Family("kvcached_lane_connections_opening",
             "Data-lane connections accepted and not yet opened (TLS, preamble, AUTH)",
             MetricType::Gauge)
      .Sample(lane.opening);
  out.Family("kvcached_lane_connections_refused_total",
             "Data-lane connections closed before they opened, by reason", MetricType::Counter)
      .Sample(double(lane.refused_busy), {{"reason", "busy"}})
      .Sample(double(lane.cut_opening_timeout), {{"reason", "opening_timeout"}})
      .Sample(double(lane.cut_displaced), {{"reason", "displaced"}});
}

}  // namespace

std::vector<MetricFamily> StateMetrics::Collect() const {
  std::vector<TenantSample> tenants;
  for (const Tenant* tenant : tenants_.All()) {
    tenants.push_back({.label = tenant->name.empty() ? "anonymous" : tenant->name,
                       .tenant = tenant,
                       .stats = tenant->parts.engine->Stats(),
                       .request_log = tenant->parts.handlers->RequestLogCountsNow()});
  }
  std::sort(tenants.begin(), tenants.end(),
            [](const TenantSample& a, const TenantSample& b) { return a.label < b.label; });
  std::vector<MetricFamily> families;
  FamilyBuilder out(families);
  if (!tenants.empty()) CollectPool(tenants.front().stats.pool, out);  // one pool under all
  CollectTenants(tenants, out);
  if (lane_ != nullptr) CollectLane(lane_->Counts(), out);
  return families;
}

}  // namespace kvcache::service
