// Drives an Engine and the CPU reference (reference_model.h) in lock step
// through a seeded random sequence of operations, asserting after each that
// both agree: success or refusal (and the status code), offsets, snapshot
// ranges, and byte-identical fetches of the live cache and of snapshots.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "reference_model.h"

namespace kvcache::testing {

struct RandomConfig {
  std::string name;
  engine::CacheSpec spec;
  uint32_t page_tokens = 16;
  uint64_t operations = 10000;
  uint64_t seed = 1;
};

// Counts of what a run did, so a test can check that it exercised each path.
struct RandomRunStats {
  uint64_t operations = 0;
  uint64_t updates = 0;
  uint64_t fetches = 0;
  uint64_t restores_ok = 0;
  uint64_t restores_refused = 0;
  uint64_t merges_ok = 0;
  uint64_t splits_ok = 0;
  uint64_t refusals = 0;
};

class RandomDriver {
 public:
  RandomDriver(engine::Engine& engine, const RandomConfig& config);

  // Runs config.operations operations; stops at the first failed assertion.
  void Run();
  // Compares everything one last time, then releases all snapshots and the cache.
  void Finish();
  const RandomRunStats& stats() const { return stats_; }

 private:
  struct TrackedSnapshot {
    std::string id;
    RefCacheSnapshotPtr reference;
  };
  enum class Op {
    kUpdate, kFetch, kTrim, kSnapshot, kRestore, kRewind,
    kMerge, kSplit, kRelease, kFetchSnapshot, kRecreate,
  };

  Op PickOp();
  void Step(Op op);
  void CreateCache();
  void Recreate();
  void Update();
  void UpdateLayer(uint32_t layer, uint64_t tokens);
  void Fetch();
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

  void CheckOffsets();
  void CheckLayer(const engine::CacheSnapshot& view, uint32_t layer,
                  const std::vector<RefToken>& expected);
  void CheckReferenceShape(uint32_t layer, const std::vector<RefToken>& tokens);
  void CheckSnapshotInfo(const engine::SnapshotInfo& info, const RefCacheSnapshot& reference);
  void CheckAllSnapshots();

  uint64_t Offset() const;
  uint64_t Uniform(uint64_t low, uint64_t high);  // inclusive
  bool Chance(double p);
  engine::TokenRange RandomWindow(uint64_t end);
  uint64_t MaxUpdateTokens() const;
  size_t RandomSnapshotIndex();
  void Forget(const std::string& id);

  engine::Engine& engine_;
  const RandomConfig config_;
  std::mt19937_64 rng_;
  std::string cache_id_;
  std::unique_ptr<RefCache> reference_;
  std::vector<TrackedSnapshot> snapshots_;
  RandomRunStats stats_;
  bool has_standard_layer_ = false;
};

}  // namespace kvcache::testing
