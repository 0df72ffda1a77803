// The published prefixes in vLLM's block terms, for routers that index KV
// caches from KV events (vLLM's BlockStored, BlockRemoved, AllBlocksCleared:
// NVIDIA Dynamo, llm-d, Mooncake's Conductor).
//
// A prefix entry of n tokens holds n / block_tokens full blocks; a trailing
// partial block is not announced (vLLM announces full blocks only). Block i's
// hash chains the block's token ids onto block i-1's, and block 0's onto a
// hash of the salt (the tenant: each has an engine of its own) and the scope
// (model and layout), so equal tokens of two tenants or layouts never share a
// hash, as vLLM's cache_salt keeps them apart, and a hash reveals neither.
//
// Entries that extend each other share their leading blocks, so a block is
// counted: stored when the first entry holding it is published, removed when
// the last one goes. Blocks that are new to one entry are always its tail
// (a block's hash covers every block before it), so each publish or forget
// is one event.
//
// Not thread-safe: the prefix index's lock guards it.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace kvcache::engine {

struct BlockEvent {
  enum class Kind { kStored, kRemoved, kAllCleared };
  Kind kind = Kind::kStored;
  std::vector<uint64_t> block_hashes;
  // Stored only: the block before the first one (none: they start the prefix)
  // and the token ids of every block, block_tokens each.
  std::optional<uint64_t> parent_block_hash;
  std::vector<uint32_t> token_ids;
};

// Where prefix indexes send their events (several: one per tenant's engine).
class BlockEventSink {
 public:
  // Calls its argument, under the source's lock, with Stored events for every
  // block the source holds now (PrefixIndex::ReplayBlocks).
  using Replay =
      std::function<void(const std::function<void(std::vector<BlockEvent>)>& under_lock)>;

  virtual ~BlockEventSink() = default;
  // `source` sends from now until Detach; `replay` is valid until then.
  virtual void Attach(const void* source, Replay replay) = 0;
  virtual void Detach(const void* source) = 0;
  // Called with the source's lock held, in the order the source changed, so
  // it must queue and never block or call back into the source.
  virtual void Emit(const void* source, std::vector<BlockEvent> events) = 0;
};

class PrefixBlocks {
 public:
  PrefixBlocks(uint32_t block_tokens, std::string salt)
      : block_tokens_(block_tokens), salt_(std::move(salt)) {}

  uint32_t block_tokens() const { return block_tokens_; }
  const std::string& salt() const { return salt_; }
  // The blocks of `tokens` that no entry held before, as one Stored event
  // (none when every full block was held).
  std::optional<BlockEvent> Add(const std::string& scope, absl::Span<const uint32_t> tokens);
  // The blocks of `tokens` that no entry holds now, as one Removed event.
  std::optional<BlockEvent> Remove(const std::string& scope, absl::Span<const uint32_t> tokens);
  size_t blocks() const { return holders_.size(); }

  // Block i's hash for `tokens` in `scope`, for i < tokens.size() / block_tokens.
  std::vector<uint64_t> Hashes(const std::string& scope, absl::Span<const uint32_t> tokens) const;

 private:
  uint32_t block_tokens_;
  std::string salt_;
  absl::flat_hash_map<uint64_t, uint64_t> holders_;  // block hash -> entries holding it
};

}  // namespace kvcache::engine
