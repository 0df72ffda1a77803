#include "sharded_client.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "rendezvous.h"
#include "wire/etcd/etcd_membership.h"
#include "wire/ids/replica_id.h"
#include "wire/net/address.h"

namespace kvcache {
namespace {

// Whether a PullSnapshot failed because the replica could not pull at all
// (no peer list, the owner missing from it or out of its reach, a server
// that predates the call), rather than because of the snapshot: then the
// client, which reaches both, can still stream it across itself.
bool CannotPull(const absl::Status& pulled) {
  return absl::IsFailedPrecondition(pulled) || absl::IsUnimplemented(pulled) ||
         absl::IsUnavailable(pulled) ||
         (absl::IsNotFound(pulled) && absl::StartsWith(pulled.message(), "snapshot_id: replica"));
}

// The lease of a copy made only to restore or publish from, released right
// after: if this client dies in between, the copy goes within a minute.
constexpr uint32_t kTransientCopyTtlSeconds = 60;

// Host and port of "dns:host:port" ("[v6]:port" works too).
absl::StatusOr<std::vector<Replica>> Resolve(absl::string_view host_port) {
  absl::StatusOr<net::HostPort> named =
      net::ParseHostPort(host_port, "peers", net::AddressUse::kConnect);
  if (!named.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("peers: \"dns:", host_port.substr(0, 64), "\" is not dns:host:port"));
  }
  const std::string& host = named->host;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int error = getaddrinfo(host.c_str(), nullptr, &hints, &found); error != 0) {
    return absl::UnavailableError(
        absl::StrCat("peers: cannot resolve \"", host, "\": ", gai_strerror(error)));
  }
  absl::Cleanup free_found = [found] { freeaddrinfo(found); };
  std::set<std::string> addresses;  // sorted, so every client lists them alike
  for (const addrinfo* at = found; at != nullptr; at = at->ai_next) {
    char text[NI_MAXHOST];
    if (getnameinfo(at->ai_addr, at->ai_addrlen, text, sizeof(text), nullptr, 0,
                    NI_NUMERICHOST) != 0) {
      continue;
    }
    addresses.insert(net::HostPort{text, named->port}.ToString());
  }
  std::vector<Replica> replicas;
  for (const std::string& address : addresses) replicas.push_back({.address = address});
  return replicas;
}

// Whether a create (or a prompt's lookup) should go on to the next replica.
bool PassOver(const absl::Status& status, bool also_full) {
  return absl::IsUnavailable(status) || (also_full && absl::IsResourceExhausted(status));
}

// The replica's own name, asked of it.
absl::StatusOr<std::string> AskName(const ClientOptions& options, absl::Duration timeout) {
  ClientOptions probe = options;
  probe.deadline = timeout;
  absl::StatusOr<v1::Stats> stats = Client::Connect(probe)->GetStats();
  if (!stats.ok()) return stats.status();
  if (stats->replica_name().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("replica at ", options.address,
                     " runs without --replica_name: its ids do not say where they live"));
  }
  return stats->replica_name();
}

}  // namespace

absl::StatusOr<std::vector<Replica>> ParsePeers(absl::string_view peers) {
  std::vector<Replica> replicas;
  for (absl::string_view entry : absl::StrSplit(peers, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    if (absl::ConsumePrefix(&entry, "dns:")) {
      absl::StatusOr<std::vector<Replica>> resolved = Resolve(entry);
      if (!resolved.ok()) return resolved.status();
      replicas.insert(replicas.end(), resolved->begin(), resolved->end());
      continue;
    }
    Replica replica;
    if (const size_t equals = entry.find('='); equals != absl::string_view::npos) {
      replica.name = std::string(entry.substr(0, equals));
      entry.remove_prefix(equals + 1);
      if (absl::Status valid = ids::CheckReplicaName(replica.name, "peers"); !valid.ok()) {
        return valid;
      }
    }
    if (entry.empty()) return absl::InvalidArgumentError("peers: an entry without an address");
    replica.address = std::string(entry);
    replicas.push_back(std::move(replica));
  }
  if (replicas.empty()) return absl::InvalidArgumentError("peers: no replica listed");
  return replicas;
}

absl::StatusOr<std::unique_ptr<ShardedClient>> ShardedClient::Connect(
    ShardedClientOptions options) {
  const bool etcd = !options.etcd.endpoints.empty();
  if (options.replicas.empty() && !etcd) {
    return absl::InvalidArgumentError("replicas: a fleet needs at least one (or etcd to list it)");
  }
  if (!options.replicas.empty() && etcd) {
    return absl::InvalidArgumentError("replicas: etcd lists the fleet; give one or the other");
  }
  if (!options.client.data_lane.empty() && options.client.data_lane != "auto") {
    return absl::InvalidArgumentError(
        "client.data_lane: \"\" or \"auto\" for a fleet (each replica names its own lane)");
  }
  if (options.prefix_route_tokens == 0) {
    return absl::InvalidArgumentError("prefix_route_tokens: must be at least 1");
  }
  if (options.client.max_reconnect_backoff == absl::ZeroDuration()) {
    options.client.max_reconnect_backoff = absl::Seconds(2);
  }
  // A replica that is down fails at once, so a create goes on to the next.
  options.client.first_connect_wait = absl::ZeroDuration();
  if (etcd) return ConnectEtcd(options);
  // One address for several replicas is a proxy in front of them, which
  // routes by the replica each call names: only named replicas may share one.
  struct Listed {
    int entries = 0;
    bool unnamed = false;
  };
  std::map<std::string, Listed> listed;  // by address
  for (const Replica& replica : options.replicas) {
    Listed& at = listed[replica.address];
    ++at.entries;
    at.unnamed |= replica.name.empty();
    if (at.entries > 1 && at.unnamed) {
      return absl::InvalidArgumentError(absl::StrCat(
          "replicas: ", replica.address, " is listed twice (name each replica behind a proxy)"));
    }
  }
  // Every replica is asked its name at once: a fleet with replicas down
  // waits one connect_timeout, not one per replica.
  std::vector<absl::StatusOr<std::string>> learned(options.replicas.size());
  {
    std::vector<std::jthread> askers;  // joined when the block ends
    askers.reserve(options.replicas.size());
    for (size_t i = 0; i < options.replicas.size(); ++i) {
      auto ask = [&, i] {
        ClientOptions client_options = options.client;
        client_options.address = options.replicas[i].address;
        client_options.replica = options.replicas[i].name;  // through a proxy: that one
        learned[i] = AskName(client_options, options.connect_timeout);
      };
      try {
        askers.emplace_back(ask);
      } catch (const std::system_error&) {
        ask();  // no thread to be had: this one asks, slower but the same
      }
    }
  }
  std::set<std::string> names;
  for (size_t i = 0; i < options.replicas.size(); ++i) {
    Replica& replica = options.replicas[i];
    const absl::StatusOr<std::string>& name = learned[i];
    // A replica that is down (or does not answer in time) is accepted where
    // its name is given: calls for its ids are UNAVAILABLE until it is back.
    const bool down = !name.ok() && (absl::IsUnavailable(name.status()) ||
                                     absl::IsDeadlineExceeded(name.status()));
    if (!name.ok() && (!down || replica.name.empty())) {
      return absl::Status(name.status().code(),
                          absl::StrCat("replica at ", replica.address,
                                       ": cannot learn its name: ", name.status().message()));
    }
    if (name.ok() && replica.name.empty()) replica.name = *name;
    if (name.ok() && *name != replica.name) {
      return absl::FailedPreconditionError(absl::StrCat("replica at ", replica.address, " is \"",
                                                        *name, "\", not \"", replica.name, "\""));
    }
    if (!names.insert(replica.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("replicas: two are named \"", replica.name, "\""));
    }
  }
  return MakeStatic(options, options.replicas);
}

std::unique_ptr<ShardedClient> ShardedClient::MakeStatic(const ShardedClientOptions& options,
                                                         const std::vector<Replica>& replicas) {
  std::unique_ptr<ShardedClient> fleet(
      new ShardedClient(options.client, options.prefix_route_tokens));
  fleet->SetMembers(replicas);
  return fleet;
}

absl::StatusOr<std::unique_ptr<ShardedClient>> ShardedClient::ConnectEtcd(
    const ShardedClientOptions& options) {
  if (options.connect_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "connect_timeout: must be positive (etcd's list is read first)");
  }
  std::unique_ptr<ShardedClient> fleet(
      new ShardedClient(options.client, options.prefix_route_tokens));
  absl::StatusOr<std::unique_ptr<etcd::EtcdMembership>> membership = etcd::EtcdMembership::Start(
      options.etcd, options.connect_timeout,
      [raw = fleet.get()](const std::map<std::string, std::string>& listed) {
        std::vector<Replica> replicas;
        replicas.reserve(listed.size());
        for (const auto& [name, address] : listed) {
          replicas.push_back({.name = name, .address = address});
        }
        raw->SetMembers(replicas);
      },
      options.on_etcd_failure);
  if (!membership.ok()) return membership.status();
  fleet->membership_ = *std::move(membership);
  return fleet;
}

ShardedClient::ShardedClient(ClientOptions client_options, uint32_t prefix_route_tokens)
    : client_options_(std::move(client_options)), prefix_route_tokens_(prefix_route_tokens) {}

ShardedClient::~ShardedClient() { membership_.reset(); }  // no SetMembers from here on

std::unique_ptr<Client> ShardedClient::MakeClient(const Replica& replica) const {
  ClientOptions options = client_options_;
  options.address = replica.address;
  options.replica = replica.name;
  return Client::Connect(options);
}

void ShardedClient::SetMembers(const std::vector<Replica>& listed) {
  absl::MutexLock lock(&mu_);
  members_.clear();
  member_names_.clear();
  for (const Replica& replica : listed) {
    size_t index = 0;
    while (index < names_.size() && names_[index] != replica.name) ++index;
    if (index == names_.size()) {
      replicas_.push_back(replica);
      names_.push_back(replica.name);
      clients_.push_back(MakeClient(replica));
    } else if (replicas_[index].address != replica.address) {
      replicas_[index].address = replica.address;
      retired_.push_back(std::move(clients_[index]));
      clients_[index] = MakeClient(replica);
    }
    members_.push_back(index);
    member_names_.push_back(replica.name);
  }
}

size_t ShardedClient::size() const {
  absl::ReaderMutexLock lock(&mu_);
  return replicas_.size();
}

Replica ShardedClient::replica(size_t index) const {
  absl::ReaderMutexLock lock(&mu_);
  return replicas_[index];
}

Client& ShardedClient::client(size_t index) {
  absl::ReaderMutexLock lock(&mu_);
  return *clients_[index];
}

std::vector<size_t> ShardedClient::Members() const {
  absl::ReaderMutexLock lock(&mu_);
  return members_;
}

std::string ShardedClient::NameOf(size_t index) const {
  absl::ReaderMutexLock lock(&mu_);
  return index < names_.size() ? names_[index] : "";
}

absl::StatusOr<size_t> ShardedClient::ReplicaOf(absl::string_view id) const {
  const absl::string_view name = ids::ReplicaOf(id);
  if (name.empty()) {
    return absl::InvalidArgumentError("id: it names no replica (\"<replica>:<hex>\")");
  }
  {
    absl::ReaderMutexLock lock(&mu_);
    for (size_t i = 0; i < names_.size(); ++i) {
      if (names_[i] == name) return i;
    }
  }
  return absl::NotFoundError(absl::StrCat("id: no replica of this fleet is named \"",
                                          name.substr(0, ids::kMaxReplicaNameBytes), "\""));
}

absl::StatusOr<Client*> ShardedClient::Owner(absl::string_view id) {
  absl::StatusOr<size_t> index = ReplicaOf(id);
  if (!index.ok()) return index.status();
  return &client(*index);
}

std::vector<size_t> ShardedClient::Order(absl::string_view key) const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<size_t> order = RendezvousOrder(key, member_names_);
  for (size_t& at : order) at = members_[at];
  return order;
}

std::string ShardedClient::PromptKey(const v1::CacheSpec& spec,
                                     absl::Span<const uint32_t> tokens) const {
  // Lengths first, so no two different (token, model, tokens) read alike.
  const std::string& token = client_options_.token;
  std::string key = absl::StrCat("prompt:", token.size(), ":", token, spec.model().size(), ":",
                                 spec.model(), ":");
  const size_t routed = std::min<size_t>(tokens.size(), prefix_route_tokens_);
  for (size_t i = 0; i < routed; ++i) {
    const uint32_t token = tokens[i];
    char bytes[4] = {static_cast<char>(token), static_cast<char>(token >> 8),
                     static_cast<char>(token >> 16), static_cast<char>(token >> 24)};
    key.append(bytes, sizeof(bytes));
  }
  return key;
}

template <typename T, typename Call>
absl::StatusOr<T> ShardedClient::FirstThatTakes(absl::string_view key, bool also_full,
                                                const Call& call, size_t* answered) {
  const std::vector<size_t> order = Order(key);
  if (order.empty()) return absl::UnavailableError("no replica is listed in etcd");
  absl::Status last;
  for (size_t index : order) {
    absl::StatusOr<T> result = call(client(index));
    if (answered != nullptr) *answered = index;
    if (result.ok() || !PassOver(result.status(), also_full)) return result;
    last = absl::Status(result.status().code(),
                        absl::StrCat("replica ", NameOf(index), ": ", result.status().message()));
  }
  return absl::Status(last.code(), absl::StrCat("no replica took it; the last: ", last.message()));
}

absl::StatusOr<v1::CacheInfo> ShardedClient::CreateCache(
    const v1::CacheSpec& spec, const ShardedCreateCacheOptions& options) {
  std::string key = options.placement_key;
  if (key.empty()) {
    thread_local absl::BitGen random;
    key = absl::StrCat("random:", absl::Uniform<uint64_t>(random), absl::Uniform<uint64_t>(random));
  }
  const CreateCacheOptions on_replica{.ttl_seconds = options.ttl_seconds};
  size_t answered = 0;
  absl::StatusOr<v1::CacheInfo> created = FirstThatTakes<v1::CacheInfo>(
      key, /*also_full=*/true,
      [&](Client& client) { return client.CreateCache(spec, on_replica); }, &answered);
  if (!created.ok()) return created;
  // Deleted where it names another replica, so it does not sit unreachable.
  if (absl::Status made = CheckMadeBy(created->cache_id(), answered, "cache"); !made.ok()) {
    // A lease, if any, ends it otherwise.
    client(answered).DeleteCache(created->cache_id()).IgnoreError();
    return made;
  }
  return created;
}

absl::Status ShardedClient::CheckMadeBy(const std::string& id, size_t index,
                                        absl::string_view what) const {
  const absl::StatusOr<size_t> owner = ReplicaOf(id);
  if (owner.ok() && *owner == index) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("replica ", NameOf(index), " answered with ", what, " id \"", id.substr(0, 80),
                   "\", which names another replica or none of this fleet (restarted under another "
                   "--replica_name, or peers listed at the wrong addresses?)"));
}

absl::StatusOr<v1::CacheInfo> ShardedClient::CreateCacheForPrompt(
    const v1::CacheSpec& spec, absl::Span<const uint32_t> tokens,
    const CreateCacheOptions& options) {
  return CreateCache(
      spec, {.ttl_seconds = options.ttl_seconds, .placement_key = PromptKey(spec, tokens)});
}

absl::StatusOr<v1::LookupPrefixResponse> ShardedClient::LookupPrefix(
    const v1::CacheSpec& spec, absl::Span<const uint32_t> tokens,
    const LookupPrefixOptions& options) {
  size_t answered = 0;
  absl::StatusOr<v1::LookupPrefixResponse> found = FirstThatTakes<v1::LookupPrefixResponse>(
      PromptKey(spec, tokens), /*also_full=*/false,
      [&](Client& client) { return client.LookupPrefix(spec, tokens, options); }, &answered);
  if (!found.ok() || !found->has_snapshot()) return found;
  const std::string& handle = found->snapshot().snapshot_id();
  if (absl::Status made = CheckMadeBy(handle, answered, "snapshot"); !made.ok()) {
    client(answered).ReleaseSnapshot(handle).IgnoreError();  // its lease ends it otherwise
    return made;
  }
  return found;
}

absl::StatusOr<v1::PublishPrefixResponse> ShardedClient::PublishPrefix(
    const v1::CacheSpec& spec, const std::string& snapshot_id, absl::Span<const uint32_t> tokens,
    const PublishPrefixOptions& options) {
  absl::StatusOr<size_t> owner = ReplicaOf(snapshot_id);
  if (!owner.ok()) return owner.status();
  absl::Status last = absl::UnavailableError("no replica is listed in etcd");
  for (size_t index : Order(PromptKey(spec, tokens))) {
    if (index == *owner) {
      absl::StatusOr<v1::PublishPrefixResponse> published =
          client(index).PublishPrefix(snapshot_id, tokens, options);
      if (published.ok() || !absl::IsUnavailable(published.status())) return published;
      last = published.status();
      continue;
    }
    absl::StatusOr<v1::SnapshotInfo> copy =
        CopySnapshotTo(snapshot_id, index, {.ttl_seconds = kTransientCopyTtlSeconds});
    if (!copy.ok() && absl::IsUnavailable(copy.status())) {
      last = copy.status();
      continue;
    }
    if (!copy.ok()) return copy.status();
    absl::StatusOr<v1::PublishPrefixResponse> published =
        client(index).PublishPrefix(copy->snapshot_id(), tokens, options);
    // The index holds a snapshot of its own: the copy has served its purpose
    // (where releasing it fails, its lease ends it).
    client(index).ReleaseSnapshot(copy->snapshot_id()).IgnoreError();
    return published;
  }
  return absl::Status(last.code(), absl::StrCat("no replica took it; the last: ", last.message()));
}

absl::StatusOr<v1::CacheInfo> ShardedClient::Restore(const std::string& cache_id,
                                                     const std::string& snapshot_id,
                                                     uint64_t target_offset) {
  absl::StatusOr<size_t> cache_owner = ReplicaOf(cache_id);
  if (!cache_owner.ok()) return cache_owner.status();
  Client& owner = client(*cache_owner);
  if (snapshot_id.empty()) return owner.Restore(cache_id, snapshot_id, target_offset);
  absl::StatusOr<size_t> snapshot_owner = ReplicaOf(snapshot_id);
  if (!snapshot_owner.ok()) return snapshot_owner.status();
  if (*snapshot_owner == *cache_owner) return owner.Restore(cache_id, snapshot_id, target_offset);
  absl::StatusOr<v1::SnapshotInfo> copy =
      CopySnapshotTo(snapshot_id, *cache_owner, {.ttl_seconds = kTransientCopyTtlSeconds});
  if (!copy.ok()) return copy.status();
  absl::StatusOr<v1::CacheInfo> restored =
      owner.Restore(cache_id, copy->snapshot_id(), target_offset);
  // The cache now shares the copy's pages; the copy's own handle can go
  // (where releasing it fails, its lease ends it).
  owner.ReleaseSnapshot(copy->snapshot_id()).IgnoreError();
  return restored;
}

absl::StatusOr<v1::SnapshotInfo> ShardedClient::CopySnapshotTo(const std::string& snapshot_id,
                                                               size_t to,
                                                               const NewSnapshotOptions& options) {
  if (const size_t known = size(); to >= known) {
    return absl::InvalidArgumentError(
        absl::StrCat("to: the fleet has ", known, " replicas, not ", to + 1));
  }
  absl::StatusOr<Client*> from = Owner(snapshot_id);
  if (!from.ok()) return from.status();
  // A copy on its own replica is no pull.
  const bool same_replica = *from == &client(to);
  absl::StatusOr<v1::LoadSnapshotResponse> copied =
      same_replica ? absl::FailedPreconditionError("the owner itself")
                   : client(to).PullSnapshot(snapshot_id, options);
  if (!copied.ok() && CannotPull(copied.status())) {
    v1::ExportSnapshotRequest request;
    request.set_snapshot_id(snapshot_id);
    v1::ImportSnapshotRequest to_options;
    to_options.set_pinned(options.pinned);
    to_options.set_ttl_seconds(options.ttl_seconds);
    copied = kvcache::CopySnapshot(**from, request, client(to), to_options);
  }
  if (!copied.ok()) return copied.status();
  const std::string& copy = copied->snapshot().snapshot_id();
  if (absl::Status made = CheckMadeBy(copy, to, "snapshot"); !made.ok()) {
    client(to).ReleaseSnapshot(copy).IgnoreError();  // its lease, if any, ends it otherwise
    return made;
  }
  return copied->snapshot();
}

std::vector<absl::StatusOr<v1::Stats>> ShardedClient::GetStats() {
  std::vector<absl::StatusOr<v1::Stats>> stats;
  for (size_t index = 0, known = size(); index < known; ++index) {
    stats.push_back(client(index).GetStats());
  }
  return stats;
}

}  // namespace kvcache
