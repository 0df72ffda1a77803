// The random driver's adapter for a whole server driven through the client
// library (kvcache::Client): over gRPC, or with Update and Fetch on the data
// lane when the client was made so. Each DriverAdapter call is the RPC of the
// same name, its answer translated into the driver's neutral terms.
#pragma once

#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "driver_adapter.h"
#include "kvcache_client.h"
#include "sharded_client.h"

namespace kvcache::testing {

// The driver's view of a CacheInfo over the wire.
CacheState StateOf(const v1::CacheInfo& info);
// `part` as the client sends it (its tensors stay in `part`).
LayerUpdate UpdateOf(const engine::CacheSpec& spec, const StepPart& part);

class WireAdapter : public DriverAdapter {
 public:
  explicit WireAdapter(Client& client) : client_(&client) {}
  // Over a fleet: CreateCache places the cache as the fleet does, and every
  // call after it goes to the replica its id names (ShardedClient::Owner).
  // Its caches are placed by a key of its own, so a cache it deletes and
  // creates again lands on the same replica (as a worker's session would).
  explicit WireAdapter(ShardedClient& fleet);

  // The client of the driver's cache (over a fleet: once CreateCache placed it).
  Client& client() { return *client_; }
  // The client that `id` goes to: the replica it names, over a fleet.
  Client& For(absl::string_view id);

  absl::StatusOr<CacheState> CreateCache(const engine::CacheSpec& spec) override;
  absl::StatusOr<CacheState> CreateCacheLike(const std::string& cache_id) override;
  absl::StatusOr<CacheState> GetCache(const std::string& cache_id) override;
  absl::Status DeleteCache(const std::string& cache_id) override;
  // One Update call, or an UpdateStream written part by part and finished
  // (it stops writing once the server has ended the stream).
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
  // FetchLayer of its layer 0.
  absl::Status ReadSnapshot(const std::string& snapshot_id) override;
  absl::StatusOr<std::vector<SnapshotState>> ListSnapshots(const std::string& cache_id) override;
  absl::StatusOr<CacheState> ExtractRow(const std::string& cache_id, uint32_t row) override;
  absl::StatusOr<CacheState> FilterRows(const std::string& cache_id,
                                        absl::Span<const uint32_t> keep) override;
  absl::StatusOr<CacheState> MergeCaches(absl::Span<const std::string> cache_ids) override;
  absl::StatusOr<CacheState> ExtendCache(const std::string& cache_id,
                                         const std::string& other_id) override;
  // CacheMatchesReference (e2e_test_util.h): quantized layers dequantized and
  // packed, recurrent layers by FetchState.
  ::testing::AssertionResult CacheMatches(const std::string& cache_id,
                                          const RefCache& reference) override;
  // GetStats' pages_used.
  absl::StatusOr<uint64_t> PagesInUse() override;
  // The answer carries the speculation_id and the committed offset only.
  absl::StatusOr<SpeculationState> BeginSpeculation(const std::string& cache_id,
                                                    bool isolated) override;
  absl::StatusOr<CacheState> CommitSpeculation(const std::string& speculation_id,
                                               uint64_t accepted) override;
  absl::StatusOr<CacheState> AbortSpeculation(const std::string& speculation_id) override;
  // A Fetch with speculation_id (and the other ids where set).
  absl::Status ReadSpeculation(const std::string& speculation_id, const std::string& cache_id,
                               const std::string& snapshot_id) override;
  // The client's FetchSpeculation (or a Fetch naming the cache too); a
  // quantized layer also packed; a recurrent layer's one state chunk at its
  // offset in the view.
  ::testing::AssertionResult SpeculationMatches(const std::string& speculation_id,
                                                const std::string& cache_id, uint32_t layer,
                                                const RefSpeculation& reference) override;

 private:
  Client* client_ = nullptr;
  ShardedClient* fleet_ = nullptr;
  std::string placement_key_;
};

}  // namespace kvcache::testing
