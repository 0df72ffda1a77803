#include "fleet/etcd_registration.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "wire/net/address.h"

namespace kvcache {
namespace {

using etcdserverpb::Compare;

// Each etcd call gives up after this, so that a hung etcd never holds a
// registration (or a shutdown's revoke) for longer.
constexpr absl::Duration kCallTimeout = absl::Seconds(3);
constexpr absl::Duration kMostBackoff = absl::Seconds(2);

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

// host:port that clients connect to; whether the host is a loopback one.
absl::StatusOr<bool> CheckAdvertised(absl::string_view address) {
  absl::StatusOr<net::HostPort> advertised =
      net::ParseHostPort(address, "advertise_address", net::AddressUse::kConnect);
  if (!advertised.ok()) return advertised.status();
  return net::IsLoopbackHost(advertised->host);
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
  absl::StatusOr<bool> loopback = CheckAdvertised(config.address);
  if (!loopback.ok()) return loopback.status();
  if (*loopback) {
    LogWarning(
        "etcd: listing %s, a loopback address: only clients on this host reach it "
        "(--advertise_address names another)",
        config.address);
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

absl::Status EtcdRegistration::Register() {
  const std::string& endpoint = channels_.current_endpoint();
  auto lease = etcdserverpb::Lease::NewStub(channels_.current());
  etcdserverpb::LeaseGrantRequest grant;
  grant.set_ttl(static_cast<int64_t>(std::ceil(absl::ToDoubleSeconds(config_.lease_ttl))));
  etcdserverpb::LeaseGrantResponse granted;
  {
    etcd::StoppableCalls::Call call(calls_, kCallTimeout);
    if (grpc::Status status = lease->LeaseGrant(call.get(), grant, &granted); !status.ok()) {
      return etcd::EtcdError(status, "LeaseGrant", endpoint);
    }
  }
  if (!granted.error().empty()) {
    return absl::UnavailableError(absl::StrCat("etcd at ", endpoint, ": ", granted.error()));
  }
  // Put where no one holds the key; else where it names this address (the
  // previous run's entry, its lease still running). A key that went between
  // the two reads is tried again.
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
  for (int attempt = 0; attempt < 6 && (attempt == 0 || holder.empty()); ++attempt) {
    const Compare& compare = attempt % 2 == 0 ? unheld : ours;
    etcdserverpb::TxnResponse answer;
    etcd::StoppableCalls::Call call(calls_, kCallTimeout);
    if (grpc::Status status =
            kv->Txn(call.get(), PutIf(compare, key_, config_.address, granted.id()), &answer);
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
    if (holder == config_.address) holder.clear();  // ours after all: put it under this lease
  }
  etcd::StoppableCalls::Call call(calls_, kCallTimeout);
  etcdserverpb::LeaseRevokeRequest revoke;
  revoke.set_id(granted.id());
  etcdserverpb::LeaseRevokeResponse revoked;
  lease->LeaseRevoke(call.get(), revoke, &revoked);  // else it runs out by itself
  return absl::FailedPreconditionError(
      absl::StrCat("replica_name: \"", config_.name, "\" is listed in etcd (", key_, ") by ",
                   holder.empty() ? "another replica" : holder, ", not ", config_.address,
                   ": two replicas must not share a name"));
}

absl::Status EtcdRegistration::Renew() {
  const std::string& endpoint = channels_.current_endpoint();
  etcdserverpb::LeaseKeepAliveRequest request;
  request.set_id(lease_id_);
  etcdserverpb::LeaseKeepAliveResponse renewed;
  {
    // One request on a stream of its own, as etcd's own KeepAliveOnce: its
    // deadline bounds the wait, which a long-lived stream's read would not.
    etcd::StoppableCalls::Call call(calls_, std::min(kCallTimeout, config_.lease_ttl / 3));
    auto stream = etcdserverpb::Lease::NewStub(channels_.current())->LeaseKeepAlive(call.get());
    const bool answered = stream->Write(request) && stream->Read(&renewed);
    stream->WritesDone();
    etcdserverpb::LeaseKeepAliveResponse rest;
    while (stream->Read(&rest)) {
    }
    grpc::Status status = stream->Finish();
    if (!answered) {
      return etcd::EtcdError(
          status.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "no answer") : status,
          "LeaseKeepAlive", endpoint);
    }
  }
  if (renewed.ttl() <= 0) {
    return absl::NotFoundError(absl::StrCat("lease ", absl::Hex(lease_id_), " is gone"));
  }
  // The key itself: still there under this lease (not deleted by hand).
  etcdserverpb::RangeRequest read;
  read.set_key(key_);
  etcdserverpb::RangeResponse found;
  etcd::StoppableCalls::Call call(calls_, kCallTimeout);
  if (grpc::Status status =
          etcdserverpb::KV::NewStub(channels_.current())->Range(call.get(), read, &found);
      !status.ok()) {
    return etcd::EtcdError(status, "Range", endpoint);
  }
  if (found.kvs_size() == 0 || found.kvs(0).lease() != lease_id_ ||
      found.kvs(0).value() != config_.address) {
    return absl::NotFoundError(absl::StrCat(key_, " is no longer this replica's listing"));
  }
  return absl::OkStatus();
}

void EtcdRegistration::Run() {
  int failures = 0;
  absl::Time last_renewed = absl::Now();
  while (!calls_.stopping()) {
    const bool registering = lease_id_ == 0;
    absl::Status step = registering ? Register() : Renew();
    if (step.ok()) {
      if (failures > 0) LogInfo("etcd: %s kept again", key_);
      failures = 0;
      last_renewed = absl::Now();
      calls_.WaitStopping(config_.lease_ttl / 3);
      continue;
    }
    ++failures;
    if (failures == 1 || failures % 30 == 0) {
      LogWarning("etcd: %s (trying again%s)", step.message(),
                 failures > 1 ? absl::StrCat(", ", failures, " tries so far") : "");
    }
    if (absl::IsNotFound(step)) {
      // The lease or the key went: list the replica anew under a new lease
      // (the old one, where it still runs, is left to run out).
      lease_id_ = 0;
      SetListed(false);
      if (failures == 1) continue;  // at once the first time; with backoff after
    } else {
      if (!registering && absl::Now() - last_renewed > config_.lease_ttl) SetListed(false);
      if (!absl::IsFailedPrecondition(step)) channels_.Next();
    }
    calls_.WaitStopping(etcd::EtcdBackoff(failures, kMostBackoff));
  }
}

void EtcdRegistration::Withdraw() {
  calls_.Stop();
  if (runner_.joinable()) runner_.join();
  if (lease_id_ == 0) return;  // none held, or withdrawn already
  // Revoking the lease deletes the key: clients stop placing caches here at once.
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kCallTimeout));
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
