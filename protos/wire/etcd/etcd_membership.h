// A fleet's replicas as etcd lists them (wire/etcd/etcd_fleet.h), for a
// ShardedClient (where to place caches) and for a replica (where its peers
// are): the list is read once, then watched from its revision on, and every
// change hands the whole list to the owner. A watch that breaks (etcd
// restarted, an endpoint gone, history compacted) is followed by a fresh
// read, the next endpoint first, so no change is missed for long.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "wire/etcd/etcd_fleet.h"

namespace kvcache::etcd {

class EtcdMembership {
 public:
  // Every replica listed: name -> the address it listed.
  using OnChange = std::function<void(const std::map<std::string, std::string>& listed)>;
  // Why the list could not be read or watched, once per run of failures (the
  // owner logs it its own way; a library prints nothing itself).
  using OnFailure = std::function<void(const absl::Status& failure)>;

  // Reads the list (UNAVAILABLE where no endpoint answers within `timeout`,
  // each tried in turn), calls `on_change` with it before returning, and then
  // from a thread of its own after each change until destroyed. A zero
  // `timeout` returns at once and leaves the first read to that thread, which
  // retries it until etcd answers. `on_failure` may be null.
  static absl::StatusOr<std::unique_ptr<EtcdMembership>> Start(const EtcdOptions& options,
                                                               absl::Duration timeout,
                                                               OnChange on_change,
                                                               OnFailure on_failure = nullptr);
  ~EtcdMembership();
  // Why the list could not be read or watched the last time it could not
  // (OK once it was read again): for callers asking before the first read.
  absl::Status last_failure() const;

 private:
  EtcdMembership(const EtcdOptions& options, EtcdChannels channels, OnChange on_change,
                 OnFailure on_failure);
  // Range over the prefix: the whole list and its revision.
  absl::Status Read(absl::Duration timeout);
  // Read, retried on the endpoints in turn until `timeout`.
  absl::Status ReadWithin(absl::Duration timeout);
  // How a watch ended, beside its status.
  struct WatchEnd {
    bool answered = false;   // etcd created it (and maybe sent changes)
    bool compacted = false;  // our revision's history is gone: read anew, no failure
  };
  // Applies the changes after revision_ until the stream ends (an error) or
  // the destructor cancels it (OK).
  absl::Status Watch(WatchEnd& end);
  // `read`: the list was read (by Start).
  void Run(bool read);
  void Publish() const;
  // Notes a failure, tells on_failure_ of the first of a run and backs off.
  void Failed(const absl::Status& status, int& failures);

  const std::string prefix_;
  const OnChange on_change_;
  const OnFailure on_failure_;
  EtcdChannels channels_;                      // Run's (Start's before it)
  std::map<std::string, std::string> listed_;  // name -> address; likewise
  int64_t revision_ = 0;                       // of listed_; likewise

  mutable absl::Mutex failure_mu_;
  absl::Status last_failure_ ABSL_GUARDED_BY(failure_mu_);
  StoppableCalls calls_;  // Run's, stopped by the destructor
  std::thread runner_;
};

}  // namespace kvcache::etcd
