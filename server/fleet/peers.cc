#include "fleet/peers.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <iterator>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "wire/ids/replica_id.h"
#include "wire/net/address.h"

namespace kvcache::service {

absl::StatusOr<std::map<std::string, std::string>> ParsePeerList(absl::string_view list,
                                                                 absl::string_view field) {
  std::map<std::string, std::string> peers;
  for (absl::string_view entry : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    const std::vector<absl::string_view> parts = absl::StrSplit(entry, absl::MaxSplits('=', 1));
    if (parts.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": \"", entry.substr(0, 80), "\" is not name=host:port"));
    }
    // host:port only, so that a listed value can only ever name a TCP peer
    // (no other gRPC target: no scheme, no unix socket).
    RETURN_IF_ERROR(net::ParseHostPort(parts[1], field, net::AddressUse::kConnect).status());
    if (absl::Status name = ids::CheckReplicaName(parts[0], field); !name.ok()) return name;
    if (!peers.emplace(std::string(parts[0]), std::string(parts[1])).second) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", parts[0], " is listed twice"));
    }
  }
  return peers;
}

absl::StatusOr<std::unique_ptr<Peers>> Peers::Make(PeersConfig config) {
  // One list serves the whole fleet: each replica skips its own name.
  config.listed.erase(config.self);
  std::unique_ptr<Peers> peers(new Peers(std::move(config)));
  if (!peers->config_.etcd.endpoints.empty()) {
    // Not waited for: a replica serves (and pulls from its --peers) while
    // etcd is away; pulls of replicas only etcd lists wait for its answer.
    ASSIGN_OR_RETURN(peers->membership_,
                     etcd::EtcdMembership::Start(
                         peers->config_.etcd, absl::ZeroDuration(),
                         [raw = peers.get()](const std::map<std::string, std::string>& listed) {
                           raw->SetEtcdList(listed);
                         },
                         [](const absl::Status& failure) {
                           LogWarning("etcd: cannot watch the fleet's list (trying again): %s",
                                      failure.ToString());
                         }));
  }
  return peers;
}

Peers::~Peers() { membership_.reset(); }

bool Peers::BeginPull() {
  if (pulls_.fetch_add(1, std::memory_order_relaxed) < kMaxPulls) return true;
  EndPull();
  return false;
}

void Peers::SetEtcdList(const std::map<std::string, std::string>& listed) {
  absl::MutexLock lock(&mu_);
  etcd_read_ = true;
  etcd_listed_ = listed;
  etcd_listed_.erase(config_.self);
  // Channels to addresses that no list names (a replica moved) go.
  std::set<std::string> named;
  for (const auto& [name, address] : config_.listed) named.insert(address);
  for (const auto& [name, address] : etcd_listed_) named.insert(address);
  for (auto channel = channels_.begin(); channel != channels_.end();) {
    channel = named.contains(channel->first) ? std::next(channel) : channels_.erase(channel);
  }
}

std::shared_ptr<grpc::Channel> Peers::ChannelToLocked(const std::string& address) {
  std::shared_ptr<grpc::Channel>& channel = channels_[address];
  if (channel == nullptr) channel = grpc::CreateChannel(address, config_.credentials);
  return channel;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> Peers::Find(const std::string& name) {
  absl::MutexLock lock(&mu_);
  if (auto listed = config_.listed.find(name); listed != config_.listed.end()) {
    return ChannelToLocked(listed->second);
  }
  if (!membership_) {
    return absl::NotFoundError(absl::StrCat("snapshot_id: replica \"", name,
                                            "\" is not among this replica's peers (--peers)"));
  }
  if (!etcd_read_) {
    const absl::Status failure = membership_->last_failure();
    return absl::UnavailableError(absl::StrCat(
        "snapshot_id: replica \"", name,
        "\" could not be looked up: this replica has not read the fleet's list from etcd yet",
        failure.ok() ? "" : absl::StrCat(" (", failure.message(), ")")));
  }
  const auto listed = etcd_listed_.find(name);
  const std::string key = etcd::ReplicaKey(config_.etcd.prefix, name);
  if (listed == etcd_listed_.end()) {
    return absl::NotFoundError(
        absl::StrCat("snapshot_id: replica \"", name, "\" is not listed in etcd (", key, ")"));
  }
  // A listing is held to the rule of --peers: a TCP peer's host:port.
  if (!net::ParseHostPort(listed->second, "snapshot_id", net::AddressUse::kConnect).ok()) {
    return absl::UnavailableError(absl::StrCat(
        "snapshot_id: replica \"", name, "\" is listed in etcd (", key, ") without a host:port"));
  }
  return ChannelToLocked(listed->second);
}

}  // namespace kvcache::service
