#include "wire/etcd/etcd_membership.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"

namespace kvcache::etcd {
namespace {

constexpr absl::Duration kReadTimeout = absl::Seconds(5);
constexpr absl::Duration kMostBackoff = absl::Seconds(2);

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdMembership>> EtcdMembership::Start(const EtcdOptions& options,
                                                                      absl::Duration timeout,
                                                                      OnChange on_change,
                                                                      OnFailure on_failure) {
  absl::StatusOr<EtcdChannels> channels = EtcdChannels::Make(options);
  if (!channels.ok()) return channels.status();
  std::unique_ptr<EtcdMembership> membership(new EtcdMembership(
      options, *std::move(channels), std::move(on_change), std::move(on_failure)));
  const bool read = timeout > absl::ZeroDuration();
  if (read) {
    if (absl::Status status = membership->ReadWithin(timeout); !status.ok()) return status;
    membership->Publish();
  }
  membership->runner_ = std::thread([raw = membership.get(), read] { raw->Run(read); });
  return membership;
}

absl::Status EtcdMembership::ReadWithin(absl::Duration timeout) {
  // The endpoints in turn, each for up to 2 s (one that is unreachable must
  // not use up the whole timeout), backing off where all refuse at once.
  const absl::Time deadline = absl::Now() + timeout;
  for (int attempt = 1;; ++attempt) {
    absl::Status read = Read(std::min(deadline - absl::Now(), absl::Seconds(2)));
    if (read.ok()) return read;
    const bool retry = absl::IsUnavailable(read) || absl::IsDeadlineExceeded(read);
    if (!retry || absl::Now() >= deadline) {
      return absl::Status(retry ? absl::StatusCode::kUnavailable : read.code(), read.message());
    }
    channels_.Next();
    absl::SleepFor(std::min(EtcdBackoff(attempt, absl::Milliseconds(500)), deadline - absl::Now()));
  }
}

EtcdMembership::EtcdMembership(const EtcdOptions& options, EtcdChannels channels,
                               OnChange on_change, OnFailure on_failure)
    : prefix_(options.prefix),
      on_change_(std::move(on_change)),
      on_failure_(std::move(on_failure)),
      channels_(std::move(channels)) {}

EtcdMembership::~EtcdMembership() {
  calls_.Stop();
  if (runner_.joinable()) runner_.join();
}

absl::Status EtcdMembership::Read(absl::Duration timeout) {
  etcdserverpb::RangeRequest request;
  request.set_key(prefix_);
  request.set_range_end(PrefixRangeEnd(prefix_));
  etcdserverpb::RangeResponse answer;
  StoppableCalls::Call call(calls_, timeout);
  if (grpc::Status status =
          etcdserverpb::KV::NewStub(channels_.current())->Range(call.get(), request, &answer);
      !status.ok()) {
    return EtcdError(status, absl::StrCat("Range ", prefix_), channels_.current_endpoint());
  }
  listed_.clear();
  for (const mvccpb::KeyValue& kv : answer.kvs()) {
    absl::StatusOr<std::string> name = ReplicaOfKey(prefix_, kv.key());
    if (!name.ok()) continue;  // not a replica's key: never one to place caches on
    listed_[*name] = kv.value();
  }
  revision_ = answer.header().revision();
  absl::MutexLock lock(&failure_mu_);
  last_failure_ = absl::OkStatus();
  return absl::OkStatus();
}

absl::Status EtcdMembership::Watch(WatchEnd& end) {
  // A watch has no deadline: it lasts until it breaks or the destructor cancels it.
  StoppableCalls::Call call(calls_, absl::InfiniteDuration());
  // A member cut off from its cluster's leader cancels the watch rather
  // than serving a list that no longer changes (etcd's WithRequireLeader).
  call.get()->AddMetadata("hasleader", "true");
  auto stream = etcdserverpb::Watch::NewStub(channels_.current())->Watch(call.get());
  etcdserverpb::WatchRequest request;
  etcdserverpb::WatchCreateRequest* create = request.mutable_create_request();
  create->set_key(prefix_);
  create->set_range_end(PrefixRangeEnd(prefix_));
  create->set_start_revision(revision_ + 1);
  absl::Status ended;  // OK: the stream ended by itself (an error, or etcd gone)
  etcdserverpb::WatchResponse answer;
  if (stream->Write(request)) {
    while (stream->Read(&answer)) {
      if (answer.compact_revision() > 0) {
        // History after our revision is gone: read the list anew, at once.
        end.compacted = true;
        ended = absl::AbortedError("compacted");
        call.get()->TryCancel();
        continue;  // until the stream ends
      }
      if (answer.canceled()) {
        ended = absl::UnavailableError(
            absl::StrCat("etcd canceled the watch of ", prefix_, ": ", answer.cancel_reason()));
        call.get()->TryCancel();
        continue;
      }
      // Neither refused nor compacted away: etcd serves this watch.
      end.answered = true;
      bool changed = false;
      for (const mvccpb::Event& event : answer.events()) {
        absl::StatusOr<std::string> name = ReplicaOfKey(prefix_, event.kv().key());
        if (!name.ok()) continue;
        if (event.type() == mvccpb::Event::PUT) {
          changed |= !listed_.contains(*name) || listed_[*name] != event.kv().value();
          listed_[*name] = event.kv().value();
        } else {
          changed |= listed_.erase(*name) > 0;
        }
      }
      revision_ = std::max(revision_, answer.header().revision());
      if (changed) Publish();
    }
  }
  grpc::Status finished = stream->Finish();
  if (calls_.stopping()) return absl::OkStatus();
  if (!ended.ok()) return ended;
  return EtcdError(
      finished.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stream closed") : finished,
      absl::StrCat("Watch ", prefix_), channels_.current_endpoint());
}

void EtcdMembership::Run(bool read) {
  int failures = 0;
  while (!calls_.stopping()) {
    if (!read) {
      absl::Status reread = Read(kReadTimeout);
      if (!reread.ok()) {
        Failed(reread, failures);
        continue;
      }
      read = true;
      Publish();
    }
    WatchEnd end;
    const absl::Time started = absl::Now();
    absl::Status watched = Watch(end);
    // Only a watch that etcd served for a while ends a run of failures: one
    // refused at once (no permission, canceled, a proxy that closes it just
    // after etcd created it) keeps backing off rather than reading the list
    // again ten times a second.
    if (end.answered && absl::Now() - started >= kMostBackoff) failures = 0;
    if (watched.ok()) continue;  // stopping
    read = false;                // the list may have changed meanwhile
    if (!end.compacted) Failed(watched, failures);
  }
}

void EtcdMembership::Failed(const absl::Status& status, int& failures) {
  if (calls_.stopping()) return;  // the destructor's cancellation, no failure
  {
    absl::MutexLock lock(&failure_mu_);
    last_failure_ = status;
  }
  if (failures++ == 0 && on_failure_ != nullptr) on_failure_(status);
  channels_.Next();
  calls_.WaitStopping(EtcdBackoff(failures, kMostBackoff));
}

absl::Status EtcdMembership::last_failure() const {
  absl::MutexLock lock(&failure_mu_);
  return last_failure_;
}

void EtcdMembership::Publish() const { on_change_(listed_); }

}  // namespace kvcache::etcd
