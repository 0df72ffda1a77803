// Where this replica finds the other replicas of its fleet, by name, for
// PullSnapshot (which reads a snapshot from the replica its id names). An
// address comes from the operator's own list (kvcached --peers) or from the
// fleet's list in etcd, which this replica watches (so a replica that moved
// is found where it is now, and a lookup asks etcd nothing: a caller naming
// made-up replicas costs etcd no reads); never from a request, so no caller
// can point this replica at a host of its choosing.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "wire/etcd/etcd_fleet.h"
#include "wire/etcd/etcd_membership.h"

namespace grpc {
class Channel;
class ChannelCredentials;
}  // namespace grpc

namespace kvcache::service {

struct PeersConfig {
  // This replica's name: never a peer of its own (skipped in `listed`).
  std::string self;
  // name -> host:port, as the operator listed them (ParsePeerList).
  std::map<std::string, std::string> listed;
  // The fleet's etcd list, watched, for the names the operator's list lacks;
  // no endpoints: none.
  etcd::EtcdOptions etcd;
  // How to reach a peer (TLS where the fleet serves it).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
};

// "name=host:port,name=host:port" as a map; INVALID_ARGUMENT naming `field`
// for an entry that is not one (an address is host:port and nothing else),
// a bad name, or a name given twice.
absl::StatusOr<std::map<std::string, std::string>> ParsePeerList(absl::string_view list,
                                                                 absl::string_view field);

class Peers {
 public:
  // Starts watching etcd's list, where there is one, without waiting for it.
  static absl::StatusOr<std::unique_ptr<Peers>> Make(PeersConfig config);
  ~Peers();

  // Whether any peer can be found (a list, or etcd).
  bool empty() const { return config_.listed.empty() && !membership_; }
  // A pull buffers a whole snapshot that a request of a few bytes asked
  // for, so few run at once: false when kMaxPulls do (EndPull frees one).
  bool BeginPull();
  void EndPull() { pulls_.fetch_sub(1, std::memory_order_relaxed); }
  static constexpr int kMaxPulls = 4;
  // A channel to replica `name`, or NOT_FOUND naming snapshot_id where no
  // list has it (UNAVAILABLE where etcd's list has not been read yet, or
  // gives no host:port for it).
  absl::StatusOr<std::shared_ptr<grpc::Channel>> Find(const std::string& name)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit Peers(PeersConfig config) : config_(std::move(config)) {}
  // The watch's: the whole list as etcd has it now.
  void SetEtcdList(const std::map<std::string, std::string>& listed) ABSL_LOCKS_EXCLUDED(mu_);
  std::shared_ptr<grpc::Channel> ChannelToLocked(const std::string& address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PeersConfig config_;
  std::atomic<int> pulls_{0};
  absl::Mutex mu_;
  bool etcd_read_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, std::string> etcd_listed_ ABSL_GUARDED_BY(mu_);
  // By address; those no list names any more are dropped.
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  // Last, so that it stops (and calls SetEtcdList no more) first.
  std::unique_ptr<etcd::EtcdMembership> membership_;
};

}  // namespace kvcache::service
