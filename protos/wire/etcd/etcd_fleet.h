// What a replica's registration (server/fleet/etcd_registration.h) and a fleet
// client's membership (client/etcd_membership.h) share: where in etcd a
// replica is listed, and how either side reaches etcd.
//
// A replica is listed as the key <prefix><replica name> whose value is the
// host:port of its gRPC port, attached to a lease that the replica keeps
// alive: one that stops, dies or loses etcd for a lease's length leaves the
// list by itself, and the list is never a table of ours to keep in step.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace grpc {
class Channel;
class ClientContext;
class Status;
}  // namespace grpc

namespace kvcache::etcd {

struct EtcdOptions {
  // Comma-separated etcd endpoints, each host:port, http://host:port or
  // https://host:port (TLS); empty: no etcd.
  std::string endpoints;
  // Where replicas are listed: every key below it is one.
  std::string prefix = "/kvcached/replicas/";
  // PEM files: the CA that signed etcd's certificate (TLS to every endpoint
  // when set; https:// endpoints without it trust the system's roots), and
  // this side's certificate and key where etcd asks for one
  // (--client-cert-auth, etcd's way to admit only its own fleet).
  std::string ca_file, cert_file, key_file;
};

// One gRPC channel per endpoint, and the one in use: after an UNAVAILABLE
// answer the caller moves to the next (etcd's members all serve the API).
// Used by one thread at a time.
class EtcdChannels {
 public:
  static absl::StatusOr<EtcdChannels> Make(const EtcdOptions& options);

  const std::shared_ptr<grpc::Channel>& current() const { return channels_[current_]; }
  const std::string& current_endpoint() const { return endpoints_[current_]; }
  void Next() { current_ = (current_ + 1) % channels_.size(); }

 private:
  std::vector<std::string> endpoints_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  size_t current_ = 0;
};

// A background thread's stop signal, which also cancels the etcd call the
// thread is in (one at a time): a stop is never held up by a call that
// waits on an etcd gone quiet. Calls made after the stop fail at once.
class StoppableCalls {
 public:
  // A client context, with a deadline unless `timeout` is infinite, that
  // Stop cancels while it lives.
  class Call {
   public:
    Call(StoppableCalls& calls, absl::Duration timeout);
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    grpc::ClientContext* get() { return context_.get(); }

   private:
    StoppableCalls& calls_;
    std::unique_ptr<grpc::ClientContext> context_;
  };

  void Stop();
  // Waits up to `timeout` for Stop; whether it came.
  bool WaitStopping(absl::Duration timeout);
  bool stopping() { return WaitStopping(absl::ZeroDuration()); }

 private:
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* in_flight_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// The key replica `name` is listed under.
std::string ReplicaKey(absl::string_view prefix, absl::string_view name);
// The end of the key range that holds every key beginning with `prefix`
// (etcd's range_end: the prefix with its last byte below 0xff plus one).
std::string PrefixRangeEnd(absl::string_view prefix);
// The replica a key lists; an error naming the key where the rest of it is
// not a replica name (wire/ids/replica_id.h), which a client skips.
absl::StatusOr<std::string> ReplicaOfKey(absl::string_view prefix, absl::string_view key);

// An etcd call's failure as an absl::Status saying what was asked of which endpoint.
absl::Status EtcdError(const grpc::Status& status, absl::string_view what,
                       absl::string_view endpoint);

// How long to wait before the next try after `failures` failures in a row:
// 100 ms doubling to `most`.
absl::Duration EtcdBackoff(int failures, absl::Duration most);

}  // namespace kvcache::etcd
