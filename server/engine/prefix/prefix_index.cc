#include "engine/prefix/prefix_index.h"

#include <algorithm>
#include <type_traits>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"

namespace kvcache::engine {
namespace {

// Each field as "<decimal>," so no two layouts encode alike; strings are
// length-prefixed.
void AppendNumber(std::string& key, uint64_t value) { absl::StrAppend(&key, value, ","); }

void AppendString(std::string& key, absl::string_view text) {
  absl::StrAppend(&key, text.size(), ":", text, ",");
}

void AppendKind(std::string& key, const LayerSpec& layer) {
  AppendNumber(key, layer.kind.index());
  std::visit(
      [&key](const auto& kind) {
        using Kind = std::decay_t<decltype(kind)>;
        if constexpr (std::is_same_v<Kind, RotatingKind>) {
          AppendNumber(key, kind.max_size);
          AppendNumber(key, kind.keep);
        } else if constexpr (std::is_same_v<Kind, QuantizedKind>) {
          AppendNumber(key, kind.group_size);
          AppendNumber(key, kind.bits);
        } else if constexpr (std::is_same_v<Kind, ChunkedKind>) {
          AppendNumber(key, kind.chunk_size);
        } else if constexpr (std::is_same_v<Kind, RecurrentKind>) {
          for (uint32_t dim : {kind.conv_tail, kind.conv_dim, kind.num_v_heads, kind.head_v_dim,
                               kind.head_k_dim}) {
            AppendNumber(key, dim);
          }
        }
      },
      layer.kind);
}

}  // namespace

std::string ScopeKey(absl::string_view name_space, const CacheSpec& spec) {
  std::string key;
  AppendString(key, name_space);
  AppendString(key, spec.model);
  AppendNumber(key, static_cast<uint64_t>(spec.dtype));
  AppendNumber(key, spec.batch_size);
  AppendNumber(key, spec.layers.size());
  for (const LayerSpec& layer : spec.layers) {
    AppendNumber(key, layer.num_kv_heads);
    AppendNumber(key, layer.k_head_dim);
    // 0 means k_head_dim: the same layout either way.
    AppendNumber(key, layer.v_head_dim == 0 ? layer.k_head_dim : layer.v_head_dim);
    AppendKind(key, layer);
  }
  return key;
}

bool RestorableAtAnyLength(const CacheSpec& spec) {
  return std::all_of(spec.layers.begin(), spec.layers.end(), [](const LayerSpec& layer) {
    return std::holds_alternative<StandardKind>(layer.kind) ||
           std::holds_alternative<QuantizedKind>(layer.kind);
  });
}

std::optional<std::string> PrefixIndex::Publish(const std::string& scope, bool any_length,
                                                absl::Span<const uint32_t> tokens,
                                                const std::string& snapshot_id, std::string model) {
  if (tokens.empty()) return std::nullopt;  // the engine refuses an empty prefix first
  absl::MutexLock lock(&mu_);
  if (auto old = entries_.find(snapshot_id); old != entries_.end()) ForgetLocked(old);
  auto [place, added] = scopes_.try_emplace(scope);
  if (added) place->second.any_length = any_length;
  std::optional<std::string> replaced = place->second.tree.Insert(tokens, snapshot_id);
  if (replaced.has_value()) {
    entries_.erase(*replaced);  // its blocks are the new entry's now
  } else if (blocks_ != nullptr && place->second.any_length) {
    blocks_->Add(tokens);
  }
  auto entry = std::make_unique<Entry>();
  entry->scope = scope;
  entry->model = std::move(model);
  entry->tokens.assign(tokens.begin(), tokens.end());
  entries_[snapshot_id] = std::move(entry);
  return replaced;
}

std::optional<PrefixFound> PrefixIndex::FindLocked(const std::string& scope,
                                                   absl::Span<const uint32_t> tokens,
                                                   const Entry** entry) const {
  auto place = scopes_.find(scope);
  if (place == scopes_.end()) return std::nullopt;
  const auto match = place->second.tree.Lookup(tokens, /*exact=*/!place->second.any_length);
  if (!match.value.has_value()) return std::nullopt;
  const Entry& found = *entries_.at(*match.value);
  if (entry != nullptr) *entry = &found;
  return PrefixFound{.snapshot_id = *match.value,
                     .matched_tokens = match.matched_tokens,
                     .entry_tokens = found.tokens.size()};
}

std::optional<PrefixFound> PrefixIndex::Find(const std::string& scope,
                                             absl::Span<const uint32_t> tokens) const {
  absl::ReaderMutexLock lock(&mu_);
  return FindLocked(scope, tokens, nullptr);
}

std::optional<PrefixFound> PrefixIndex::Lookup(const std::string& scope,
                                               absl::Span<const uint32_t> tokens) const {
  lookups_.fetch_add(1, std::memory_order_relaxed);
  absl::ReaderMutexLock lock(&mu_);
  const Entry* entry = nullptr;
  std::optional<PrefixFound> found = FindLocked(scope, tokens, &entry);
  if (!found.has_value()) return std::nullopt;
  hits_.fetch_add(1, std::memory_order_relaxed);
  matched_tokens_.fetch_add(found->matched_tokens, std::memory_order_relaxed);
  entry->hits.fetch_add(1, std::memory_order_relaxed);
  return found;
}

bool PrefixIndex::Forget(const std::string& snapshot_id) {
  absl::MutexLock lock(&mu_);
  auto entry = entries_.find(snapshot_id);
  if (entry == entries_.end()) return false;
  ForgetLocked(entry);
  return true;
}

void PrefixIndex::ForgetAny(absl::Span<const std::string> snapshot_ids) {
  {
    absl::ReaderMutexLock lock(&mu_);
    if (std::none_of(snapshot_ids.begin(), snapshot_ids.end(),
                     [this](const std::string& id)
                         ABSL_NO_THREAD_SAFETY_ANALYSIS { return entries_.contains(id); })) {
      return;
    }
  }
  absl::MutexLock lock(&mu_);
  for (const std::string& id : snapshot_ids) {
    if (auto entry = entries_.find(id); entry != entries_.end()) ForgetLocked(entry);
  }
}

void PrefixIndex::ForgetLocked(
    absl::flat_hash_map<std::string, std::unique_ptr<Entry>>::iterator entry) {
  auto place = scopes_.find(entry->second->scope);
  if (blocks_ != nullptr && place->second.any_length) blocks_->Remove(entry->second->tokens);
  place->second.tree.Erase(entry->second->tokens, entry->first);
  if (place->second.tree.values() == 0) scopes_.erase(place);
  entries_.erase(entry);
}

void PrefixIndex::CountBlocksIn(PrefixBlocks* blocks) {
  absl::MutexLock lock(&mu_);
  blocks_ = blocks;
}

PrefixStats PrefixIndex::Stats() const {
  PrefixStats stats{.lookups = lookups_.load(std::memory_order_relaxed),
                    .hits = hits_.load(std::memory_order_relaxed),
                    .matched_tokens = matched_tokens_.load(std::memory_order_relaxed)};
  absl::ReaderMutexLock lock(&mu_);
  stats.entries = entries_.size();
  for (const auto& [key, scope] : scopes_) stats.stored_tokens += scope.tree.stored_tokens();
  return stats;
}

std::vector<PrefixEntryInfo> PrefixIndex::List() const {
  std::vector<PrefixEntryInfo> infos;
  {
    absl::ReaderMutexLock lock(&mu_);
    infos.reserve(entries_.size());
    for (const auto& [id, entry] : entries_) {
      infos.push_back({.snapshot_id = id,
                       .model = entry->model,
                       .tokens = entry->tokens.size(),
                       .hits = entry->hits.load(std::memory_order_relaxed),
                       .extended = scopes_.at(entry->scope).tree.Extended(entry->tokens)});
    }
  }
  std::sort(infos.begin(), infos.end(), [](const PrefixEntryInfo& a, const PrefixEntryInfo& b) {
    return a.snapshot_id < b.snapshot_id;
  });
  return infos;
}

}  // namespace kvcache::engine
