#include "service/tenants.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/client_text.h"
#include "core/log.h"
#include "service/convert.h"
#include "service/stats_scopes.h"

namespace kvcache::service {
namespace {

constexpr absl::string_view kBearer = "Bearer ";

}  // namespace

Admitted& Admitted::operator=(Admitted&& other) noexcept {
  if (this != &other) {
    Release();
    tenant_ = std::exchange(other.tenant_, nullptr);
    gauge_.store(other.gauge_.exchange(nullptr));
    alive_ = std::exchange(other.alive_, nullptr);
    tenants_ = std::exchange(other.tenants_, nullptr);
    token_ = other.token_;
    checked_generation_.store(other.checked_generation_.load(std::memory_order_relaxed),
                              std::memory_order_relaxed);
    revoked_.store(other.revoked_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
  return *this;
}

absl::Status Admitted::StillAdmitted() const {
  if (tenants_ == nullptr) return absl::OkStatus();
  if (!revoked_.load(std::memory_order_relaxed) &&
      checked_generation_.load(std::memory_order_relaxed) == tenants_->generation()) {
    return absl::OkStatus();
  }
  return tenants_->Recheck(*this);
}

void Admitted::Answering() const {
  if (std::atomic<uint32_t>* gauge = gauge_.exchange(nullptr)) {
    gauge->fetch_sub(1, std::memory_order_relaxed);
  }
}

void Admitted::CountAlive(std::atomic<uint32_t>* alive) {
  alive->fetch_add(1);
  alive_ = alive;
}

void Admitted::Release() {
  Answering();
  if (alive_ != nullptr) std::exchange(alive_, nullptr)->fetch_sub(1);
  tenant_ = nullptr;
}

Tenants::Tenants(TenantParts anonymous) {
  auto tenant = std::make_unique<Tenant>();
  tenant->parts = std::move(anonymous);
  anonymous_ = tenant.get();
  absl::MutexLock lock(&mutex_);
  active_.push_back(anonymous_);
  by_name_.emplace("", std::move(tenant));
}

absl::StatusOr<std::unique_ptr<Tenants>> Tenants::Open(const std::string& tokens_file,
                                                       TenantFactory factory) {
  auto tenants = std::unique_ptr<Tenants>(new Tenants);
  tenants->path_ = tokens_file;
  tenants->factory_ = std::move(factory);
  absl::StatusOr<std::vector<TenantConfig>> configs = ReadTokensFile(tokens_file);
  if (!configs.ok()) return configs.status();
  absl::MutexLock lock(&tenants->mutex_);
  if (absl::Status status = tenants->Apply(*std::move(configs)); !status.ok()) return status;
  return tenants;
}

absl::Status Tenants::Reload() {
  if (!authenticates()) return absl::OkStatus();
  absl::StatusOr<std::vector<TenantConfig>> configs = ReadTokensFile(path_);
  if (!configs.ok()) return configs.status();
  absl::MutexLock lock(&mutex_);
  return Apply(*std::move(configs));
}

// Tenants are made first and published together, so a failure to make one
// leaves the previous file in force.
absl::Status Tenants::Apply(std::vector<TenantConfig> configs) {
  std::vector<std::unique_ptr<Tenant>> made;
  for (const TenantConfig& config : configs) {
    if (by_name_.contains(config.name)) continue;
    absl::StatusOr<TenantParts> parts = factory_(config);
    if (!parts.ok()) {
      return absl::Status(parts.status().code(),
                          absl::StrCat("tenant ", config.name, ": ", parts.status().message()));
    }
    auto tenant = std::make_unique<Tenant>();
    tenant->name = config.name;
    tenant->parts = *std::move(parts);
    made.push_back(std::move(tenant));
  }
  for (std::unique_ptr<Tenant>& tenant : made) {
    const std::string name = tenant->name;
    by_name_.emplace(name, std::move(tenant));
  }
  active_.clear();
  for (const TenantConfig& config : configs) {
    Tenant& tenant = *by_name_.at(config.name);
    tenant.admin.store(config.admin, std::memory_order_relaxed);
    tenant.max_requests_in_flight.store(config.quotas.max_requests_in_flight,
                                        std::memory_order_relaxed);
    tenant.max_lane_connections.store(config.quotas.max_lane_connections,
                                      std::memory_order_relaxed);
    active_.push_back(&tenant);
  }
  tokens_ = std::make_unique<TokenDirectory>(configs);
  generation_.fetch_add(1, std::memory_order_release);
  LogInfo("tokens_file %s: %d tenants", path_, configs.size());
  return absl::OkStatus();
}

const char* TransportName(Transport transport) {
  return transport == Transport::kGrpc ? "grpc" : "lane";
}

absl::StatusOr<Tenants::Credential> Tenants::Authenticate(absl::string_view token) const {
  if (!authenticates()) return Credential{.tenant = anonymous_};
  if (token.empty()) {
    return absl::UnauthenticatedError("authorization: no bearer token (kvcached --tokens_file)");
  }
  Credential credential{.digest = DigestToken(token)};
  absl::ReaderMutexLock lock(&mutex_);
  const int index = tokens_->FindDigest(credential.digest);
  if (index < 0) return absl::UnauthenticatedError("authorization: unknown bearer token");
  credential.tenant = active_[index];
  credential.generation = generation_.load(std::memory_order_relaxed);
  return credential;
}

absl::Status Tenants::Recheck(const Admitted& admitted) const {
  if (!admitted.revoked_.load(std::memory_order_relaxed)) {
    absl::ReaderMutexLock lock(&mutex_);
    const int index = tokens_->FindDigest(admitted.token_);
    if (index >= 0 && active_[index] == admitted.tenant_) {
      admitted.checked_generation_.store(generation_.load(std::memory_order_relaxed),
                                         std::memory_order_relaxed);
      return absl::OkStatus();
    }
    admitted.revoked_.store(true, std::memory_order_relaxed);
  }
  return absl::UnauthenticatedError(
      "authorization: the bearer token was revoked (the tokens file was re-read without it for "
      "this tenant); nothing more is served on this call or connection");
}

absl::StatusOr<Admitted> Tenants::Admit(const Credential& credential,
                                        std::atomic<uint32_t> Tenant::*gauge,
                                        std::atomic<uint32_t> Tenant::*limit,
                                        absl::string_view limit_name) {
  Tenant* tenant = credential.tenant;
  const uint32_t most = (tenant->*limit).load(std::memory_order_relaxed);
  const uint32_t before = (tenant->*gauge).fetch_add(1, std::memory_order_relaxed);
  Admitted admitted(tenant, &(tenant->*gauge));
  if (most != 0 && before >= most) {
    return absl::ResourceExhaustedError(
        absl::StrCat(limit_name, ": tenant ", tenant->name, " has ", most, " already (its quota)"));
  }
  if (authenticates()) {
    admitted.tenants_ = this;
    admitted.token_ = credential.digest;
    admitted.checked_generation_.store(credential.generation, std::memory_order_relaxed);
  }
  return admitted;
}

absl::StatusOr<Admitted> Tenants::AdmitCall(absl::string_view authorization) {
  absl::string_view token;
  if (authenticates() && !authorization.empty()) {
    if (!absl::StartsWithIgnoreCase(authorization, kBearer)) {
      return absl::UnauthenticatedError("authorization: not \"Bearer <token>\"");
    }
    token = absl::StripLeadingAsciiWhitespace(authorization.substr(kBearer.size()));
  }
  absl::StatusOr<Credential> credential = Authenticate(token);
  if (!credential.ok()) return credential.status();
  absl::StatusOr<Admitted> admitted =
      Admit(*credential, &Tenant::requests_in_flight, &Tenant::max_requests_in_flight,
            TenantQuotaName(&TenantQuotas::max_requests_in_flight));
  if (admitted.ok()) {
    credential->tenant->calls_admitted.fetch_add(1, std::memory_order_relaxed);
    admitted->CountAlive(&calls_alive_);
  }
  return admitted;
}

absl::StatusOr<Admitted> Tenants::AdmitLane(absl::string_view token) {
  absl::StatusOr<Credential> credential = Authenticate(token);
  if (!credential.ok()) return credential.status();
  absl::StatusOr<Admitted> admitted =
      Admit(*credential, &Tenant::lane_connections, &Tenant::max_lane_connections,
            TenantQuotaName(&TenantQuotas::max_lane_connections));
  if (admitted.ok()) credential->tenant->lane_connections_admitted.fetch_add(1, std::memory_order_relaxed);
  return admitted;
}

void Tenants::ScopeStats(const Tenant& tenant, v1::Stats& stats) const {
  if (!authenticates()) {
    ScopeStatsFor(StatsViewer::kOnlyCaller, tenant.name, {}, stats);
  } else if (!tenant.admin.load(std::memory_order_relaxed)) {
    ScopeStatsFor(StatsViewer::kTenant, tenant.name, {}, stats);
  } else {
    // Each tenant's own counts, gathered for an admin only, who sees their sum.
    std::vector<v1::Stats> every_tenant;
    for (engine::Engine* engine : Engines()) ToProto(engine->Stats(), &every_tenant.emplace_back());
    ScopeStatsFor(StatsViewer::kAdmin, tenant.name, every_tenant, stats);
  }
}

absl::StatusOr<Handlers*> Tenants::HandlersFor(const Admitted& call, absl::string_view tenant,
                                               const char* admin_only) const {
  const bool admin = call.tenant().admin.load();
  if (admin_only != nullptr && authenticates() && !admin) {
    return absl::PermissionDeniedError(admin_only);
  }
  if (tenant.empty() || tenant == call.tenant().name) return &call.handlers();
  if (!authenticates()) {
    return absl::FailedPreconditionError(
        "tenant: this server has no tenants (it runs without --tokens_file)");
  }
  if (!admin) {
    return absl::PermissionDeniedError("tenant: only an admin token may name another tenant");
  }
  absl::ReaderMutexLock lock(&mutex_);
  const auto found = by_name_.find(tenant);
  if (found == by_name_.end()) {
    return absl::NotFoundError(absl::StrCat("tenant: no tenant is named ", Quoted(tenant)));
  }
  return found->second->parts.handlers;
}

std::vector<const Tenant*> Tenants::All() const {
  absl::ReaderMutexLock lock(&mutex_);
  std::vector<const Tenant*> all;
  all.reserve(by_name_.size());
  for (const auto& [name, tenant] : by_name_) all.push_back(tenant.get());
  return all;
}

std::vector<engine::Engine*> Tenants::Engines() const {
  absl::ReaderMutexLock lock(&mutex_);
  std::vector<engine::Engine*> engines;
  engines.reserve(by_name_.size());
  for (const auto& [name, tenant] : by_name_) engines.push_back(tenant->parts.engine);
  return engines;
}

}  // namespace kvcache::service
