// The engine: caches, their snapshots and the ids that name them, over one page
// pool. Everything the service does goes through here; it knows no gRPC.
//
// Status codes, the same at every layer of the service: malformed input INVALID_ARGUMENT naming the field;
// unknown id NOT_FOUND; unreachable restore / merge / split or layers out of step
// FAILED_PRECONDITION with the reason; pool exhausted RESOURCE_EXHAUSTED. A call
// that fails changes nothing. Thread-safe: one mutex per cache.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "engine/files/prompt_cache.h"
#include "engine/files/saved_files.h"
#include "engine/layers/cache.h"
#include "engine/layers/cache_spec.h"
#include "engine/lease.h"
#include "engine/metadata_budget.h"
#include "engine/prefix/prefix_index.h"
#include "engine/snapshot_registry.h"
#include "engine/speculation/speculation.h"
#include "engine/tiering.h"
#include "gpu/page_pool.h"

namespace kvcache::engine {

struct EngineOptions {
  // Tokens per page, at most; layers too wide for that many get fewer.
  uint32_t page_tokens = 256;
  SpecLimits limits;
  // Most tokens one Update may carry.
  uint64_t max_update_tokens = 1 << 16;
  // The lease of a cache or snapshot created with no ttl of its own; zero: none.
  absl::Duration default_ttl;
  // Most bytes pinned snapshots may hold; 0: no limit.
  uint64_t max_pinned_bytes = 0;
  // Most caches and snapshots held at once (a tenant's quotas); 0: no limit.
  // Past one a call that would add one is RESOURCE_EXHAUSTED naming it.
  uint64_t max_caches = 0;
  uint64_t max_snapshots = 0;
  // Most host memory caches and snapshots may hold outside the pool
  // (engine/metadata_budget.h); 0: DefaultMetadataBytes of the pool's budget.
  uint64_t metadata_bytes = 0;
  // The tenant whose own quota metadata_bytes is (named in its refusals);
  // empty: the server's --metadata_bytes.
  std::string metadata_quota_of;
  // What every cache, snapshot and speculation id begins with: the replica's
  // name and a colon (kvcached --replica_name), or nothing.
  std::string id_prefix;
  // Where SaveSnapshot and LoadSnapshot keep files (the server's --data_dir);
  // null: those calls are FAILED_PRECONDITION naming data_dir.
  SavedFileStore* saved_files = nullptr;
  // Where leases read the time (tests pass a manual clock); null: the system's.
  const LeaseClock* clock = nullptr;
  // Other engines over the same pool (the server's other tenants), asked to
  // evict when this one has nothing left to move (tiering.h); null: none.
  EvictElsewhere evict_elsewhere;
  // Where the prefix index counts the blocks of its entries (KV events:
  // engine/prefix/prefix_blocks.h), shared by every tenant's engine; null: nowhere.
  PrefixBlocks* prefix_blocks = nullptr;
};

struct CacheInfo {
  std::string cache_id;
  CacheSpec spec;
  std::vector<uint64_t> layer_offsets;
  uint64_t offset = 0;          // the common offset of all layers (min while out of step)
  bool in_step = true;          // every layer at the same offset
  uint64_t size_bytes = 0;      // pool bytes its pages hold
  absl::Duration ttl;           // zero: no lease
  absl::Time expires_at = absl::InfiniteFuture();
};

// A speculation (engine/speculation/speculation.h) as the engine describes it.
struct SpeculationInfo {
  std::string speculation_id;
  std::string cache_id;
  bool isolated = false;
  uint64_t committed_offset = 0;       // the live cache's offset, unchanged while it is open
  std::vector<uint64_t> layer_offsets;  // per layer: committed + drafted
};

struct EngineStats {
  gpu::PoolStats pool;
  uint64_t caches = 0;
  uint64_t snapshots = 0;
  uint64_t caches_expired = 0;  // since the engine started
  uint64_t snapshots_expired = 0;
  uint64_t pinned_bytes = 0;
  uint64_t max_pinned_bytes = 0;  // 0: no limit
  uint64_t metadata_bytes = 0;    // charged to caches, snapshots and the pool's tables
  uint64_t max_metadata_bytes = 0;
  PrefixStats prefixes;
  // The pages this engine's account holds per tier (PagePool::ForAccount).
  gpu::AccountUsage account;
  // Its saved files (SavedFileStore::used_bytes, max_bytes); 0 without any.
  uint64_t saved_bytes = 0;
  uint64_t max_saved_bytes = 0;
};

// What PublishPrefix left in the index.
struct PublishedPrefix {
  // The index's own snapshot of the prefix: leased, evicted and released like
  // any other (ReleaseSnapshot on it unpublishes the prefix).
  SnapshotInfo entry;
  uint64_t tokens = 0;
  // Leading tokens whose pages the entry shares with what was published
  // before (on page boundaries), instead of taking them from the snapshot.
  uint64_t shared_tokens = 0;
  // These exact tokens were published already: that entry stays, renewed.
  bool already_published = false;
};

// What LookupPrefix found: a new handle on the entry of the longest cached
// prefix, or none.
struct PrefixLookup {
  std::optional<SnapshotInfo> handle;
  uint64_t matched_tokens = 0;  // restore the handle to this offset
  uint64_t prefix_tokens = 0;   // the entry's own length (the handle's to_offset)
};

struct PrefixEntry {
  SnapshotInfo snapshot;
  std::string model;
  uint64_t tokens = 0;
  uint64_t hits = 0;
  bool extended = false;  // a longer entry of its layout starts with its tokens
};

// A snapshot made from a prompt-cache file, and what the file said.
struct LoadedSnapshot {
  SnapshotInfo snapshot;
  CacheSpec spec;
  std::map<std::string, std::string> metadata;  // the file's user metadata
  bool checksum_verified = false;
};

// What renewing leases found: one per id asked for, in order.
struct RenewedLeases {
  std::vector<LeaseInfo> caches;
  std::vector<LeaseInfo> snapshots;
};

class Engine {
 public:
  Engine(gpu::PagePool& pool, EngineOptions options);
  ~Engine();

  // `ttl` zero takes options().default_ttl.
  absl::StatusOr<CacheInfo> CreateCache(const CacheSpec& spec,
                                        absl::Duration ttl = absl::ZeroDuration());
  absl::StatusOr<CacheInfo> GetCache(const std::string& cache_id) const;
  // The cache's (normalised) spec. FilterRows and ExtendCache change its
  // batch_size and left_padding; nothing else changes it.
  absl::StatusOr<CacheSpec> GetSpec(const std::string& cache_id) const;
  // GetSpec for callers that keep the spec between calls (an Update stream):
  // copies it into `spec` only when `layout_id` is not the cache's current
  // Cache::layout_id(), which it then becomes. A lock, and no copy, per call.
  absl::Status RefreshSpec(const std::string& cache_id, uint64_t& layout_id,
                           CacheSpec& spec) const;
  std::vector<CacheInfo> ListCaches() const;
  // Frees the cache's pages; snapshots taken from it stay valid.
  absl::Status DeleteCache(const std::string& cache_id);

  // Appends L tokens to one layer. `kv.keys` is [B, H, L, Dk] and `kv.values`
  // [B, H, L, Dv] in the cache's dtype. With `expected_offset`, refuses
  // (FAILED_PRECONDITION) unless the layer is at that offset. Returns the
  // layer's new offset.
  absl::StatusOr<uint64_t> Update(const std::string& cache_id, uint32_t layer, const KvInput& kv,
                                  std::optional<uint64_t> expected_offset = std::nullopt);

  // Replaces a recurrent layer's state and advances its offset by
  // state.advance; INVALID_ARGUMENT for attention layers.
  absl::StatusOr<uint64_t> UpdateState(const std::string& cache_id, uint32_t layer,
                                       const StateInput& state,
                                       std::optional<uint64_t> expected_offset = std::nullopt);

  // The state a Fetch reads, frozen: the live cache (snapshot_id empty) or a
  // snapshot. Costs page references, not copies.
  absl::StatusOr<std::shared_ptr<const CacheSnapshot>> Freeze(const std::string& cache_id,
                                                              const std::string& snapshot_id) const;

  // mlx-lm trim on every layer: FAILED_PRECONDITION unless all are trimmable
  // and in step. Returns the number trimmed: n, or less where a layer holds
  // fewer (Layer::TrimmableTokens: the offset; a chunked layer's tokens above
  // its start position). `after`, when not null, gets the cache as this trim
  // left it, described under the same lock.
  absl::StatusOr<uint64_t> Trim(const std::string& cache_id, uint64_t n,
                                CacheInfo* after = nullptr);

  // `ttl` zero takes options().default_ttl.
  absl::StatusOr<SnapshotInfo> Snapshot(const std::string& cache_id, uint64_t from_offset,
                                        bool pinned = false,
                                        absl::Duration ttl = absl::ZeroDuration());
  // Brings every layer to `target_offset` from the snapshot, or by rewinding the
  // live state when snapshot_id is empty; all layers or none.
  absl::StatusOr<CacheInfo> Restore(const std::string& cache_id, const std::string& snapshot_id,
                                    uint64_t target_offset);
  // [a,b) + [b,c) -> [a,c). Consumes both inputs on success.
  absl::StatusOr<SnapshotInfo> MergeSnapshots(const std::string& parent_id,
                                              const std::string& child_id);
  // [a,c) at b -> ([a,b), [b,c)), a < b < c. Consumes the input on success.
  absl::StatusOr<std::pair<SnapshotInfo, SnapshotInfo>> SplitSnapshot(
      const std::string& snapshot_id, uint64_t at);
  absl::Status ReleaseSnapshot(const std::string& snapshot_id);
  // All snapshots, or those taken from `cache_id` when it is not empty.
  std::vector<SnapshotInfo> ListSnapshots(const std::string& cache_id = "") const;

  // Batches (mlx-lm BatchKVCache / BatchRotatingKVCache; engine/batch/batch_ops.h has
  // the model). Every cache involved must have its layers in step
  // (FAILED_PRECONDITION otherwise). Each builds the result completely before
  // anything changes, so a failed call changes nothing; the sources are only
  // read. Caches are locked in id order, so calls on the same caches from
  // several threads cannot deadlock.
  //
  // A new one-row cache holding row `row` without its padding.
  absl::StatusOr<CacheInfo> ExtractRow(const std::string& cache_id, uint32_t row);
  // Keeps `keep_rows` (in that order; repeats copy a row) and drops the padding
  // they all share. The cache keeps its id; its snapshots stay as they were.
  absl::StatusOr<CacheInfo> FilterRows(const std::string& cache_id,
                                       absl::Span<const uint32_t> keep_rows);
  // A new cache of every row of `cache_ids` in order, each right-aligned to the
  // longest and left-padded. They need the same layout apart from batch size
  // (INVALID_ARGUMENT naming cache_ids[i]); an id may repeat (its rows repeat).
  absl::StatusOr<CacheInfo> MergeCaches(absl::Span<const std::string> cache_ids);
  // Appends `other_id`'s rows (unchanged; it may be cache_id itself), both
  // right-aligned to the longer.
  absl::StatusOr<CacheInfo> ExtendCache(const std::string& cache_id, const std::string& other_id);

  // Speculative decoding (engine/speculation/speculation.h has the semantics). One open
  // speculation per cache; while it is open the cache's live Update,
  // UpdateState, Trim, Restore, FilterRows and ExtendCache (as cache_id) are
  // FAILED_PRECONDITION, and its snapshots (registered or frozen for a
  // Fetch) and batch reads see the committed history. Deleting the cache ends it. An unknown or ended
  // speculation_id is NOT_FOUND, as is one named with a cache_id (non-empty)
  // that is not its cache's.
  //
  // Starts one on `cache_id`, whose layers must be in step (else, or when one
  // is already open, FAILED_PRECONDITION). Isolated: a commit never changes
  // the live cache (ollama BeginIsolatedSpeculation).
  absl::StatusOr<SpeculationInfo> BeginSpeculation(const std::string& cache_id, bool isolated);
  // `cache_id` as in UpdateSpeculation: empty, or the speculation's cache.
  absl::StatusOr<SpeculationInfo> GetSpeculation(const std::string& speculation_id,
                                                 const std::string& cache_id = "") const;
  // Update / UpdateState of the speculative state: the tokens (state) are
  // drafted on `layer`; expected_offset and the returned offset are the
  // layer's committed + drafted offset.
  absl::StatusOr<uint64_t> UpdateSpeculation(const std::string& speculation_id,
                                             const std::string& cache_id, uint32_t layer,
                                             const KvInput& kv,
                                             std::optional<uint64_t> expected_offset = std::nullopt);
  absl::StatusOr<uint64_t> UpdateSpeculationState(
      const std::string& speculation_id, const std::string& cache_id, uint32_t layer,
      const StateInput& state, std::optional<uint64_t> expected_offset = std::nullopt);
  // Freeze for Fetch with FetchRequest's three ids: speculation_id empty is
  // Freeze(cache_id, snapshot_id); else the speculative state (committed +
  // drafted, from 0), and snapshot_id must be empty (INVALID_ARGUMENT).
  absl::StatusOr<std::shared_ptr<const CacheSnapshot>> Freeze(
      const std::string& cache_id, const std::string& snapshot_id,
      const std::string& speculation_id) const;
  // Keeps the first `accepted` drafted tokens (isolated: none) and ends the
  // speculation; returns the cache as it is then. Refusals, checked in this
  // order, change nothing and leave it open: accepted above the most tokens
  // any layer drafted (INVALID_ARGUMENT naming accepted, even with the layers
  // out of step); drafted layers out of step (FAILED_PRECONDITION); a
  // recurrent layer without a state at committed + accepted
  // (FAILED_PRECONDITION naming the layer).
  absl::StatusOr<CacheInfo> CommitSpeculation(const std::string& speculation_id,
                                              uint64_t accepted);
  // Drops every drafted token and ends the speculation.
  absl::StatusOr<CacheInfo> AbortSpeculation(const std::string& speculation_id);

  // Leases (lease.h). Every call above that finds a cache or snapshot by id
  // renews its lease. RenewLease renews them all, or none when an id is
  // unknown (NOT_FOUND naming cache_ids[i] or snapshot_ids[i]).
  absl::StatusOr<RenewedLeases> RenewLease(absl::Span<const std::string> cache_ids,
                                           absl::Span<const std::string> snapshot_ids);
  // Pins (never evicted, never expires; within max_pinned_bytes) or unpins.
  // Pinning an evicted snapshot brings its pages back to the device first.
  absl::StatusOr<SnapshotInfo> SetPinned(const std::string& snapshot_id, bool pinned);
  // Deletes every cache and releases every snapshot whose lease has run out,
  // exactly as DeleteCache and ReleaseSnapshot would; the reaper's pass
  // (lease_reaper.h). Returns how many of each.
  std::pair<uint64_t, uint64_t> ExpireLeases();
  // Deadlines the reaper's queues hold: at most one per cache or snapshot
  // with a lease, however often calls name it.
  size_t QueuedLeaseDeadlines() const;

  // Prompt-cache files (mlx-lm save_prompt_cache; engine/files/mlx_state.h maps
  // the layout, engine/files/saved_files.h keeps the files). A snapshot as a file:
  // it must start at 0 (FAILED_PRECONDITION otherwise); `metadata` becomes
  // the file's user metadata.
  absl::StatusOr<PromptCacheFile> ExportSnapshot(
      const std::string& snapshot_id, const std::map<std::string, std::string>& metadata) const;
  // A new snapshot [0, offset) of a file's state, pinned and leased as
  // Snapshot's; INVALID_ARGUMENT naming the tensor or metadata key a bad file
  // gets wrong, and then nothing is made.
  absl::StatusOr<LoadedSnapshot> ImportSnapshot(const PromptCacheFile& file, bool checksum_verified,
                                                bool pinned, absl::Duration ttl);
  // Decodes `bytes` (DATA_LOSS when damaged), imports them, and with a
  // non-empty `name` saves them too: both or neither.
  absl::StatusOr<LoadedSnapshot> ImportBytes(absl::string_view bytes, const std::string& name,
                                             bool pinned, absl::Duration ttl);
  // The same through the data dir.
  absl::StatusOr<SavedFileInfo> SaveSnapshot(const std::string& snapshot_id,
                                             const std::string& name,
                                             const std::map<std::string, std::string>& metadata);
  absl::StatusOr<LoadedSnapshot> LoadSnapshot(const std::string& name, bool pinned,
                                              absl::Duration ttl);
  absl::StatusOr<std::vector<SavedFileInfo>> ListSaved() const;
  absl::Status DeleteSaved(const std::string& name);
  // A saved file's bytes as stored.
  absl::StatusOr<std::string> ReadSaved(const std::string& name) const;

  // Prefix sharing (engine/prefix/prefix_index.h has the index). `name_space`
  // keeps tenants apart ("" until there are tenants).
  //
  // Publishes the first tokens.size() tokens of snapshot `snapshot_id` (which
  // must start at 0 and be of batch size 1) as the K/V of `tokens`, under a
  // new entry snapshot with a lease of `ttl` (zero: the default). Pages of
  // an earlier entry that agrees on a prefix are shared, not stored again;
  // an earlier entry this one extends is dropped (this one answers all its
  // lookups). A layout with a rotating, chunked or recurrent layer publishes
  // only a snapshot that ends where the tokens do (FAILED_PRECONDITION).
  //
  // Entries are the server's cache, not a caller's state: when the device
  // and every tier below it are full, or the metadata budget is, unpinned
  // entries are dropped, least recently used first and those nobody extends
  // before those they lead to, so that a call gets room instead of
  // RESOURCE_EXHAUSTED. A handle from a lookup holds its own snapshot, so
  // dropping its entry never takes what a worker restores from.
  absl::StatusOr<PublishedPrefix> PublishPrefix(const std::string& name_space,
                                                const std::string& snapshot_id,
                                                absl::Span<const uint32_t> tokens,
                                                absl::Duration ttl = absl::ZeroDuration());
  // The longest published prefix of `tokens` for caches of `spec`, with a
  // new snapshot handle on it (no pages copied), leased for `ttl`; zero: the
  // default, or 5 minutes without one. A miss is not an error: no handle,
  // matched_tokens 0.
  absl::StatusOr<PrefixLookup> LookupPrefix(const std::string& name_space, const CacheSpec& spec,
                                            absl::Span<const uint32_t> tokens,
                                            absl::Duration ttl = absl::ZeroDuration());
  std::vector<PrefixEntry> ListPrefixes() const;
  // Drops unpinned prefix entries, the least recently used leaves of the
  // index first, until their pages' bytes (in every tier) reach `bytes`, at
  // least one entry; returns how many went. What Tiering calls before
  // refusing a call.
  uint64_t DropLeastRecentPrefixes(uint64_t bytes);

  // Moves about `pages` pages of idle snapshots to a lower tier (at least a
  // batch), least recently used first; how many moved. For other engines
  // over the same pool (EngineOptions::evict_elsewhere).
  absl::StatusOr<uint32_t> EvictIdlePages(uint32_t pages) { return tiering_.Evict(pages); }
  // An operator's eviction (the EvictSnapshots RPC): moves up to `bytes` of
  // idle, unpinned snapshots' device pages (0: every one that can move) to a
  // lower tier, least recently used first, so the device has room before
  // it is needed. FAILED_PRECONDITION naming host_bytes when the server has
  // no lower tier; RESOURCE_EXHAUSTED naming it when the tiers below are
  // full. Returns how many pages moved (0: nothing idle on the device).
  absl::StatusOr<uint32_t> EvictIdleBytes(uint64_t bytes);
  EngineStats Stats() const;
  gpu::PagePool& pool() { return pool_; }
  const EngineOptions& options() const { return options_; }

 private:
  // A cache and the mutex that serialises calls on it. `deleted` turns away
  // calls that found the entry just before DeleteCache removed it.
  struct Entry {
    explicit Entry(absl::Duration ttl) : lease(ttl) {}
    // Renewed under caches_mutex_ (so never after the reaper found it run out),
    // read anywhere.
    Lease lease;
    absl::Mutex mutex;
    std::unique_ptr<Cache> cache ABSL_GUARDED_BY(mutex);
    MetadataCharge metadata ABSL_GUARDED_BY(mutex);  // the cache's
    bool deleted ABSL_GUARDED_BY(mutex) = false;
    // Declared after `cache`, so destroyed first: its drafts refer to the layers.
    std::unique_ptr<Speculation> speculation ABSL_GUARDED_BY(mutex);
  };
  class LockedCache;
  // Where a speculation id leads.
  struct SpeculationOwner {
    std::string cache_id;
    std::shared_ptr<Entry> entry;
  };

  // Checks `layer` and `expected_offset`, then applies one update under the lock.
  absl::StatusOr<uint64_t> UpdateLayer(const std::string& cache_id, uint32_t layer,
                                       std::optional<uint64_t> expected_offset,
                                       absl::FunctionRef<absl::Status(Cache&)> apply);
  absl::StatusOr<std::shared_ptr<Entry>> FindEntry(const std::string& cache_id) const;
  static CacheInfo Describe(const std::string& cache_id, const Cache& cache, const Lease& lease);
  // Registers `cache` under a new id, with a lease of `ttl` (zero: the
  // default), or RESOURCE_EXHAUSTED when its metadata does not fit (`cache`
  // is dropped then).
  absl::StatusOr<CacheInfo> AddCache(std::unique_ptr<Cache> cache,
                                     absl::Duration ttl = absl::ZeroDuration());
  absl::StatusOr<MetadataCharge> ChargeCache(const Cache& cache);
  absl::StatusOr<MetadataCharge> ChargeSnapshot(const CacheSnapshot& snapshot);
  // The data dir's store, or FAILED_PRECONDITION naming data_dir.
  absl::StatusOr<SavedFileStore*> SavedFiles() const;
  // What deleting a cache does once its entry is out of the map: ends its
  // speculation and frees its pages.
  void Retire(Entry& entry);
  uint64_t ExpireCaches();

  // Speculations (engine_speculation.cc). The cache of open speculation
  // `speculation_id`, locked, and its id in `owner_id` (when not null).
  absl::StatusOr<LockedCache> OpenSpeculation(const std::string& speculation_id,
                                              const std::string& cache_id,
                                              std::string* owner_id = nullptr) const;
  // Checks `layer` and `expected_offset`, then applies one drafted update.
  absl::StatusOr<uint64_t> UpdateDraft(const std::string& speculation_id,
                                       const std::string& cache_id, uint32_t layer,
                                       std::optional<uint64_t> expected_offset,
                                       absl::FunctionRef<absl::Status(Speculation&)> apply);
  // Ends the speculation open on `cache` and forgets its id.
  void EndSpeculation(LockedCache& cache);
  void ForgetSpeculation(const std::string& speculation_id);
  static SpeculationInfo DescribeSpeculation(const std::string& cache_id,
                                             const Speculation& speculation);

  // Prefixes (engine_prefixes.cc). What a prefix entry of `tokens` from
  // `source` holds: pages of `earlier` (an entry agreeing on a prefix) where
  // it can, the rest from `source`. `shared` gets how many tokens came from
  // `earlier`.
  absl::StatusOr<CacheSnapshotPtr> PrefixContent(const CacheSnapshotPtr& source, uint64_t tokens,
                                                 bool any_length,
                                                 const std::optional<PrefixFound>& earlier,
                                                 uint64_t& shared);

  gpu::PagePool& pool_;
  const EngineOptions options_;
  const LeaseClock& clock_;
  MetadataBudget metadata_;
  // The pool's share of page tables (PoolTablesBytes), held for the engine's life.
  MetadataCharge pool_tables_;
  mutable absl::Mutex caches_mutex_;
  absl::flat_hash_map<std::string, std::shared_ptr<Entry>> caches_ ABSL_GUARDED_BY(caches_mutex_);
  LeaseQueue cache_deadlines_ ABSL_GUARDED_BY(caches_mutex_);
  std::atomic<uint64_t> caches_expired_{0};
  // Before snapshots_, which tells it of every snapshot it drops.
  PrefixIndex prefixes_;
  // Lock order: caches_mutex_, then the registry's (RenewLease holds both).
  SnapshotRegistry snapshots_;
  // Takes registered snapshots for calls that read their pages (Acquire),
  // and makes room on the device (RetryAfterEviction) for every call that
  // allocates pages: none holds another lock when it does.
  const Tiering tiering_{pool_, snapshots_,
                         [this](uint64_t bytes) { return DropLeastRecentPrefixes(bytes); },
                         options_.evict_elsewhere};
  std::atomic<uint64_t> prefixes_dropped_{0};
  // Lock order: a cache's mutex, then this one (never the other way round).
  mutable absl::Mutex speculations_mutex_;
  absl::flat_hash_map<std::string, SpeculationOwner> speculations_
      ABSL_GUARDED_BY(speculations_mutex_);
};

}  // namespace kvcache::engine
