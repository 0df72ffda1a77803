// Where this replica finds the other replicas of its fleet, by name, for
// PullSnapshot (which reads a snapshot from the replica its id names). An
// address comes from the operator's own list (kvcached --peers) or from the
// fleet's list in etcd (one key read per lookup, so a replica that moved is
// found where it is now); never from a request, so no caller can point this
// replica at a host of its choosing.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "etcd/etcd_fleet.h"

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
  // The fleet's etcd list, asked for a name the operator's list lacks; no
  // endpoints: none.
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
  using Found = absl::AnyInvocable<void(absl::StatusOr<std::shared_ptr<grpc::Channel>>) &&>;

  static absl::StatusOr<std::unique_ptr<Peers>> Make(PeersConfig config);
  ~Peers();

  // Whether any peer can be found (a list, or etcd).
  bool empty() const { return config_.listed.empty() && !etcd_; }
  // A pull buffers a whole snapshot that a request of a few bytes asked
  // for, so few run at once: false when kMaxPulls do (EndPull frees one).
  bool BeginPull();
  void EndPull() { pulls_.fetch_sub(1, std::memory_order_relaxed); }
  static constexpr int kMaxPulls = 4;
  // Calls `found` once, inline or from a gRPC thread, with a channel to
  // replica `name`, or NOT_FOUND naming snapshot_id where no list has it
  // (UNAVAILABLE where etcd could not be asked, or lists no host:port).
  void Find(const std::string& name, Found found);

 private:
  explicit Peers(PeersConfig config) : config_(std::move(config)) {}
  struct EtcdLookup;
  std::shared_ptr<grpc::Channel> ChannelTo(const std::string& address);

  const PeersConfig config_;
  std::atomic<int> pulls_{0};
  absl::Mutex mu_;
  std::unique_ptr<etcd::EtcdChannels> etcd_ ABSL_PT_GUARDED_BY(mu_);  // set by Make only
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcache::service
