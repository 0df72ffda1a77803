// Engine's prefix calls (engine.h; the index in engine/prefix/prefix_index.h).
//
// An entry is a registered snapshot of its own, made when the prefix is
// published, so the publisher may release its snapshot at once and the entry
// lives on under its own lease, tiers and metadata charge. A lookup hands out
// a second handle on the same snapshot: page references, no copy.
#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "engine/engine.h"

namespace kvcache::engine {
namespace {

// Most token ids one publish or lookup may carry: a 1M-token context, 4 MiB.
constexpr uint64_t kMaxPrefixTokens = 1 << 20;
// A lookup's handle when neither the call nor the server gives a lease: a
// handle nobody uses must not hold its entry's pages for ever.
constexpr absl::Duration kLookupHandleTtl = absl::Minutes(5);

absl::Status CheckTokens(absl::Span<const uint32_t> tokens) {
  if (tokens.empty()) return absl::InvalidArgumentError("tokens: empty; a prefix has a token");
  if (tokens.size() > kMaxPrefixTokens) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tokens: %d ids, at most %d", tokens.size(), kMaxPrefixTokens));
  }
  return absl::OkStatus();
}

// What a snapshot must be for its first `tokens` tokens to be a prefix.
absl::Status CheckPublishable(const CacheSnapshot& snapshot, uint64_t tokens, bool any_length) {
  if (snapshot.spec.batch_size != 1 || !snapshot.spec.left_padding.empty()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "snapshot_id: a prefix is one unpadded sequence; the snapshot has batch_size %d%s",
        snapshot.spec.batch_size, snapshot.spec.left_padding.empty() ? "" : " and left_padding"));
  }
  if (snapshot.from != 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("snapshot_id: a prefix starts at 0; the snapshot holds [%d, %d)",
                        snapshot.from, snapshot.to));
  }
  if (tokens > snapshot.to) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tokens: %d ids, but the snapshot holds only [0, %d)", tokens, snapshot.to));
  }
  if (!any_length && tokens != snapshot.to) {
    // A rotating window, a chunked front or a recurrent state is the state
    // at the snapshot's end; it cannot be cut back to an earlier position.
    return absl::FailedPreconditionError(absl::StrFormat(
        "tokens: this layout (rotating, chunked or recurrent layers) publishes a snapshot "
        "where its prefix ends; the snapshot holds [0, %d), tokens has %d ids",
        snapshot.to, tokens));
  }
  return absl::OkStatus();
}

// The snapshot's [0, end) (itself when it ends there).
absl::StatusOr<CacheSnapshotPtr> Head(const CacheSnapshotPtr& snapshot, uint64_t end) {
  if (snapshot->to == end) return snapshot;
  ASSIGN_OR_RETURN(auto halves, SplitSnapshot(*snapshot, end));
  return std::move(halves.first);
}

absl::StatusOr<CacheSnapshotPtr> Tail(const CacheSnapshotPtr& snapshot, uint64_t begin) {
  if (snapshot->from == begin) return snapshot;
  ASSIGN_OR_RETURN(auto halves, SplitSnapshot(*snapshot, begin));
  return std::move(halves.second);
}

// A snapshot of its own for a second registry entry: the layers (and so the
// pages) are shared, but eviction moves only snapshots that one registry
// entry alone holds (tiering.cc), so two entries must not share the object.
CacheSnapshotPtr OwnCopy(const CacheSnapshotPtr& snapshot) {
  return std::make_shared<CacheSnapshot>(*snapshot);
}

// Whether entry `newer` may take the place of entry `older` in the index:
// never a pinned one, nor one that would outlive it.
bool MayReplace(const SnapshotInfo& newer, const SnapshotInfo& older) {
  if (older.pinned) return false;
  return newer.pinned || older.expires_at <= newer.expires_at;
}

}  // namespace

absl::StatusOr<CacheSnapshotPtr> Engine::PrefixContent(const CacheSnapshotPtr& source,
                                                       uint64_t tokens, bool any_length,
                                                       const std::optional<PrefixFound>& earlier,
                                                       uint64_t& shared) {
  shared = 0;
  // Where a layout restores only where it ends, only equal tokens could
  // share, and those keep the earlier entry (PublishPrefix).
  if (!any_length || !earlier.has_value()) return Head(source, tokens);
  // Sharing copies at most one boundary page per layer; on page boundaries, none.
  const uint64_t matched = earlier->matched_tokens;
  const uint64_t at =
      matched == tokens ? tokens : matched / options_.page_tokens * options_.page_tokens;
  if (at == 0) return Head(source, tokens);
  absl::StatusOr<CacheSnapshotPtr> existing = tiering_.Acquire(earlier->snapshot_id);
  if (!existing.ok()) {
    if (absl::IsNotFound(existing.status())) return Head(source, tokens);  // dropped since
    return existing.status();
  }
  ASSIGN_OR_RETURN(CacheSnapshotPtr lower, Head(*existing, at));
  shared = at;
  if (at == tokens) return lower;
  ASSIGN_OR_RETURN(CacheSnapshotPtr own, Head(source, tokens));
  ASSIGN_OR_RETURN(CacheSnapshotPtr upper, Tail(own, at));
  return engine::MergeSnapshots(*lower, *upper);
}

absl::StatusOr<PublishedPrefix> Engine::PublishPrefix(const std::string& name_space,
                                                      const std::string& snapshot_id,
                                                      absl::Span<const uint32_t> tokens,
                                                      absl::Duration ttl) {
  RETURN_IF_ERROR(CheckTokens(tokens));
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<PublishedPrefix> {
    // Acquired: a merge with an earlier entry may copy a boundary page.
    ASSIGN_OR_RETURN(CacheSnapshotPtr source, tiering_.Acquire(snapshot_id));
    const bool any_length = RestorableAtAnyLength(source->spec);
    RETURN_IF_ERROR(CheckPublishable(*source, tokens.size(), any_length));
    const std::string scope = ScopeKey(name_space, source->spec);
    const std::optional<PrefixFound> earlier = prefixes_.Find(scope, tokens);
    if (earlier.has_value() && earlier->entry_tokens == tokens.size() &&
        earlier->matched_tokens == tokens.size() && snapshots_.Get(earlier->snapshot_id).ok()) {
      if (std::optional<SnapshotInfo> kept = snapshots_.Peek(earlier->snapshot_id)) {
        return PublishedPrefix{.entry = *std::move(kept),
                               .tokens = tokens.size(),
                               .shared_tokens = tokens.size(),
                               .already_published = true};
      }
    }
    uint64_t shared = 0;
    ASSIGN_OR_RETURN(CacheSnapshotPtr content,
                     PrefixContent(source, tokens.size(), any_length, earlier, shared));
    ASSIGN_OR_RETURN(
        MetadataCharge charge,
        metadata_.Charge(SnapshotMetadataBytes(*content, pool_.page_bytes(), options_.page_tokens) +
                             PrefixEntryMetadataBytes(
                                 tokens.size(), any_length ? options_.prefix_blocks : nullptr),
                         "a prefix entry"));
    ASSIGN_OR_RETURN(SnapshotInfo entry, snapshots_.Add(OwnCopy(content), std::move(charge),
                                                        /*pinned=*/false, ttl));
    // Another publish of the same tokens may have landed meanwhile: one stays,
    // never a pinned or longer-lived one's place taken.
    if (std::optional<std::string> replaced =
            prefixes_.Publish(scope, any_length, tokens, entry.snapshot_id, source->spec.model)) {
      const std::optional<SnapshotInfo> other = snapshots_.Peek(*replaced);
      if (other.has_value() && !MayReplace(entry, *other)) {
        prefixes_.Publish(scope, any_length, tokens, *replaced, source->spec.model);
        (void)snapshots_.Release(entry.snapshot_id);
        return PublishedPrefix{.entry = *other,
                               .tokens = tokens.size(),
                               .shared_tokens = tokens.size(),
                               .already_published = true};
      }
      (void)snapshots_.Release(*replaced);
    }
    // Released or expired between Add and Publish: the registry told the
    // index before the index had it.
    if (!snapshots_.Peek(entry.snapshot_id).has_value()) {
      prefixes_.Forget(entry.snapshot_id);
      return absl::NotFoundError("snapshot_id: released while it was being published");
    }
    // An earlier entry whose tokens all lead this one's answers nothing this
    // one does not (any_length: it restores at every shorter length too),
    // unless it is pinned or outlives this one.
    if (any_length && earlier.has_value() && earlier->entry_tokens == earlier->matched_tokens &&
        earlier->entry_tokens < tokens.size()) {
      const std::optional<SnapshotInfo> extended = snapshots_.Peek(earlier->snapshot_id);
      if (extended.has_value() && MayReplace(entry, *extended)) {
        (void)snapshots_.Release(earlier->snapshot_id);
      }
    }
    return PublishedPrefix{.entry = std::move(entry),
                           .tokens = tokens.size(),
                           .shared_tokens = shared,
                           .already_published = false};
  });
}

absl::StatusOr<PrefixLookup> Engine::LookupPrefix(const std::string& name_space,
                                                  const CacheSpec& spec,
                                                  absl::Span<const uint32_t> tokens,
                                                  absl::Duration ttl) {
  RETURN_IF_ERROR(CheckTokens(tokens));
  RETURN_IF_ERROR(ValidateSpec(spec, options_.limits));
  if (ttl == absl::ZeroDuration()) ttl = options_.default_ttl;
  if (ttl == absl::ZeroDuration()) ttl = kLookupHandleTtl;
  const std::string scope = ScopeKey(name_space, NormalizeSpec(spec));
  // The handle's charge may need older entries dropped first.
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<PrefixLookup> {
    // An entry may be released between the index's answer and the
    // registry's; the index forgets it then, and the next walk finds the
    // next best.
    constexpr int kAttempts = 4;
    for (int attempt = 0; attempt < kAttempts; ++attempt) {
      const std::optional<PrefixFound> found = prefixes_.Lookup(scope, tokens);
      if (!found.has_value()) return PrefixLookup{};
      absl::StatusOr<CacheSnapshotPtr> entry = snapshots_.Get(found->snapshot_id);
      if (!entry.ok()) {
        prefixes_.Forget(found->snapshot_id);
        continue;
      }
      // Charged as a snapshot: the handle keeps the entry's tables alive
      // after the entry itself goes.
      ASSIGN_OR_RETURN(MetadataCharge charge, ChargeSnapshot(**entry));
      ASSIGN_OR_RETURN(SnapshotInfo handle,
                       snapshots_.Add(OwnCopy(*entry), std::move(charge), /*pinned=*/false, ttl));
      return PrefixLookup{.handle = std::move(handle),
                          .matched_tokens = found->matched_tokens,
                          .prefix_tokens = found->entry_tokens};
    }
    return PrefixLookup{};
  });
}

std::vector<PrefixEntry> Engine::ListPrefixes() const {
  std::vector<PrefixEntry> entries;
  for (const PrefixEntryInfo& published : prefixes_.List()) {
    std::optional<SnapshotInfo> snapshot = snapshots_.Peek(published.snapshot_id);
    if (!snapshot.has_value()) continue;  // dropped since
    entries.push_back(PrefixEntry{.snapshot = *std::move(snapshot),
                                  .model = published.model,
                                  .tokens = published.tokens,
                                  .hits = published.hits,
                                  .extended = published.extended});
  }
  return entries;
}

uint64_t Engine::DropLeastRecentPrefixes(uint64_t bytes) {
  // A scan over entries: this runs only when a call would otherwise be
  // refused, never on a lookup.
  struct Candidate {
    bool extended;
    uint64_t last_use;
    uint64_t page_bytes;  // its pages, wherever they are
    std::string snapshot_id;
  };
  std::vector<Candidate> candidates;
  for (PrefixEntry& entry : ListPrefixes()) {
    if (entry.snapshot.pinned) continue;
    candidates.push_back(Candidate{
        .extended = entry.extended,
        .last_use = entry.snapshot.last_use,
        .page_bytes =
            entry.snapshot.tiers.device + entry.snapshot.tiers.host + entry.snapshot.tiers.disk,
        .snapshot_id = std::move(entry.snapshot.snapshot_id)});
  }
  // Leaves first: dropping an entry that others extend frees little (they
  // share its pages) and loses the shorter match.
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    return std::tie(a.extended, a.last_use) < std::tie(b.extended, b.last_use);
  });
  uint64_t dropped = 0;
  uint64_t dropped_bytes = 0;
  for (const Candidate& candidate : candidates) {
    if (dropped > 0 && dropped_bytes >= bytes) break;
    // Released meanwhile, or pinned since: not this one.
    if (!snapshots_.ReleaseUnpinned(candidate.snapshot_id)) continue;
    ++dropped;
    dropped_bytes += candidate.page_bytes;
  }
  prefixes_dropped_.fetch_add(dropped, std::memory_order_relaxed);
  return dropped;
}

}  // namespace kvcache::engine
