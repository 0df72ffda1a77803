// Drives a kvcached over the wire (kvcache::Client) and the CPU reference
// (tests/engine/reference_model.h) in lock step through a seeded random
// sequence, asserting after each operation that both agree: status codes (OK
// or FAILED_PRECONDITION), acknowledgements, offsets, snapshot ranges, and
// fetched ranges and bytes of the live cache and of snapshots.
//
// Unlike the engine's RandomDriver it also exercises what only the wire has:
// whole steps in one Update stream, streams that fail part way (a wrong
// expected_offset) and leave the cache out of step, windowed and chunked
// Fetch streams, and ListSnapshots. Several drivers may share one server (each
// on its own cache), one per thread.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine/cache_spec.h"
#include "engine_test_util.h"
#include "kvcache_client.h"
#include "reference_model.h"

namespace kvcache::testing {

struct WireConfig {
  std::string name;
  engine::CacheSpec spec;
  uint64_t operations = 2000;
  uint64_t seed = 1;
};

// What a run did, so a test can check that each path was taken.
struct WireRunStats {
  uint64_t operations = 0;
  uint64_t steps = 0;
  uint64_t failed_streams = 0;
  uint64_t torn_steps = 0;
  uint64_t fetches = 0;
  uint64_t snapshot_fetches = 0;
  uint64_t restores_ok = 0;
  uint64_t restores_refused = 0;
  uint64_t merges_ok = 0;
  uint64_t splits_ok = 0;
  uint64_t refusals = 0;
};

class WireDriver {
 public:
  WireDriver(Client& client, const WireConfig& config);

  // Runs config.operations operations; stops at the first failed assertion.
  void Run();
  // Compares everything once more, then releases its snapshots and deletes its cache.
  void Finish();
  const WireRunStats& stats() const { return stats_; }

 private:
  struct TrackedSnapshot {
    std::string id;
    RefCacheSnapshotPtr reference;
    bool pinned = false;
  };
  enum class Op {
    kStep,
    kStreamSteps,
    kTornStep,
    kFetch,
    kFetchWindow,
    kTrim,
    kSnapshot,
    kRestore,
    kRewind,
    kMerge,
    kSplit,
    kRelease,
    kFetchSnapshot,
    kRecreate,
  };

  Op PickOp();
  void Step(Op op);
  void CreateCache();
  void Recreate();
  bool KeepStandardLayersSmall(uint64_t tokens);
  void UpdateStep();
  void StreamSteps();
  void TornStep();
  void ProbeOutOfStep();
  void Repair();
  void FinishStep();
  void FetchLive();
  void FetchWindow();
  void Trim();
  void TakeSnapshot();
  void Restore();
  void Rewind();
  void CompareRestore(const std::string& snapshot_id, const RefCacheSnapshot* reference,
                      uint64_t target);
  void Merge();
  void Split();
  void Release();
  void FetchSnapshot();

  // Sends `updates` in one stream; the reference applies the first `applied`.
  void SendStream(const std::vector<LayerUpdate>& updates, const std::vector<KvTensors>& data,
                  size_t applied);
  void ApplyToReference(uint32_t layer, const KvTensors& kv);
  void CheckFetchedChunks(const v1::FetchRequest& request, const std::vector<uint32_t>& layers,
                          const std::vector<v1::FetchResponse>& chunks,
                          const RefCacheSnapshot* snapshot);
  void CheckSnapshotInfo(const v1::SnapshotInfo& info, const RefCacheSnapshot& reference,
                         bool pinned);
  void CheckOffsets();
  void CheckSnapshotList();
  void CheckEverything();

  std::vector<RefToken> Expected(uint32_t layer, const RefCacheSnapshot* snapshot) const;
  uint64_t Offset() const;
  uint64_t Uniform(uint64_t low, uint64_t high);  // inclusive
  bool Chance(double p);
  uint64_t MaxUpdateTokens() const;
  size_t RandomSnapshotIndex();
  void Forget(const std::string& id);

  Client& client_;
  const WireConfig config_;
  std::mt19937_64 rng_;
  std::string cache_id_;
  std::set<std::string> cache_ids_;  // every cache this driver created (snapshots outlive them)
  std::unique_ptr<RefCache> reference_;
  std::vector<TrackedSnapshot> snapshots_;
  WireRunStats stats_;
  bool has_standard_layer_ = false;
};

}  // namespace kvcache::testing
