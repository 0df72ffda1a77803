#include "etcd_registration.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace kvcache {
namespace {

using etcdserverpb::Compare;

// Unary etcd calls give up after this, so that a hung etcd never holds a
// registration (or a shutdown's revoke) for longer.
constexpr absl::Duration kCallTimeout = absl::Seconds(3);
constexpr absl::Duration kMostBackoff = absl::Seconds(2);

void SetDeadline(grpc::ClientContext& context) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
}

// A transaction that puts the key under `lease` where `compare` holds, and
// reads it otherwise (to say who holds it).
etcdserverpb::TxnRequest PutIf(const Compare& compare, const std::string& key,
                               const std::string& value, int64_t lease) {
  etcdserverpb::TxnRequest txn;
  *txn.add_compare() = compare;
  etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease);
  txn.add_failure()->mutable_request_range()->set_key(key);
  return txn;
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdRegistration>> EtcdRegistration::Start(
    const EtcdRegistrationConfig& config, prometheus::Registry& metrics) {
  if (config.name.empty()) {
    return absl::InvalidArgumentError(
        "replica_name: a replica listed in etcd needs a name (it is the key)");
  }
  if (config.address.empty()) {
    return absl::InvalidArgumentError(
        "advertise_address: the host:port clients reach this replica at (its listen address "
        "names no single host)");
  }
  if (config.lease_ttl < absl::Seconds(2)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "etcd_lease_ttl: ", absl::FormatDuration(config.lease_ttl), " is below etcd's 2 s"));
  }
  absl::StatusOr<etcd::EtcdChannels> channels = etcd::EtcdChannels::Make(config.etcd);
  if (!channels.ok()) return channels.status();
  prometheus::Gauge& listed =
      prometheus::BuildGauge()
          .Name("kvcached_etcd_listed")
          .Help("1 while this replica is listed in etcd (its key put, its lease kept)")
          .Register(metrics)
          .Add({});
  std::unique_ptr<EtcdRegistration> registration(
      new EtcdRegistration(config, *std::move(channels), listed));
  if (absl::Status registered = registration->Register(); !registered.ok()) {
    if (absl::IsFailedPrecondition(registered)) return registered;
    LogWarning("etcd: cannot list replica %s yet (trying again): %s", config.name,
               registered.message());
    registration->channels_.Next();
  }
  registration->runner_ = std::thread([raw = registration.get()] { raw->Run(); });
  return registration;
}

EtcdRegistration::EtcdRegistration(const EtcdRegistrationConfig& config,
                                   etcd::EtcdChannels channels, prometheus::Gauge& listed_gauge)
    : config_(config),
      key_(etcd::ReplicaKey(config.etcd.prefix, config.name)),
      channels_(std::move(channels)),
      listed_gauge_(listed_gauge) {}

EtcdRegistration::~EtcdRegistration() { Withdraw(); }

bool EtcdRegistration::listed() const {
  absl::MutexLock lock(&mu_);
  return listed_;
}

void EtcdRegistration::SetListed(bool listed) {
  absl::MutexLock lock(&mu_);
  listed_ = listed;
  listed_gauge_.Set(listed ? 1 : 0);
}

bool EtcdRegistration::WaitStopping(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&stopping_), timeout);
}

absl::Status EtcdRegistration::Register() {
  const std::string& endpoint = channels_.current_endpoint();
  auto lease = etcdserverpb::Lease::NewStub(channels_.current());
  etcdserverpb::LeaseGrantRequest grant;
  grant.set_ttl(static_cast<int64_t>(std::ceil(absl::ToDoubleSeconds(config_.lease_ttl))));
  etcdserverpb::LeaseGrantResponse granted;
  {
    grpc::ClientContext context;
    SetDeadline(context);
    if (grpc::Status status = lease->LeaseGrant(&context, grant, &granted); !status.ok()) {
      return etcd::EtcdError(status, "LeaseGrant", endpoint);
    }
  }
  if (!granted.error().empty()) {
    return absl::UnavailableError(absl::StrCat("etcd at ", endpoint, ": ", granted.error()));
  }
  // Put where no one holds the key; else where it names this address (the
  // previous run's entry, its lease still running).
  Compare unheld;
  unheld.set_target(Compare::CREATE);
  unheld.set_result(Compare::EQUAL);
  unheld.set_key(key_);
  unheld.set_create_revision(0);
  Compare ours;
  ours.set_target(Compare::VALUE);
  ours.set_result(Compare::EQUAL);
  ours.set_key(key_);
  ours.set_value(config_.address);
  auto kv = etcdserverpb::KV::NewStub(channels_.current());
  std::string holder;
  for (const Compare& compare : {unheld, ours}) {
    etcdserverpb::TxnResponse answer;
    grpc::ClientContext context;
    SetDeadline(context);
    if (grpc::Status status =
            kv->Txn(&context, PutIf(compare, key_, config_.address, granted.id()), &answer);
        !status.ok()) {
      return etcd::EtcdError(status, "Txn", endpoint);  // the lease runs out by itself
    }
    if (answer.succeeded()) {
      lease_id_ = granted.id();
      SetListed(true);
      LogInfo("etcd: listed as %s -> %s (lease %x, %d s) at %s", key_, config_.address,
              granted.id(), granted.ttl(), endpoint);
      return absl::OkStatus();
    }
    const auto& range = answer.responses(0).response_range();
    holder = range.kvs_size() > 0 ? range.kvs(0).value() : "";
  }
  grpc::ClientContext context;
  SetDeadline(context);
  etcdserverpb::LeaseRevokeRequest revoke;
  revoke.set_id(granted.id());
  etcdserverpb::LeaseRevokeResponse revoked;
  lease->LeaseRevoke(&context, revoke, &revoked);  // else it runs out by itself
  return absl::FailedPreconditionError(
      absl::StrCat("replica_name: \"", config_.name, "\" is listed in etcd (", key_, ") by ",
                   holder, ", not ", config_.address, ": two replicas must not share a name"));
}

absl::Status EtcdRegistration::KeepAlive() {
  auto lease = etcdserverpb::Lease::NewStub(channels_.current());
  grpc::ClientContext context;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::OkStatus();
    stream_context_ = &context;
  }
  auto stream = lease->LeaseKeepAlive(&context);
  absl::Status ended;
  bool finished = false;
  etcdserverpb::LeaseKeepAliveRequest request;
  request.set_id(lease_id_);
  etcdserverpb::LeaseKeepAliveResponse answer;
  while (true) {
    if (!stream->Write(request) || !stream->Read(&answer)) {
      while (stream->Read(&answer)) {
      }
      ended = etcd::EtcdError(stream->Finish(), "LeaseKeepAlive", channels_.current_endpoint());
      finished = true;
      break;
    }
    if (answer.ttl() <= 0) {
      ended = absl::NotFoundError(absl::StrCat("lease ", absl::Hex(lease_id_), " is gone"));
      break;
    }
    if (WaitStopping(absl::Seconds(answer.ttl()) / 3)) break;
  }
  if (!finished) {
    context.TryCancel();
    while (stream->Read(&answer)) {
    }
    stream->Finish();
  }
  absl::MutexLock lock(&mu_);
  stream_context_ = nullptr;
  return stopping_ ? absl::OkStatus() : ended;
}

void EtcdRegistration::Run() {
  int failures = 0;
  while (!WaitStopping(absl::ZeroDuration())) {
    absl::Status step = lease_id_ == 0 ? Register() : KeepAlive();
    if (step.ok()) {
      failures = 0;
      continue;
    }
    if (absl::IsNotFound(step)) {  // the lease ran out: list the replica anew, now
      LogWarning("etcd: %s; listing %s again", step.message(), key_);
      lease_id_ = 0;
      SetListed(false);
      continue;
    }
    if (failures++ == 0) LogWarning("etcd: %s (trying again)", step.message());
    if (!absl::IsFailedPrecondition(step)) channels_.Next();
    WaitStopping(etcd::EtcdBackoff(failures, kMostBackoff));
  }
}

void EtcdRegistration::Withdraw() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && !runner_.joinable()) return;
    stopping_ = true;
    if (stream_context_ != nullptr) stream_context_->TryCancel();
  }
  if (runner_.joinable()) runner_.join();
  if (lease_id_ == 0) return;
  // Revoking the lease deletes the key: clients stop placing caches here at once.
  grpc::ClientContext context;
  SetDeadline(context);
  etcdserverpb::LeaseRevokeRequest revoke;
  revoke.set_id(lease_id_);
  etcdserverpb::LeaseRevokeResponse revoked;
  grpc::Status status =
      etcdserverpb::Lease::NewStub(channels_.current())->LeaseRevoke(&context, revoke, &revoked);
  if (status.ok()) {
    LogInfo("etcd: %s withdrawn", key_);
  } else {
    LogWarning("etcd: cannot withdraw %s (its lease runs out within %s): %s", key_,
               absl::FormatDuration(config_.lease_ttl), status.error_message());
  }
  lease_id_ = 0;
  SetListed(false);
}

}  // namespace kvcache
