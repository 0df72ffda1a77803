// Lists this replica in etcd while it serves (wire/etcd/etcd_fleet.h), so that
// fleet clients watching the list place caches on it, and take it off the
// list when it stops or can no longer keep its lease.
//
// The listing is a key attached to a lease, renewed every third of its TTL
// by a keep-alive that must answer within that third (so a hung etcd member
// is left for the next while the lease still runs), after which the key is
// read back: a lease that ran out (etcd unreachable for a TTL, a revoke) or
// a key that went (deleted by hand) is listed anew. An etcd that does not
// answer is tried again, the next endpoint first, with backoff. Names are
// unique in a fleet: a key held by another address is left alone (the start
// fails when it is held then; later it is tried again until that holder's
// lease runs out), while a key held by this address (this replica's previous
// run, its lease not yet run out) is taken over.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "wire/etcd/etcd_fleet.h"

namespace prometheus {
class Registry;
template <typename T>
class Family;
class Gauge;
}  // namespace prometheus

namespace kvcache {

struct EtcdRegistrationConfig {
  etcd::EtcdOptions etcd;  // no endpoints: no registration
  // The replica's --replica_name and the host:port clients reach its gRPC port at.
  std::string name;
  std::string address;
  // How long the listing outlives the replica's last keep-alive (etcd's
  // least is about 2 s).
  absl::Duration lease_ttl = absl::Seconds(10);
};

class EtcdRegistration {
 public:
  // Lists the replica. Fails on bad options and where the name is listed by
  // another address; an etcd that cannot be reached is logged and tried
  // again in the background (orchestrators start etcd and replicas at once).
  static absl::StatusOr<std::unique_ptr<EtcdRegistration>> Start(
      const EtcdRegistrationConfig& config, prometheus::Registry& metrics);
  ~EtcdRegistration();  // Withdraw()

  // Takes the replica off the list (its lease revoked) and stops keeping it;
  // the first step of a shutdown. Idempotent.
  void Withdraw();
  // Whether the key is in etcd, as far as the last answer said.
  bool listed() const;

 private:
  EtcdRegistration(const EtcdRegistrationConfig& config, etcd::EtcdChannels channels,
                   prometheus::Gauge& listed_gauge);
  // Grants a lease and puts the key under it (or takes it over, see above).
  absl::Status Register();
  // One keep-alive of the lease, then a read of the key: NOT_FOUND where
  // either is gone.
  absl::Status Renew();
  void Run();
  void SetListed(bool listed);

  const EtcdRegistrationConfig config_;
  const std::string key_;
  etcd::EtcdChannels channels_;  // Run's (and Start's before it)
  int64_t lease_id_ = 0;         // likewise; 0: none held
  prometheus::Gauge& listed_gauge_;

  etcd::StoppableCalls calls_;  // Run's, stopped by Withdraw
  mutable absl::Mutex mu_;
  bool listed_ ABSL_GUARDED_BY(mu_) = false;
  std::thread runner_;
};

}  // namespace kvcache
