#include "service/peers.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "ids/replica_id.h"

namespace kvcache::service {
namespace {

// An etcd that does not answer within this fails the pull (UNAVAILABLE)
// rather than holding it.
constexpr absl::Duration kEtcdLookupTimeout = absl::Seconds(3);

// host:port: a host (a name or an address, no scheme, no path) and a port,
// so that a listed value can only ever name a TCP peer.
bool IsHostPort(absl::string_view address) {
  const size_t colon = address.rfind(':');
  uint32_t port = 0;
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port == 0 || port > 65535) {
    return false;
  }
  const absl::string_view host = address.substr(0, colon);
  return std::all_of(host.begin(), host.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_' ||
           c == ':' || c == '[' || c == ']';
  });
}

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> ParsePeerList(absl::string_view list,
                                                                 absl::string_view field) {
  std::map<std::string, std::string> peers;
  for (absl::string_view entry : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    const std::vector<absl::string_view> parts = absl::StrSplit(entry, absl::MaxSplits('=', 1));
    if (parts.size() != 2 || !IsHostPort(parts[1])) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": \"", entry.substr(0, 80), "\" is not name=host:port"));
    }
    if (absl::Status name = ids::CheckReplicaName(parts[0], field); !name.ok()) return name;
    if (!peers.emplace(std::string(parts[0]), std::string(parts[1])).second) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", parts[0], " is listed twice"));
    }
  }
  return peers;
}

// One etcd read of a replica's key, alive until its answer.
struct Peers::EtcdLookup {
  std::unique_ptr<etcdserverpb::KV::Stub> stub;
  grpc::ClientContext context;
  etcdserverpb::RangeRequest request;
  etcdserverpb::RangeResponse response;
  std::string endpoint;
  Found found;
};

absl::StatusOr<std::unique_ptr<Peers>> Peers::Make(PeersConfig config) {
  // One list serves the whole fleet: each replica skips its own name.
  config.listed.erase(config.self);
  std::unique_ptr<Peers> peers(new Peers(std::move(config)));
  if (!peers->config_.etcd.endpoints.empty()) {
    absl::StatusOr<etcd::EtcdChannels> channels = etcd::EtcdChannels::Make(peers->config_.etcd);
    if (!channels.ok()) return channels.status();
    peers->etcd_ = std::make_unique<etcd::EtcdChannels>(*std::move(channels));
  }
  return peers;
}

Peers::~Peers() = default;

bool Peers::BeginPull() {
  if (pulls_.fetch_add(1, std::memory_order_relaxed) < kMaxPulls) return true;
  EndPull();
  return false;
}

std::shared_ptr<grpc::Channel> Peers::ChannelTo(const std::string& address) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<grpc::Channel>& channel = channels_[address];
  if (channel == nullptr) channel = grpc::CreateChannel(address, config_.credentials);
  return channel;
}

void Peers::Find(const std::string& name, Found found) {
  if (auto listed = config_.listed.find(name); listed != config_.listed.end()) {
    std::move(found)(ChannelTo(listed->second));
    return;
  }
  if (!etcd_) {
    std::move(found)(absl::NotFoundError(absl::StrCat(
        "snapshot_id: replica \"", name, "\" is not among this replica's peers (--peers)")));
    return;
  }
  auto lookup = std::make_unique<EtcdLookup>();
  lookup->request.set_key(etcd::ReplicaKey(config_.etcd.prefix, name));
  lookup->context.set_deadline(absl::ToChronoTime(absl::Now() + kEtcdLookupTimeout));
  lookup->found = std::move(found);
  {
    absl::MutexLock lock(&mu_);
    lookup->stub = etcdserverpb::KV::NewStub(etcd_->current());
    lookup->endpoint = etcd_->current_endpoint();
  }
  EtcdLookup* raw = lookup.release();  // the callback owns it
  raw->stub->async()->Range(
      &raw->context, &raw->request, &raw->response, [this, raw, name](grpc::Status status) {
        std::unique_ptr<EtcdLookup> done(raw);
        if (!status.ok()) {
          // The next lookup asks the next endpoint (etcd's members all serve reads).
          absl::MutexLock lock(&mu_);
          if (etcd_->current_endpoint() == done->endpoint) etcd_->Next();
        }
        if (!status.ok()) {
          // UNAVAILABLE whatever etcd said: its own refusals are not the caller's.
          std::move(done->found)(absl::UnavailableError(
              absl::StrCat("snapshot_id: replica \"", name, "\" could not be looked up: ",
                           etcd::EtcdError(status, "Range", done->endpoint).message())));
        } else if (done->response.kvs_size() == 0) {
          std::move(done->found)(absl::NotFoundError(absl::StrCat(
              "snapshot_id: replica \"", name, "\" is not listed in etcd (",
              done->request.key(), ")")));
        } else if (!IsHostPort(done->response.kvs(0).value())) {
          std::move(done->found)(absl::UnavailableError(
              absl::StrCat("snapshot_id: replica \"", name, "\" is listed in etcd (",
                           done->request.key(), ") without a host:port")));
        } else {
          std::move(done->found)(ChannelTo(done->response.kvs(0).value()));
        }
      });
}

}  // namespace kvcache::service
