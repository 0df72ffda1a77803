// What the random driver (driver_core.h) asks of the thing it drives, in
// transport-neutral terms: the engine called directly (engine_adapter.h), or a
// whole server through the client library over gRPC or the data lane
// (tests/e2e/wire_adapter.h). Each call answers what the engine or the
// wire answers; the driver compares it with the reference model.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/layers/cache_spec.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "reference_model.h"
#include "reference_recurrent.h"
#include "reference_speculation.h"

namespace kvcache::testing {

// A cache as GetCache (or a call that returns a cache) describes it.
struct CacheState {
  std::string cache_id;
  uint32_t num_layers = 0;
  uint32_t batch_size = 0;
  std::vector<uint32_t> left_padding;  // empty: none
  std::vector<uint64_t> layer_offsets;
  uint64_t offset = 0;  // the lowest layer's
  bool in_step = true;
  uint64_t size_bytes = 0;
};

struct SnapshotState {
  std::string snapshot_id;
  std::string cache_id;
  uint64_t from = 0;
  uint64_t to = 0;
  bool pinned = false;
};

struct TrimResult {
  uint64_t trimmed = 0;
  // The cache after the trim, where the answer carries it.
  std::optional<std::vector<uint64_t>> layer_offsets;
};

// One layer's update: tokens for an attention layer, a state advancing by
// `advance` for a recurrent one. With `wrong_kind` it is sent as the other
// kind (keys and values to a recurrent layer, a state alone to an attention
// layer), which is refused. With `live` it is a live update amid a
// speculation's drafts (no speculation_id), refused while that is open.
// With `wrong_size_field` its state has the wrong size there ("state.conv_state"
// or "state.delta_state"), which is refused naming it.
struct StepPart {
  uint32_t layer = 0;
  bool recurrent = false;
  bool wrong_kind = false;
  bool live = false;
  std::string wrong_size_field;
  KvTensors kv;
  RefState state;
  uint64_t advance = 0;
  std::optional<uint64_t> expected_offset;
  std::string speculation_id;  // empty: a live update
};

// A speculation as BeginSpeculation describes it.
struct SpeculationState {
  std::string speculation_id;
  uint64_t committed_offset = 0;
  // Where the answer carries them (the engine's does, the wire's not): its
  // cache, and per layer committed + drafted; else empty.
  std::string cache_id;
  std::vector<uint64_t> layer_offsets;
};

// What an update stream answered: how it ended, and the offset each applied
// part left its layer at, in order.
struct StreamResult {
  absl::Status status;
  std::vector<std::pair<uint32_t, uint64_t>> acks;  // (layer, offset)
};

class DriverAdapter {
 public:
  virtual ~DriverAdapter() = default;

  virtual absl::StatusOr<CacheState> CreateCache(const engine::CacheSpec& spec) = 0;
  // An empty cache of `cache_id`'s spec as the server reports it.
  virtual absl::StatusOr<CacheState> CreateCacheLike(const std::string& cache_id) = 0;
  virtual absl::StatusOr<CacheState> GetCache(const std::string& cache_id) = 0;
  virtual absl::Status DeleteCache(const std::string& cache_id) = 0;
  // Sends `parts` in order, as one stream: the first refusal ends it and the
  // parts after it are not applied. `one_call`: as one call rather than
  // written one by one (where the transport tells them apart).
  virtual StreamResult SendUpdates(const std::string& cache_id, const engine::CacheSpec& spec,
                                   const std::deque<StepPart>& parts, bool one_call) = 0;
  virtual absl::StatusOr<TrimResult> Trim(const std::string& cache_id, uint64_t n) = 0;
  virtual absl::StatusOr<SnapshotState> Snapshot(const std::string& cache_id, uint64_t from,
                                                 bool pinned) = 0;
  virtual absl::StatusOr<CacheState> Restore(const std::string& cache_id,
                                             const std::string& snapshot_id, uint64_t target) = 0;
  virtual absl::StatusOr<SnapshotState> MergeSnapshots(const std::string& parent_id,
                                                       const std::string& child_id) = 0;
  virtual absl::StatusOr<std::pair<SnapshotState, SnapshotState>> SplitSnapshot(
      const std::string& snapshot_id, uint64_t at) = 0;
  virtual absl::Status ReleaseSnapshot(const std::string& snapshot_id) = 0;
  // Reads snapshot `snapshot_id` by its id alone: NOT_FOUND once it is gone.
  virtual absl::Status ReadSnapshot(const std::string& snapshot_id) = 0;
  // Every snapshot, or those of `cache_id` when it is not empty.
  virtual absl::StatusOr<std::vector<SnapshotState>> ListSnapshots(
      const std::string& cache_id) = 0;

  virtual absl::StatusOr<CacheState> ExtractRow(const std::string& cache_id, uint32_t row) = 0;
  virtual absl::StatusOr<CacheState> FilterRows(const std::string& cache_id,
                                                absl::Span<const uint32_t> keep) = 0;
  virtual absl::StatusOr<CacheState> MergeCaches(absl::Span<const std::string> cache_ids) = 0;
  virtual absl::StatusOr<CacheState> ExtendCache(const std::string& cache_id,
                                                 const std::string& other_id) = 0;
  // Cache `cache_id` equals `reference`: rows, padding, offsets, and every
  // layer read back in full (recurrent layers: their states).
  virtual ::testing::AssertionResult CacheMatches(const std::string& cache_id,
                                                  const RefCache& reference) = 0;
  // Pages in use in the pool the driven caches draw from.
  virtual absl::StatusOr<uint64_t> PagesInUse() = 0;

  // Speculations. Drafts are SendUpdates parts with speculation_id set; the
  // answers' CacheState is the live cache after the commit or abort.
  virtual absl::StatusOr<SpeculationState> BeginSpeculation(const std::string& cache_id,
                                                            bool isolated) = 0;
  virtual absl::StatusOr<CacheState> CommitSpeculation(const std::string& speculation_id,
                                                       uint64_t accepted) = 0;
  virtual absl::StatusOr<CacheState> AbortSpeculation(const std::string& speculation_id) = 0;
  // Reads speculation `speculation_id`, named beside `cache_id` and
  // `snapshot_id` when they are not empty; only the status matters.
  virtual absl::Status ReadSpeculation(const std::string& speculation_id,
                                       const std::string& cache_id,
                                       const std::string& snapshot_id) = 0;
  // Layer `layer` of speculation `speculation_id` (named beside `cache_id`
  // when that is not empty) equals `reference`'s view: its whole history
  // (quantized layers also in their stored form where the transport has
  // both), or a recurrent layer's state (zeros before any); and what the
  // answer says of the speculation's offsets.
  virtual ::testing::AssertionResult SpeculationMatches(const std::string& speculation_id,
                                                        const std::string& cache_id, uint32_t layer,
                                                        const RefSpeculation& reference) = 0;
};

}  // namespace kvcache::testing
