// The published prefixes in vLLM's block terms, for routers that index KV
// caches from KV events (vLLM's BlockStored, BlockRemoved, AllBlocksCleared:
// NVIDIA Dynamo, llm-d, Mooncake's Conductor).
//
// A prefix entry of n tokens holds n / block_tokens full blocks; a trailing
// partial block is not announced (vLLM announces full blocks only). Block i's
// hash chains the block's token ids onto block i-1's, over the tokens alone:
// a router keys its index by token blocks (Dynamo's radix tree hashes the
// token ids it is sent; the hashes here only name blocks), so one ledger
// serves every prefix index of a replica (each tenant's), and equal prompts
// of two tenants or two layouts are one block, held while any entry holds it.
// A router then sends requests for a prompt here if any tenant cached it;
// lookups stay per tenant (prefix_index.h), so none reads another's.
//
// A block is stored when the first entry holding it is published and removed
// when the last one goes. Blocks new to an entry are always its tail (a
// block's hash covers every block before it), so each publish or forget is
// one event.
//
// Threads: indexes call Add and Remove under their own locks; the ledger's
// lock comes after theirs and is held while the sink takes the event, so the
// sink sees the ledger's own order.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
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

// Where a ledger sends its events. Called with the ledger's lock held, so it
// must queue and never block or call back into the ledger.
class BlockEventSink {
 public:
  virtual ~BlockEventSink() = default;
  virtual void Emit(BlockEvent event) = 0;
};

class PrefixBlocks {
 public:
  PrefixBlocks(uint32_t block_tokens, BlockEventSink* sink)
      : block_tokens_(block_tokens), sink_(sink) {}

  uint32_t block_tokens() const { return block_tokens_; }
  // Counts the blocks of an entry of `tokens` in; those no entry held before
  // go to the sink as one Stored event.
  void Add(absl::Span<const uint32_t> tokens);
  // Counts them out; those no entry holds now go as one Removed event.
  void Remove(absl::Span<const uint32_t> tokens);
  // Calls `under_lock` with a Stored event per held block, parents first,
  // while none can come or go: where a sink that lost events starts again.
  void Held(const std::function<void(std::vector<BlockEvent>)>& under_lock) const;
  size_t blocks() const;
  // The map's slots: never more than three per held block past a few dozen
  // (what MaxBytesPerBlock charges), so churn leaves no memory behind.
  size_t slots() const;
  // The most host memory one held block takes: its token ids on the heap and
  // its map slot (flat_hash_map keeps up to 8/7 slots per entry and doubles:
  // under 2.3 slots at worst, three counted). Entries are charged this per
  // block they hold (metadata_budget.h), shared blocks included.
  uint64_t MaxBytesPerBlock() const;

  // Block i's hash for `tokens`, for i < tokens.size() / block_tokens.
  std::vector<uint64_t> Hashes(absl::Span<const uint32_t> tokens) const;

 private:
  struct Block {
    uint64_t holders = 0;  // entries holding it
    size_t position = 0;   // in its chain: parents have smaller ones
    std::optional<uint64_t> parent;
    std::vector<uint32_t> tokens;
  };

  const uint32_t block_tokens_;
  BlockEventSink* const sink_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Block> blocks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvcache::engine
