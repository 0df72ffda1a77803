// The CPU reference of a speculation, written from the contract's rules
// (engine/speculation/speculation.h) and ollama's speculativeKVCache / isolatedKVCache /
// speculativeRotatingKVCache (shared/reference/000), not from the engine's
// code. It works on RefLayer clones, so it holds for every reference kind:
//
//   view        an attention layer: the committed layer after one Update of
//               every drafted token (ollama: the committed history + the
//               drafted K/V; for a rotating layer its last max_size - 1 tokens
//               + the drafted ones, which is what mlx-lm's multi-token update
//               keeps). A recurrent layer: its last drafted state (the
//               committed one before any) at committed + drafted.
//   Commit(n)   INVALID_ARGUMENT when n exceeds the largest count any layer
//               drafted; else FAILED_PRECONDITION when the layers have drafted
//               different counts, or when n > 0 and a recurrent layer drafted no
//               state reaching exactly committed + n. Else, unless isolated,
//               each attention layer takes Update(its first n drafted tokens)
//               (n > 0) and each recurrent layer that state, at committed + n.
//   Abort       nothing changes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "reference_model.h"

namespace kvcache::testing {

class RefSpeculation {
 public:
  // Begins on `live` (whose layers must be in step).
  RefSpeculation(const RefCache& live, bool isolated);

  const engine::CacheSpec& spec() const { return spec_; }  // the live cache's
  bool isolated() const { return isolated_; }
  uint64_t committed() const { return committed_; }
  // Per layer: committed + drafted.
  std::vector<uint64_t> layer_offsets() const;
  // Drafted tokens of an attention layer (positions are assigned by the view).
  void Update(size_t layer, std::vector<RefToken> tokens);
  // A drafted state of a recurrent layer that consumed `advance` tokens.
  void UpdateState(size_t layer, RefState state, uint64_t advance);
  // The first `n` tokens drafted on attention layer `layer`, as given.
  std::vector<RefToken> DraftedTokens(size_t layer, uint64_t n) const;
  // The speculative view of an attention layer, in temporal order.
  std::vector<RefToken> Fetch(size_t layer) const;
  // The speculative view of a recurrent layer (nullopt: no state yet).
  std::optional<RefState> FetchState(size_t layer) const;
  // The status code the commit must have; when OK it is applied to `live`
  // (the cache it began on), unless isolated.
  absl::StatusCode Commit(uint64_t accepted, RefCache& live) const;

 private:
  struct DraftedState {
    uint64_t offset;  // committed + the advances so far
    RefState state;
  };
  struct LayerDraft {
    std::unique_ptr<RefLayer> base;       // the committed layer
    std::vector<RefToken> tokens;         // attention: drafted, in order
    std::vector<DraftedState> states;     // recurrent
    uint64_t drafted = 0;
  };
  // The state a recurrent layer drafted reaching `offset`, or null.
  const RefState* StateAt(const LayerDraft& draft, uint64_t offset) const;

  engine::CacheSpec spec_;
  bool isolated_;
  uint64_t committed_;
  std::vector<bool> recurrent_;
  std::vector<LayerDraft> layers_;
};

}  // namespace kvcache::testing
