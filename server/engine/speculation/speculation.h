// A speculative-decoding transaction on one cache (ollama BeginSpeculation /
// Speculation.Commit(n), shared/reference/000): a draft model or multi-token
// prediction proposes k tokens, the target model's forward writes their K/V
// (and recurrent states) here, and only the prefix it accepts is kept:
//
//   Begin        the cache's layers must be in step; its offset C is the
//                committed history.
//   Update       drafted tokens, per layer (engine/layers/layer_draft.h has how each
//                kind holds them); the speculative state is committed +
//                drafted.
//   Freeze       that state, for Fetch: a CacheSnapshot, as the live
//                cache's is.
//   Commit(n)    n must not exceed the most tokens any layer drafted
//                (checked first); the drafted layers must be in step (each
//                has drafted d, so n <= d); every layer must be able to keep n
//                (a recurrent layer needs a state recorded at C + n). Then
//                every layer keeps n at once: each attention layer is left as
//                one live Update of its first n drafted tokens would leave it.
//                Isolated: nothing is applied (the live cache never changes),
//                the checks are the same.
//   Abort        destroying the Speculation: every drafted token is dropped.
//
// While it exists the live cache's layers must not change (the engine refuses
// live updates, trims, restores and batch operations on the cache); snapshots
// of the live cache, registered or frozen, see the committed history only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/layers/cache.h"
#include "engine/layers/layer_draft.h"

namespace kvcache::engine {

class Speculation {
 public:
  // FAILED_PRECONDITION (naming cache_id) when `cache`'s layers are out of
  // step. `cache` must outlive the Speculation.
  static absl::StatusOr<std::unique_ptr<Speculation>> Begin(Cache& cache, std::string id,
                                                             bool isolated);

  const std::string& id() const { return id_; }
  bool isolated() const { return isolated_; }
  // The live cache's offset when it began (and still, until a commit).
  uint64_t committed() const { return committed_; }
  size_t num_layers() const { return drafts_.size(); }
  // committed() + the tokens drafted on `layer`.
  uint64_t layer_offset(size_t layer) const { return committed_ + drafts_[layer]->drafted(); }
  std::vector<uint64_t> layer_offsets() const;

  // Drafts tokens (or a recurrent state) on `layer`, which must be in range.
  // INVALID_ARGUMENT as the live Update / UpdateState; a refusal changes nothing.
  absl::Status Update(uint32_t layer, const KvInput& kv);
  absl::Status UpdateState(uint32_t layer, const StateInput& state);
  // Every layer, committed + drafted, for reading without the lock.
  absl::StatusOr<CacheSnapshotPtr> Freeze(const std::string& cache_id) const;
  // Checks, then keeps the first `accepted` drafted tokens in the live cache
  // (isolated: nothing). The checks, in this order: INVALID_ARGUMENT naming
  // accepted when it exceeds the most tokens any layer drafted;
  // FAILED_PRECONDITION when the drafted layers are out of step; then
  // FAILED_PRECONDITION (naming the layer) when a layer cannot keep
  // `accepted`. On error nothing changes and the speculation stays open; on
  // success the caller destroys it.
  absl::Status Commit(uint64_t accepted);

 private:
  Speculation(const Cache& cache, std::string id, bool isolated, uint64_t committed)
      : cache_(cache), id_(std::move(id)), isolated_(isolated), committed_(committed) {}
  // FAILED_PRECONDITION naming the first layer out of step, else the drafted count.
  absl::StatusOr<uint64_t> CommonDrafted() const;

  const Cache& cache_;
  const std::string id_;
  const bool isolated_;
  const uint64_t committed_;
  std::vector<std::unique_ptr<LayerDraft>> drafts_;  // one per layer
};

}  // namespace kvcache::engine
