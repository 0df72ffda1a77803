#include "engine/prefix_blocks.h"

#include <xxhash.h>

namespace kvcache::engine {

std::vector<uint64_t> PrefixBlocks::Hashes(const std::string& scope,
                                           absl::Span<const uint32_t> tokens) const {
  const size_t count = tokens.size() / block_tokens_;
  std::vector<uint64_t> hashes;
  hashes.reserve(count);
  uint64_t chain =
      XXH3_64bits_withSeed(scope.data(), scope.size(), XXH3_64bits(salt_.data(), salt_.size()));
  for (size_t block = 0; block < count; ++block) {
    chain = XXH3_64bits_withSeed(tokens.data() + block * block_tokens_,
                                 block_tokens_ * sizeof(uint32_t), chain);
    hashes.push_back(chain);
  }
  return hashes;
}

std::optional<BlockEvent> PrefixBlocks::Add(const std::string& scope,
                                            absl::Span<const uint32_t> tokens) {
  const std::vector<uint64_t> hashes = Hashes(scope, tokens);
  size_t first_new = hashes.size();
  for (size_t block = hashes.size(); block-- > 0;) {
    if (++holders_[hashes[block]] == 1) first_new = block;
  }
  if (first_new == hashes.size()) return std::nullopt;
  BlockEvent stored{.kind = BlockEvent::Kind::kStored,
                    .block_hashes = {hashes.begin() + first_new, hashes.end()}};
  if (first_new > 0) stored.parent_block_hash = hashes[first_new - 1];
  stored.token_ids.assign(tokens.begin() + first_new * block_tokens_,
                          tokens.begin() + hashes.size() * block_tokens_);
  return stored;
}

std::optional<BlockEvent> PrefixBlocks::Remove(const std::string& scope,
                                               absl::Span<const uint32_t> tokens) {
  BlockEvent removed{.kind = BlockEvent::Kind::kRemoved};
  for (uint64_t hash : Hashes(scope, tokens)) {
    auto holder = holders_.find(hash);
    if (holder == holders_.end()) continue;  // never added: the caller's bug, not ours to crash on
    if (--holder->second == 0) {
      holders_.erase(holder);
      removed.block_hashes.push_back(hash);
    }
  }
  if (removed.block_hashes.empty()) return std::nullopt;
  return removed;
}

}  // namespace kvcache::engine
