// kvcache::ShardedClient: one client of a fleet of kvcached replicas.
//
// Each cache is placed on a replica by rendezvous hashing (rendezvous.h) of
// a placement key; the replica that made a cache or snapshot is named in its
// id (protos/wire/ids/replica_id.h), so every later call about it, Update and
// Fetch on the data lane included, goes to that replica's own Client
// (Owner) with no lookup and no table to keep in step.
//
// A replica that is down makes only its own caches and snapshots
// UNAVAILABLE: creates go to the next replica of the key's order, the others
// keep serving. Prefix lookups and publishes are routed by (token, model,
// first prefix_route_tokens tokens), so every extension of a prompt goes to
// the same replica, and a cache created for that prompt (CreateCacheForPrompt)
// lives beside the prefixes it restores from. Calls that join two handles on
// different replicas (Restore from a snapshot elsewhere, PublishPrefix of a
// snapshot that lives off the prompt's replica) first copy the snapshot
// over, streamed through this client (CopySnapshot).
//
// Replicas come from a static list or DNS (ParsePeers), their names (each
// server's --replica_name) given or asked of each server at Connect; or from
// etcd, where each replica lists itself under a lease (wire/etcd/etcd_membership.h).
// With etcd the fleet changes while the client runs: a replica that joins
// takes its share of new caches, one that leaves takes none, and its ids
// still go to its last address (UNAVAILABLE while it is down); a replica
// back at another address is reached there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvcache_client.h"
#include "wire/etcd/etcd_fleet.h"

namespace kvcache {

struct Replica {
  // The server's --replica_name; empty: asked of the server at Connect.
  std::string name;
  // host:port of its gRPC port.
  std::string address;
};

// A fleet as kvcachectl --peers gives it: comma-separated entries, each
// "name=host:port" (a replica and its name), "host:port" (the name asked of
// the server), or "dns:host:port": every address `host` resolves to (a
// Kubernetes headless Service lists one per ready pod), names asked.
absl::StatusOr<std::vector<Replica>> ParsePeers(absl::string_view peers);

namespace etcd {
class EtcdMembership;
}  // namespace etcd

struct ShardedClientOptions {
  // A static fleet; or none, where etcd lists it.
  std::vector<Replica> replicas;
  // Where replicas list themselves (their --etcd_endpoints and
  // --etcd_prefix); with endpoints, `replicas` stays empty.
  etcd::EtcdOptions etcd;
  // Told why etcd's list could not be read or watched, once per run of
  // failures, while the client goes on with the list it had (null: no one).
  // Called on the membership's own thread: it must not destroy the client.
  std::function<void(const absl::Status&)> on_etcd_failure;
  // Everything but `address` for each replica's Client. data_lane is "" or
  // "auto" (each replica's lane is the one its GetStats names).
  // max_reconnect_backoff defaults to 2 s here, and first_connect_wait is
  // zero (a replica that is down fails fast).
  ClientOptions client;
  // Prompt routing: how many leading tokens decide the replica. Prefixes
  // shorter than this are routed by all their tokens, so a prompt shares
  // such a prefix only with prompts of that same length.
  uint32_t prefix_route_tokens = 64;
  // How long Connect waits for a replica to tell its name, or etcd its list.
  absl::Duration connect_timeout = absl::Seconds(5);
};

struct ShardedCreateCacheOptions {
  // As CreateCacheOptions'.
  uint32_t ttl_seconds = 0;
  // Decides the replicas' order (rendezvous.h); empty spreads caches evenly
  // (a random key each).
  std::string placement_key;
};

class ShardedClient {
 public:
  // Connects to every replica and learns the names not given. Fails when a
  // replica without a given name does not answer, when a replica runs
  // without --replica_name or under another name than given, or when two
  // share a name. A named replica that is down is fine: it is skipped until
  // it answers.
  // With etcd: fails where it does not answer; an empty list is fine.
  static absl::StatusOr<std::unique_ptr<ShardedClient>> Connect(ShardedClientOptions options);
  ~ShardedClient();

  // Every replica this client has known, listed now or not; an index stays
  // the same replica's for the client's life.
  size_t size() const;
  Replica replica(size_t index) const;
  // Its Client (stays valid for the ShardedClient's life, even where the
  // replica moves and later calls go to a new one).
  Client& client(size_t index);
  // The replicas new caches may go to: all of a static fleet, those that
  // etcd lists now.
  std::vector<size_t> Members() const;

  // The replica that made `id`: INVALID_ARGUMENT when the id names none,
  // NOT_FOUND when no replica of this fleet has that name.
  absl::StatusOr<size_t> ReplicaOf(absl::string_view id) const;
  // That replica's Client: every call about `id` goes there.
  absl::StatusOr<Client*> Owner(absl::string_view id);
  // The members in the order `key` tries them.
  std::vector<size_t> Order(absl::string_view key) const;
  // The key prompts are routed by (see prefix_route_tokens).
  std::string PromptKey(const v1::CacheSpec& spec, absl::Span<const uint32_t> tokens) const;

  // Creates the cache on the first replica of the placement key's order that
  // takes it: one that is down (UNAVAILABLE) or full (RESOURCE_EXHAUSTED) is
  // passed over.
  absl::StatusOr<v1::CacheInfo> CreateCache(const v1::CacheSpec& spec,
                                            const ShardedCreateCacheOptions& options = {});
  // On the replica that prefix lookups of `tokens` go to.
  absl::StatusOr<v1::CacheInfo> CreateCacheForPrompt(const v1::CacheSpec& spec,
                                                     absl::Span<const uint32_t> tokens,
                                                     const CreateCacheOptions& options = {});
  // The longest cached prefix, asked of the prompt's replica (or the next
  // one up, as CreateCache goes on).
  absl::StatusOr<v1::LookupPrefixResponse> LookupPrefix(const v1::CacheSpec& spec,
                                                        absl::Span<const uint32_t> tokens,
                                                        const LookupPrefixOptions& options = {});
  // Publishes on the prompt's replica; a snapshot that lives elsewhere is
  // copied there first (and the copy released once published: the index
  // keeps its own handle).
  absl::StatusOr<v1::PublishPrefixResponse> PublishPrefix(const v1::CacheSpec& spec,
                                                          const std::string& snapshot_id,
                                                          absl::Span<const uint32_t> tokens,
                                                          const PublishPrefixOptions& options = {});
  // Client::Restore on the cache's replica; a snapshot of another replica
  // is copied to it first, and the copy released afterwards.
  absl::StatusOr<v1::CacheInfo> Restore(const std::string& cache_id,
                                        const std::string& snapshot_id, uint64_t target_offset);
  // Copies a snapshot (from offset 0) to replica `to`: a new snapshot there,
  // with that replica's id. The original stays. Replica `to` pulls it from
  // the owner itself (PullSnapshot); where it cannot (no peer list, the
  // owner not in it, a server without the call), the bytes are streamed
  // through this client instead.
  absl::StatusOr<v1::SnapshotInfo> CopySnapshotTo(const std::string& snapshot_id, size_t to,
                                                  const NewSnapshotOptions& options = {});
  // Each replica's GetStats, in replica order (a replica that is down: its status).
  std::vector<absl::StatusOr<v1::Stats>> GetStats();

 private:
  ShardedClient(ClientOptions client_options, uint32_t prefix_route_tokens);
  // Makes `listed` the members: new replicas are added, moved ones get a
  // Client at their new address, the rest stop being members.
  void SetMembers(const std::vector<Replica>& listed) ABSL_LOCKS_EXCLUDED(mu_);
  static std::unique_ptr<ShardedClient> MakeStatic(const ShardedClientOptions& options,
                                                   const std::vector<Replica>& replicas);
  static absl::StatusOr<std::unique_ptr<ShardedClient>> ConnectEtcd(
      const ShardedClientOptions& options);
  std::unique_ptr<Client> MakeClient(const Replica& replica) const;
  // Runs `call` on the members of `key`'s order until one does not answer
  // UNAVAILABLE (or, when `also_full`, RESOURCE_EXHAUSTED); `answered`: the
  // replica whose answer it returns.
  template <typename T, typename Call>
  absl::StatusOr<T> FirstThatTakes(absl::string_view key, bool also_full, const Call& call,
                                   size_t* answered = nullptr);
  // OK where replica `index` made `id` (a cache or snapshot it answered
  // with); else FAILED_PRECONDITION: later calls would route the id to
  // another replica (one restarted under another --replica_name, or peers
  // listed at the wrong addresses), so the caller lets go of it.
  absl::Status CheckMadeBy(const std::string& id, size_t index, absl::string_view what) const;
  std::string NameOf(size_t index) const;

  const ClientOptions client_options_;  // all but the address, for each replica
  const uint32_t prefix_route_tokens_;

  mutable absl::Mutex mu_;
  std::vector<Replica> replicas_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> names_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Client>> clients_ ABSL_GUARDED_BY(mu_);
  // Clients of replicas that moved: callers may still hold them.
  std::vector<std::unique_ptr<Client>> retired_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> members_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> member_names_ ABSL_GUARDED_BY(mu_);
  // Declared last: its thread stops before the rest goes.
  std::unique_ptr<etcd::EtcdMembership> membership_;
};

}  // namespace kvcache
