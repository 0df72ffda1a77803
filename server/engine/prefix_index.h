// Published prefixes: for each scope, which registered snapshot holds the K/V
// of the longest cached prefix of a token sequence (engine/prefix_tree.h).
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
// lookup never waits behind anything slower.
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
#include "engine/cache_spec.h"
#include "engine/prefix_tree.h"

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
};

struct PrefixEntryInfo {
  std::string snapshot_id;
  uint64_t tokens = 0;
  uint64_t hits = 0;  // lookups this entry answered
};

struct PrefixStats {
  uint64_t entries = 0;
  uint64_t stored_tokens = 0;  // on the trees' edges (shared prefixes once)
  uint64_t lookups = 0;
  uint64_t hits = 0;            // lookups that matched at least one token
  uint64_t matched_tokens = 0;  // summed over hits
};

class PrefixIndex {
 public:
  // Publishes `snapshot_id` as the K/V of `tokens` (not empty) in `scope`. An
  // id published before under other tokens moves here. Returns the id that
  // was published for exactly these tokens before, now forgotten.
  std::optional<std::string> Publish(const std::string& scope, bool any_length,
                                     absl::Span<const uint32_t> tokens,
                                     const std::string& snapshot_id);
  // The longest published prefix of `tokens` in `scope`, if any.
  std::optional<PrefixFound> Lookup(const std::string& scope,
                                    absl::Span<const uint32_t> tokens) const;
  // Forgets what `snapshot_id` was published as; false if it was not.
  bool Forget(const std::string& snapshot_id);

  PrefixStats Stats() const;
  std::vector<PrefixEntryInfo> List() const;  // sorted by snapshot id

 private:
  struct Scope {
    bool any_length = true;
    PrefixTree<std::string> tree;
  };
  struct Entry {
    std::string scope;
    std::vector<uint32_t> tokens;
    std::atomic<uint64_t> hits{0};
  };

  void ForgetLocked(absl::flat_hash_map<std::string, std::unique_ptr<Entry>>::iterator entry)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Scope> scopes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  mutable std::atomic<uint64_t> lookups_{0};
  mutable std::atomic<uint64_t> hits_{0};
  mutable std::atomic<uint64_t> matched_tokens_{0};
};

}  // namespace kvcache::engine
