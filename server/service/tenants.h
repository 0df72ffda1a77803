// Who is calling: every gRPC call and every data-lane connection is admitted
// for one tenant before it reaches Handlers, and each tenant has an engine of
// its own (its own ids, snapshots, prefix index and saved files) over the one
// shared page pool. Another tenant's id is then unknown by construction: the
// same lookup in a map that never held it, with the same NOT_FOUND and the
// same timing as any id nobody holds, and a prefix lookup never walks another
// tenant's index.
//
// Without a tokens file there is one anonymous tenant and every call is
// admitted, token or not (as before tenants existed). With one, a call needs
// `authorization: Bearer <token>` (the lane: an AUTH frame first) naming a
// tenant of the file; others are UNAUTHENTICATED. Reload (on SIGHUP) re-reads
// the file: new tokens and quotas apply to the next call; a tenant left out
// can no longer call, but keeps what it holds (leases still run) and gets it
// back if it returns.
//
// A reload reaches what is under way too. From the moment it lands, a token
// left out or moved to another tenant admits nothing more: the next Update
// message of a stream (gRPC or lane), the next chunk of a Fetch or of an
// ExportSnapshot, and the next frame of a lane connection are refused
// UNAUTHENTICATED, and a lane
// connection is then closed. What had passed that check before completes:
// an Update message being applied (it applies atomically), a unary call
// (admitted whole when it arrived), a file import or pull under way.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/engine.h"
#include "kvcache/v1/kvcache.pb.h"
#include "service/handlers.h"
#include "service/tokens_file.h"

namespace kvcache::service {

// What a tenant's calls run on; made by the server (kv_server.cc), which
// knows how to build an engine.
struct TenantParts {
  std::shared_ptr<void> owned;  // keeps the two below alive
  Handlers* handlers = nullptr;
  engine::Engine* engine = nullptr;
};
using TenantFactory = std::function<absl::StatusOr<TenantParts>(const TenantConfig& config)>;

// The two ways K/V bytes reach the server, counted apart for metrics.
enum class Transport { kGrpc = 0, kLane = 1 };
constexpr std::array<Transport, 2> kTransports = {Transport::kGrpc, Transport::kLane};
const char* TransportName(Transport transport);

struct TransportBytes {
  std::atomic<uint64_t> received{0};
  std::atomic<uint64_t> sent{0};
};

struct Tenant {
  std::string name;  // "" for the anonymous tenant
  TenantParts parts;
  // From the tokens file; changed by a reload.
  std::atomic<bool> admin{false};
  std::atomic<uint32_t> max_requests_in_flight{0};  // 0: no limit
  std::atomic<uint32_t> max_lane_connections{0};
  // Gauges of what is admitted now.
  std::atomic<uint32_t> requests_in_flight{0};
  std::atomic<uint32_t> lane_connections{0};
  // Totals since start, for metrics.
  std::atomic<uint64_t> calls_admitted{0};
  std::atomic<uint64_t> lane_connections_admitted{0};
  std::array<TransportBytes, kTransports.size()> bytes;

  TransportBytes& bytes_on(Transport transport) { return bytes[static_cast<size_t>(transport)]; }
};

// A call or lane connection admitted for a tenant; it counts against the
// tenant's limit until this goes.
class Tenants;

class Admitted {
 public:
  Admitted() = default;
  Admitted(Tenant* tenant, std::atomic<uint32_t>* gauge) : tenant_(tenant), gauge_(gauge) {}
  Admitted(Admitted&& other) noexcept { *this = std::move(other); }
  Admitted& operator=(Admitted&& other) noexcept;
  ~Admitted() { Release(); }

  bool ok() const { return tenant_ != nullptr; }
  // OK while the token it was admitted with still names its tenant; after a
  // reload that dropped or moved that token, UNAUTHENTICATED from then on
  // (tenants.h says what that ends). One atomic load while no reload came.
  absl::Status StillAdmitted() const;
  // The call is about to answer: it stops counting against the tenant's
  // limit now, before the client can see the answer, so a client that waits
  // for each answer before its next call never meets its own last call (gRPC
  // destroys a call's reactor only after the client has its status). The
  // tenant stays reachable until this goes.
  void Answering() const;
  // Counts the call in `alive` until this goes (when gRPC is done with it).
  void CountAlive(std::atomic<uint32_t>* alive);
  Tenant& tenant() const { return *tenant_; }
  Handlers& handlers() const { return *tenant_->parts.handlers; }
  // Request and response bytes of the call or connection, for metrics.
  void CountReceived(Transport transport, uint64_t bytes) const {
    tenant_->bytes_on(transport).received.fetch_add(bytes, std::memory_order_relaxed);
  }
  void CountSent(Transport transport, uint64_t bytes) const {
    tenant_->bytes_on(transport).sent.fetch_add(bytes, std::memory_order_relaxed);
  }

 private:
  friend class Tenants;
  void Release();
  Tenant* tenant_ = nullptr;
  // Where it was admitted by a token, and which: StillAdmitted asks again
  // after each reload (null: no tokens file, nothing to revoke).
  const Tenants* tenants_ = nullptr;
  TokenDigest token_{};
  // The tokens file's generation the token was last found in; revoked_ once
  // it was not (for good: a connection is not let back in by a later reload).
  mutable std::atomic<uint64_t> checked_generation_{0};
  mutable std::atomic<bool> revoked_{false};
  // Taken once, by Answering or Release, whichever comes first.
  mutable std::atomic<std::atomic<uint32_t>*> gauge_{nullptr};
  std::atomic<uint32_t>* alive_ = nullptr;  // CountAlive's; released by Release
};

class Tenants {
 public:
  // One anonymous tenant, whose calls run on `anonymous`.
  explicit Tenants(TenantParts anonymous);
  // The tenants of a tokens file, each made by `factory`.
  static absl::StatusOr<std::unique_ptr<Tenants>> Open(const std::string& tokens_file,
                                                       TenantFactory factory);

  // Whether calls need a token (a tokens file is in use).
  bool authenticates() const { return !path_.empty(); }
  // Counts the tokens files applied; a call admitted under an older one asks
  // again (Admitted::StillAdmitted).
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  // Re-reads the tokens file. A file that does not parse changes nothing
  // (INVALID_ARGUMENT naming the line).
  absl::Status Reload();

  // A gRPC call, given its `authorization` metadata ("" when absent):
  // UNAUTHENTICATED without a known token, RESOURCE_EXHAUSTED naming
  // max_requests_in_flight past the tenant's limit.
  absl::StatusOr<Admitted> AdmitCall(absl::string_view authorization);
  // A data-lane connection, given its AUTH frame's token (RESOURCE_EXHAUSTED
  // naming max_lane_connections past the tenant's limit).
  absl::StatusOr<Admitted> AdmitLane(absl::string_view token);

  // The handlers a call acts through when its request names `tenant`: the
  // caller's own for "" or its own name; another tenant's only for an admin
  // (NOT_FOUND naming tenant when none has that name); PERMISSION_DENIED
  // naming tenant for anyone else, whether or not that tenant exists, and
  // FAILED_PRECONDITION on a server without tenants. A call with
  // `admin_only` set (the reason) is PERMISSION_DENIED for a tenant that is
  // not an admin, whatever it names; without tenants the one caller is.
  absl::StatusOr<Handlers*> HandlersFor(const Admitted& call, absl::string_view tenant,
                                        const char* admin_only = nullptr) const;

  // GetStats as `tenant` may see it: its own caches, snapshots and prefixes;
  // the pool's use by everyone (pages used, tiers, evictions) only when it is
  // the only tenant or an admin, who sees every tenant's counts summed.
  // Each field's scope is declared in stats_scopes.h.
  void ScopeStats(const Tenant& tenant, v1::Stats& stats) const;
  // gRPC calls admitted that gRPC has not yet finished with (their answer
  // may still be on its way): a shutdown waits for these, not for clients.
  uint32_t calls_alive() const { return calls_alive_.load(); }
  // Every tenant's engine, for server-wide work (eviction across tenants).
  std::vector<engine::Engine*> Engines() const;
  // Every tenant ever named (for metrics), in no set order. Tenants are never
  // erased, so the pointers stay valid.
  std::vector<const Tenant*> All() const;
  // The anonymous tenant's engine; null where there are tenants.
  engine::Engine* anonymous_engine() const {
    return anonymous_ ? anonymous_->parts.engine : nullptr;
  }

 private:
  Tenants() = default;
  friend class Admitted;
  // Who a token names: its tenant, its digest and the generation it was
  // found in.
  struct Credential {
    Tenant* tenant = nullptr;
    TokenDigest digest{};
    uint64_t generation = 0;
  };
  absl::StatusOr<Credential> Authenticate(absl::string_view token) const;
  absl::StatusOr<Admitted> Admit(const Credential& credential, std::atomic<uint32_t> Tenant::*gauge,
                                 std::atomic<uint32_t> Tenant::*limit,
                                 absl::string_view limit_name);
  // Whether `admitted`'s token still names its tenant in the tokens file in
  // force; records the generation it was found in.
  absl::Status Recheck(const Admitted& admitted) const;
  absl::Status Apply(std::vector<TenantConfig> configs) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  std::string path_;  // empty: the anonymous tenant only
  TenantFactory factory_;
  mutable absl::Mutex mutex_;
  // Every tenant ever named, never erased: a call under way keeps its Tenant.
  absl::flat_hash_map<std::string, std::unique_ptr<Tenant>> by_name_ ABSL_GUARDED_BY(mutex_);
  // Those the tokens file names now, in its order, and their tokens.
  std::vector<Tenant*> active_ ABSL_GUARDED_BY(mutex_);
  std::unique_ptr<TokenDirectory> tokens_ ABSL_GUARDED_BY(mutex_);
  std::atomic<uint64_t> generation_{0};  // written under mutex_
  Tenant* anonymous_ = nullptr;
  std::atomic<uint32_t> calls_alive_{0};
};

}  // namespace kvcache::service
