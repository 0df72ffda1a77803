#include "engine/prefix/prefix_blocks.h"

#include <xxhash.h>

#include <algorithm>
#include <utility>

#include "engine/layers/host_bytes.h"

namespace kvcache::engine {

std::vector<uint64_t> PrefixBlocks::Hashes(absl::Span<const uint32_t> tokens) const {
  const size_t count = tokens.size() / block_tokens_;
  std::vector<uint64_t> hashes;
  hashes.reserve(count);
  uint64_t chain = 0;
  for (size_t block = 0; block < count; ++block) {
    chain = XXH3_64bits_withSeed(tokens.data() + block * block_tokens_,
                                 block_tokens_ * sizeof(uint32_t), chain);
    hashes.push_back(chain);
  }
  return hashes;
}

namespace {
// Slots a map of a few blocks may keep however few it holds.
constexpr size_t kSlotsKeptAlways = 63;
}  // namespace

uint64_t PrefixBlocks::MaxBytesPerBlock() const {
  return HeapBlockBytes(uint64_t{block_tokens_} * sizeof(uint32_t)) +
         3 * sizeof(std::pair<const uint64_t, Block>);
}

void PrefixBlocks::Add(absl::Span<const uint32_t> tokens) {
  const std::vector<uint64_t> hashes = Hashes(tokens);
  absl::MutexLock lock(&mu_);
  size_t first_new = hashes.size();
  for (size_t position = 0; position < hashes.size(); ++position) {
    Block& block = blocks_[hashes[position]];
    if (block.holders++ > 0) continue;
    first_new = std::min(first_new, position);
    block.position = position;
    if (position > 0) block.parent = hashes[position - 1];
    const auto start = tokens.begin() + position * block_tokens_;
    block.tokens.assign(start, start + block_tokens_);
  }
  if (first_new == hashes.size()) return;
  BlockEvent stored{.kind = BlockEvent::Kind::kStored,
                    .block_hashes = {hashes.begin() + first_new, hashes.end()},
                    .parent_block_hash = blocks_.at(hashes[first_new]).parent};
  stored.token_ids.assign(tokens.begin() + first_new * block_tokens_,
                          tokens.begin() + hashes.size() * block_tokens_);
  sink_->Emit(std::move(stored));
}

void PrefixBlocks::Remove(absl::Span<const uint32_t> tokens) {
  const std::vector<uint64_t> hashes = Hashes(tokens);
  BlockEvent removed{.kind = BlockEvent::Kind::kRemoved};
  absl::MutexLock lock(&mu_);
  for (uint64_t hash : hashes) {
    auto block = blocks_.find(hash);
    if (block == blocks_.end()) continue;  // never added: the caller's bug, not ours to crash on
    if (--block->second.holders == 0) {
      blocks_.erase(block);
      removed.block_hashes.push_back(hash);
    }
  }
  // A flat_hash_map never shrinks by itself. Rehashed to fit once under a
  // third full, it does so again only after a fifth or more of its blocks
  // go: the rehash's cost is spread over those removals.
  if (blocks_.capacity() > kSlotsKeptAlways && blocks_.size() * 3 < blocks_.capacity()) {
    blocks_.rehash(0);
  }
  if (!removed.block_hashes.empty()) sink_->Emit(std::move(removed));
}

size_t PrefixBlocks::slots() const {
  absl::MutexLock lock(&mu_);
  return blocks_.capacity();
}

void PrefixBlocks::Held(const std::function<void(std::vector<BlockEvent>)>& under_lock) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<uint64_t, const Block*>> held;
  held.reserve(blocks_.size());
  for (const auto& [hash, block] : blocks_) held.emplace_back(hash, &block);
  std::sort(held.begin(), held.end(),
            [](const auto& a, const auto& b) { return a.second->position < b.second->position; });
  std::vector<BlockEvent> events;
  events.reserve(held.size());
  for (const auto& [hash, block] : held) {
    events.push_back({.kind = BlockEvent::Kind::kStored,
                      .block_hashes = {hash},
                      .parent_block_hash = block->parent,
                      .token_ids = block->tokens});
  }
  under_lock(std::move(events));
}

size_t PrefixBlocks::blocks() const {
  absl::MutexLock lock(&mu_);
  return blocks_.size();
}

}  // namespace kvcache::engine
