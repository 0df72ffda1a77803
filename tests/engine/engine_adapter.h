// The random driver's adapter for the engine called directly (no server):
// each DriverAdapter call is the Engine call of the same name, its answer
// translated into the driver's neutral terms.
#pragma once

#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "driver_adapter.h"
#include "engine/engine.h"

namespace kvcache::testing {

// The driver's view of an engine CacheInfo.
CacheState StateOf(const engine::CacheInfo& info);

class EngineAdapter : public DriverAdapter {
 public:
  explicit EngineAdapter(engine::Engine& engine) : engine_(engine) {}

  engine::Engine& engine() { return engine_; }

  absl::StatusOr<CacheState> CreateCache(const engine::CacheSpec& spec) override;
  absl::StatusOr<CacheState> CreateCacheLike(const std::string& cache_id) override;
  absl::StatusOr<CacheState> GetCache(const std::string& cache_id) override;
  absl::Status DeleteCache(const std::string& cache_id) override;
  // Each part is one Update, UpdateState, UpdateSpeculation or
  // UpdateSpeculationState call; the engine has one form of a stream.
  StreamResult SendUpdates(const std::string& cache_id, const engine::CacheSpec& spec,
                           const std::deque<StepPart>& parts, bool one_call) override;
  absl::StatusOr<TrimResult> Trim(const std::string& cache_id, uint64_t n) override;
  absl::StatusOr<SnapshotState> Snapshot(const std::string& cache_id, uint64_t from,
                                         bool pinned) override;
  absl::StatusOr<CacheState> Restore(const std::string& cache_id, const std::string& snapshot_id,
                                     uint64_t target) override;
  absl::StatusOr<SnapshotState> MergeSnapshots(const std::string& parent_id,
                                               const std::string& child_id) override;
  absl::StatusOr<std::pair<SnapshotState, SnapshotState>> SplitSnapshot(
      const std::string& snapshot_id, uint64_t at) override;
  absl::Status ReleaseSnapshot(const std::string& snapshot_id) override;
  absl::Status ReadSnapshot(const std::string& snapshot_id) override;
  absl::StatusOr<std::vector<SnapshotState>> ListSnapshots(const std::string& cache_id) override;
  absl::StatusOr<CacheState> ExtractRow(const std::string& cache_id, uint32_t row) override;
  absl::StatusOr<CacheState> FilterRows(const std::string& cache_id,
                                        absl::Span<const uint32_t> keep) override;
  absl::StatusOr<CacheState> MergeCaches(absl::Span<const std::string> cache_ids) override;
  absl::StatusOr<CacheState> ExtendCache(const std::string& cache_id,
                                         const std::string& other_id) override;
  // The engine's CacheInfo (rows, padding without all-zero, offsets), then
  // every layer of a view read back in its stored form.
  ::testing::AssertionResult CacheMatches(const std::string& cache_id,
                                          const RefCache& reference) override;
  absl::StatusOr<uint64_t> PagesInUse() override;
  absl::StatusOr<SpeculationState> BeginSpeculation(const std::string& cache_id,
                                                    bool isolated) override;
  absl::StatusOr<CacheState> CommitSpeculation(const std::string& speculation_id,
                                               uint64_t accepted) override;
  absl::StatusOr<CacheState> AbortSpeculation(const std::string& speculation_id) override;
  // Freeze of the speculation; without a snapshot_id also GetSpeculation,
  // which must answer the same code.
  absl::Status ReadSpeculation(const std::string& speculation_id, const std::string& cache_id,
                               const std::string& snapshot_id) override;
  // GetSpeculation's offsets and isolation, the view's end, and the layer
  // read back whole in its stored form.
  ::testing::AssertionResult SpeculationMatches(const std::string& speculation_id,
                                                const std::string& cache_id, uint32_t layer,
                                                const RefSpeculation& reference) override;

 private:
  // One part as its engine call.
  absl::StatusOr<uint64_t> Send(const std::string& cache_id, const StepPart& part);

  engine::Engine& engine_;
};

}  // namespace kvcache::testing
