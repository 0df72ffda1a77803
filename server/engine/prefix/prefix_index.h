// Published prefixes: for each scope, which registered snapshot holds the K/V
// of the longest cached prefix of a token sequence (engine/prefix/prefix_tree.h).
//
// A scope is a namespace (the tenant, once tenants exist) and a layout: the
// model name, dtype, batch size and every layer's spec (ScopeKey). Layouts
// never match each other, nor do namespaces.
//
// Values are snapshot ids, not snapshots: the registry stays the only holder
// of a published snapshot, so it is leased, evicted to lower tiers and
// released like any other; whoever releases it calls Forget.
//
// Where a layout holds a rotating window, a chunked front or recurrent state,
// a snapshot restores only at the offset it was taken at, so its scope
// matches only where a published prefix ends (RestorableAtAnyLength false).
//
// Threads: lookups share a reader lock and count hits in atomics; publishing
// and forgetting take it exclusively for a tree walk only (O(tokens)), so a
// lookup never waits behind anything slower, but for one case: with KV
// events on, a publish or forget also waits for the replica's block ledger,
// which a restart of the publisher holds while it copies every block out
// (rare: only after its queue overflowed).
//
// Block events (engine/prefix/prefix_blocks.h): where a ledger is given, every
// publish and forget of an entry that restores at any length counts its
// blocks in or out, under the lock, so the ledger sees the index's own order.
// Entries that restore only where they end are not counted: a router that
// matches block by block would send work here for prefixes that stop inside
// them, which they cannot serve.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "engine/layers/cache_spec.h"
#include "engine/prefix/prefix_blocks.h"
#include "engine/prefix/prefix_tree.h"

namespace kvcache::engine {

// A canonical, unambiguous encoding of (name_space, the spec's layout); equal
// iff both are equal. left_padding is not part of a layout.
std::string ScopeKey(absl::string_view name_space, const CacheSpec& spec);

// Whether a snapshot of this layout restores at any offset up to its own:
// true iff every layer is standard or quantized.
bool RestorableAtAnyLength(const CacheSpec& spec);

struct PrefixFound {
  std::string snapshot_id;
  uint64_t matched_tokens = 0;
  uint64_t entry_tokens = 0;  // the length it was published with
};

struct PrefixEntryInfo {
  std::string snapshot_id;
  std::string model;
  uint64_t tokens = 0;
  uint64_t hits = 0;  // lookups this entry answered
  // Another entry of its scope extends it (it is not a leaf of the tree).
  bool extended = false;
};

struct PrefixStats {
  uint64_t entries = 0;
  uint64_t stored_tokens = 0;  // on the trees' edges (shared prefixes once)
  uint64_t lookups = 0;
  uint64_t hits = 0;            // lookups that matched at least one token
  uint64_t matched_tokens = 0;  // summed over hits
  // Entries the engine dropped to make room (Engine::DropLeastRecentPrefixes).
  uint64_t dropped = 0;
};

class PrefixIndex {
 public:
  // Counts entries' blocks in `blocks` from now on (before the first publish:
  // entries already there are not counted). It outlives the index.
  void CountBlocksIn(PrefixBlocks* blocks);

  // Publishes `snapshot_id` as the K/V of `tokens` (not empty) in `scope`. An
  // id published before under other tokens moves here. Returns the id that
  // was published for exactly these tokens before, now forgotten.
  // `model` is only shown (List).
  std::optional<std::string> Publish(const std::string& scope, bool any_length,
                                     absl::Span<const uint32_t> tokens,
                                     const std::string& snapshot_id, std::string model = "");
  // The longest published prefix of `tokens` in `scope`, if any, counted in
  // the stats (Lookup) or not (Find: what a publish asks before it stores).
  std::optional<PrefixFound> Lookup(const std::string& scope,
                                    absl::Span<const uint32_t> tokens) const;
  std::optional<PrefixFound> Find(const std::string& scope,
                                  absl::Span<const uint32_t> tokens) const;
  // Forgets what `snapshot_id` was published as; false if it was not.
  bool Forget(const std::string& snapshot_id);
  // Forgets each of `snapshot_ids` that was published. Told of every
  // snapshot the registry drops, most of them never published, so it looks
  // under the shared lock first and takes it exclusively only when one was.
  void ForgetAny(absl::Span<const std::string> snapshot_ids);

  PrefixStats Stats() const;
  std::vector<PrefixEntryInfo> List() const;  // sorted by snapshot id

 private:
  struct Scope {
    bool any_length = true;
    PrefixTree<std::string> tree;
  };
  struct Entry {
    std::string scope;
    std::string model;
    std::vector<uint32_t> tokens;
    mutable std::atomic<uint64_t> hits{0};
  };

  // Find's walk; the entry found in `entry` when not null.
  std::optional<PrefixFound> FindLocked(const std::string& scope, absl::Span<const uint32_t> tokens,
                                        const Entry** entry) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void ForgetLocked(absl::flat_hash_map<std::string, std::unique_ptr<Entry>>::iterator entry)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Scope> scopes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  PrefixBlocks* blocks_ ABSL_GUARDED_BY(mu_) = nullptr;
  mutable std::atomic<uint64_t> lookups_{0};
  mutable std::atomic<uint64_t> hits_{0};
  mutable std::atomic<uint64_t> matched_tokens_{0};
};

}  // namespace kvcache::engine
