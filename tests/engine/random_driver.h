// Drives an Engine and the CPU reference (reference_model.h) in lock step
// through a seeded random sequence of operations, asserting after each that
// both agree: success or refusal (and the status code), offsets, snapshot
// ranges, and byte-identical fetches of the live cache and of snapshots
// (recurrent layers: their states, read through CacheSnapshot::ReadState).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "reference_model.h"
#include "reference_speculation.h"

namespace kvcache::testing {

// How far standard layers may grow before the driver trims or recreates (keeps
// one run's memory and time small).
inline constexpr uint64_t kStandardOffsetCap = 150;
// The most snapshots the driver tracks at once.
inline constexpr size_t kMaxSnapshots = 8;
// The most tokens one speculation round drafts.
inline constexpr uint64_t kMaxDraft = 8;

struct RandomConfig {
  std::string name;
  engine::CacheSpec spec;
  uint32_t page_tokens = 16;
  uint64_t operations = 10000;
  uint64_t seed = 1;
  // Also extract, filter, merge and extend rows (random_driver_batch.cc), with
  // partner caches of random batch sizes and left padding.
  bool batch_ops = false;
};

// Counts of what a run did, so a test can check that it exercised each path.
struct RandomRunStats {
  uint64_t operations = 0;
  uint64_t updates = 0;
  uint64_t state_updates = 0;  // recurrent layers
  uint64_t fetches = 0;
  uint64_t restores_ok = 0;
  uint64_t restores_refused = 0;
  uint64_t merges_ok = 0;
  uint64_t splits_ok = 0;
  uint64_t refusals = 0;
  uint64_t batch_ops_ok = 0;       // extract, filter, merge, extend
  uint64_t batch_ops_refused = 0;
  // Speculation rounds (random_driver_speculation.cc): those committed (with
  // accepted < drafted among them), aborted, isolated, ended by deleting the
  // cache; refusals checked; views of the speculation compared.
  uint64_t speculations_committed = 0;
  uint64_t speculations_partly_accepted = 0;
  uint64_t speculations_aborted = 0;
  uint64_t speculations_isolated = 0;
  uint64_t speculations_deleted = 0;
  uint64_t speculation_refusals = 0;
  uint64_t speculation_views = 0;
  // Rounds of the snapshot way (random_driver_snapshot_way.cc), and rounds of
  // either way whose live pages were compared with a shadow's
  // (random_driver_page_check.cc).
  uint64_t snapshot_way_rounds = 0;
  uint64_t page_checks = 0;
};

// One line of a run's speculation counts.
void PrintSpeculationStats(const RandomConfig& config, const RandomRunStats& stats);
// Every run commits (some partly), aborts and compares speculative views.
void ExpectSpeculationCoverage(const RandomConfig& config, const RandomRunStats& stats);

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
    kExtractRow, kFilterRows, kMergeCaches, kExtendCache, kSpeculate, kSnapshotWay,
  };
  // One step's tokens, per layer (a recurrent layer's entry stays empty).
  using StepTokens = std::vector<std::vector<RefToken>>;
  // The page check of a round: a cache restored from a snapshot (from 0) of
  // the live one taken before the round.
  struct PageShadow {
    std::string snapshot_id;  // empty when the live cache was at offset 0
    std::string cache_id;
    uint64_t offset = 0;      // the live cache's offset then
  };

  Op PickOp();
  void Step(Op op);
  void CreateCache();
  void Recreate();
  void Update();
  void UpdateLayer(uint32_t layer, uint64_t tokens);
  // A recurrent layer's step: a new state advancing by `advance`, sometimes
  // after an advance-0 one, with wrong-kind and wrong-size attempts refused.
  void UpdateStateLayer(uint32_t layer, uint64_t advance);
  void ApplyState(uint32_t layer, uint64_t advance);
  void ShrinkOrRecreate(uint64_t tokens);
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

  // A speculation round (random_driver_speculation.cc): begin (isolated
  // sometimes), draft 1..8 tokens on every layer in pieces, compare views of
  // the speculation and of the live cache, probe the refusals, then commit
  // 0..k accepted tokens or abort (or delete the cache), mirrored by
  // RefSpeculation.
  void Speculate();
  void DraftTokens(const std::string& speculation_id, RefSpeculation& reference, uint64_t tokens);
  void DraftLayer(const std::string& speculation_id, RefSpeculation& reference, uint32_t layer,
                  uint64_t tokens);
  void DraftStates(const std::string& speculation_id, RefSpeculation& reference, uint32_t layer,
                   uint64_t tokens);
  void CheckSpeculativeView(const std::string& speculation_id, const RefSpeculation& reference);
  // Live mutations are refused while a speculation is open (and change
  // nothing); snapshots and reads of the committed history are not.
  void ProbeWhileSpeculating(const std::string& speculation_id);
  // Drafts 1..kMaxDraft tokens, probing the refused live operations before
  // or after drafting sometimes.
  void DraftAndProbe(const std::string& speculation_id, RefSpeculation& reference);
  // Commits or aborts; returns the drafted tokens the live cache kept.
  uint64_t EndSpeculation(const std::string& speculation_id, RefSpeculation& reference);
  // Ends it while a reader of the speculation is still in flight; the live
  // cache then writes over the drafted positions, and the reader keeps what
  // it read.
  void EndWithReaderInFlight(const std::string& speculation_id, RefSpeculation& reference,
                             const std::optional<PageShadow>& shadow);
  // The first `kept` drafted tokens as one step (none when `kept` is 0).
  std::vector<StepTokens> KeptSteps(const RefSpeculation& reference, uint64_t kept) const;
  // Commit with drafted layers out of step, then finish the step.
  void ProbeCommitOutOfStep(const std::string& speculation_id, RefSpeculation& reference);
  void ExpectSpeculationGone(const std::string& speculation_id);

  // The snapshot way to speculate (random_driver_snapshot_way.cc): a
  // snapshot at each drafted offset, one token per step on every layer, then
  // a restore to the snapshot at the accepted offset and the others released
  // (the restored one sometimes kept and tracked), each call compared with the
  // reference; then the page check.
  void SpeculateBySnapshots();
  void TakeDraftSnapshot(uint64_t from, std::vector<TrackedSnapshot>& taken);
  // One token on every layer (a recurrent layer: a state advancing by one).
  StepTokens StepOneToken();
  void ReleaseDraftSnapshots(const std::vector<TrackedSnapshot>& taken, size_t restored);

  // The page check (random_driver_page_check.cc). Before a round: the shadow
  // (nullopt when the reference says no fresh cache can be restored from the
  // snapshot). After it: the shadow takes plain updates of what the round kept
  // (`kept_steps`, one Update per attention layer and step; each recurrent
  // layer the live state, advancing by the tokens kept), then it and the live
  // cache must hold exactly the same pool bytes; the shadow and its snapshot
  // are then dropped.
  std::optional<PageShadow> BeginPageShadow();
  void EndPageShadow(const PageShadow& shadow, const std::vector<StepTokens>& kept_steps);
  void ApplyToShadow(const PageShadow& shadow, const std::vector<StepTokens>& kept_steps);
  // The live cache and the shadow are at the same offsets and take the same
  // pool bytes (`what` says when).
  void ExpectSamePages(const PageShadow& shadow, const std::string& what);
  void DropPageShadow(const PageShadow& shadow);

  // Batch operations (random_driver_batch.cc).
  void ExtractRow();
  void FilterRows();
  void MergeCaches();
  void ExtendCache();
  // Mid-step (layer 0 ahead), every batch operation is refused.
  void ProbeBatchOpsOutOfStep();
  // A new cache like the current one but with `batch` rows, random left
  // padding and history (`same_offset`: at the current offset), mirrored.
  std::pair<std::string, std::unique_ptr<RefCache>> MakePartner(uint32_t batch, bool same_offset);
  // The driven cache, up to two partners (kept in `partners`), sometimes the
  // driven cache again, in random order; empty if a partner failed.
  std::vector<std::pair<std::string, const RefCache*>> MergeInputs(
      std::vector<std::pair<std::string, std::unique_ptr<RefCache>>>& partners);
  // Appends `tokens` to every layer of cache `id`, mirrored in `reference`.
  void AppendTo(const std::string& id, RefCache& reference, uint64_t tokens);
  // Same code as the reference; counts the outcome. True when it succeeded.
  bool SameOutcome(absl::StatusCode expected, const absl::Status& actual);
  // Cache `id` equals `reference`: spec rows, padding, offsets, every layer's tokens.
  void CheckCache(const std::string& id, const RefCache& reference);
  // Makes `id` (mirrored by `reference`) the driven cache, deleting the old one.
  void Adopt(const std::string& id, std::unique_ptr<RefCache> reference);
  uint32_t Batch() const { return reference_->spec().batch_size; }

  void CheckOffsets();
  void CheckLayer(const engine::CacheSnapshot& view, uint32_t layer,
                  const std::vector<RefToken>& expected);
  // A recurrent layer of `view`: no tokens, and the state `expected` (nullopt:
  // the view holds nothing for the layer).
  void CheckState(const engine::CacheSnapshot& view, uint32_t layer,
                  const std::optional<RefState>& expected);
  // The state a live recurrent layer reads as (zeros before the first update).
  RefState LiveState(uint32_t layer) const;
  // What snapshot `reference` holds for recurrent layer `layer`.
  static std::optional<RefState> SnapshotState(const RefCacheSnapshot& reference, uint32_t layer);
  bool IsRecurrentLayer(uint32_t layer) const;
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
  bool all_recurrent_ = true;
};

}  // namespace kvcache::testing
