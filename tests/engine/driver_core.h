// One random driver for the engine and for the wire. It drives a
// DriverAdapter (driver_adapter.h) and the CPU reference (reference_*.h) in
// lock step through a seeded random sequence of operations, asserting after
// each that both agree: status codes, acknowledged offsets, snapshot ranges,
// cache states, the snapshot list, and (through the subclass) fetched bytes.
//
// DriverCore owns the operation choice and every operation written against
// the adapter: update streams (whole steps, pipelined steps, streams a bad
// message ends part way, torn steps and their repair), trims, snapshots,
// restores, merges, splits, releases, recreation, batch operations, the
// snapshot way to speculate and the page check. The engine's RandomDriver
// (random_driver.h) and the wire's WireDriver (tests/service/wire_driver.h)
// add the reads and the speculation rounds, whose forms differ: the engine
// reads views range by range and can hold one across other calls; the wire
// reads chunked Fetch streams, dequantized and packed.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "driver_adapter.h"
#include "engine/cache_spec.h"
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
// A well-formed id that names no cache.
inline constexpr char kOtherId[] = "0123456789abcdef0123456789abcdef";

struct DriverConfig {
  std::string name;
  engine::CacheSpec spec;
  uint32_t page_tokens = 16;  // the engine's pool; a server is started with its own
  uint64_t operations = 10000;
  uint64_t seed = 1;
  // Also extract, filter, merge and extend rows, with partner caches of random
  // batch sizes, left padding and history.
  bool batch_ops = false;
  // Other drivers use the server at the same time: its page counts and its
  // whole snapshot list are not this driver's alone.
  bool shares_server = false;
};

// Counts of what a run did, so a test can check that it exercised each path.
struct DriverStats {
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
  uint64_t state_updates = 0;       // recurrent layers
  uint64_t wrong_kind_streams = 0;  // K/V to a recurrent layer, a state to an attention one
  uint64_t packed_fetches = 0;      // quantized layers read in their stored form (wire)
  uint64_t batch_ops_ok = 0;        // extract, filter, merge, extend
  uint64_t batch_ops_refused = 0;
  // Speculation rounds: those committed (with fewer tokens accepted than
  // drafted: partly), aborted, ended by deleting the cache, isolated; reads
  // of the speculative view; refusals while one was open or after it ended.
  uint64_t speculations_committed = 0;
  uint64_t speculations_partly_accepted = 0;
  uint64_t speculations_aborted = 0;
  uint64_t speculations_deleted = 0;
  uint64_t speculations_isolated = 0;
  uint64_t speculation_views = 0;
  uint64_t speculation_refusals = 0;
  uint64_t drafted_tokens = 0;  // per round, not per layer
  // Rounds of the snapshot way, and rounds of either way whose live pages
  // were compared with a shadow's.
  uint64_t snapshot_way_rounds = 0;
  uint64_t page_checks = 0;
};

class DriverCore {
 public:
  virtual ~DriverCore() = default;
  DriverCore(const DriverCore&) = delete;
  DriverCore& operator=(const DriverCore&) = delete;

  // Runs config.operations operations; stops at the first failed assertion.
  void Run();
  // Compares everything once more, then releases its snapshots and caches.
  virtual void Finish() = 0;
  const DriverStats& stats() const { return stats_; }

 protected:
  struct TrackedSnapshot {
    std::string id;
    RefCacheSnapshotPtr reference;
    bool pinned = false;
  };
  enum class Op {
    kStep, kStreamSteps, kTornStep, kFetch, kFetchWindow, kTrim, kSnapshot, kRestore,
    kRewind, kMerge, kSplit, kRelease, kFetchSnapshot, kRecreate, kExtractRow, kFilterRows,
    kMergeCaches, kExtendCache, kSpeculate, kSnapshotWay,
  };
  // The page check of a round: a cache restored from a snapshot (from 0) of
  // the live one taken before the round.
  struct PageShadow {
    std::string snapshot_id;  // empty when the live cache was at offset 0
    std::string cache_id;
    uint64_t offset = 0;      // the live cache's offset then
  };
  // Applies an acknowledged part to the reference the stream writes to and
  // returns that layer's offset after it.
  using Mirror = std::function<uint64_t(const StepPart&)>;

  DriverCore(DriverAdapter& adapter, const DriverConfig& config);
  // Creates the first cache; subclasses call it once constructed.
  void Start();

  // Reads, and speculation rounds, in the subclass's own forms.
  virtual void FetchLive() = 0;
  virtual void FetchSnapshot() = 0;
  // A windowed read of the live cache or a snapshot; by default FetchLive.
  virtual void FetchWindow() { FetchLive(); }
  virtual void Speculate() = 0;

  // Operations (driver_core.cc).
  Op PickOp();
  void Step(Op op);
  void CreateCache();
  void Recreate();
  // Bounds memory: past the cap, trims where every layer allows it, else (or
  // when a chunked layer's start stopped the trim short) starts over. True
  // when it did either.
  bool KeepStandardLayersSmall(uint64_t tokens);
  void Trim();
  void TakeSnapshot();
  void Restore();
  void Rewind();
  void CompareRestore(const std::string& snapshot_id, const RefCacheSnapshot* reference,
                      uint64_t target);
  void Merge();
  void Split();
  void Release();

  // Update streams (driver_core_steps.cc).
  void UpdateStep();
  void StreamSteps();
  void TornStep();
  void ProbeOutOfStep();
  void Repair();
  void FinishStep();
  // Random data for one layer of cache `spec`: `tokens` tokens, or a state
  // advancing by `tokens`.
  StepPart RandomPart(const engine::CacheSpec& spec, uint32_t layer, uint64_t tokens);
  // Makes the first part a stream applies wrong, so that it ends the stream:
  // of the wrong kind, a state of the wrong size, or a wrong expected_offset.
  void SpoilPart(StepPart& bad);
  // Turns `part` into a wrong-kind one, with random data of the wrong kind.
  void MakeWrongKind(const engine::CacheSpec& spec, StepPart& part);
  // Sends `parts` to the driven cache in one stream. The reference applies
  // the first `applied`; if that is not all, part `applied` must end the
  // stream: INVALID_ARGUMENT if it is of the wrong kind or its state the
  // wrong size, else FAILED_PRECONDITION (a live update while a speculation is
  // open, or a wrong expected_offset).
  void SendStream(const std::deque<StepPart>& parts, size_t applied);
  void SendStream(const std::deque<StepPart>& parts, size_t applied, const Mirror& mirror);
  static void ApplyTo(RefCache& reference, const StepPart& part);

  // Batch operations (driver_core_batch.cc).
  void ExtractRow();
  void FilterRows();
  void MergeCaches();
  void ExtendCache();
  // Mid-step (layer 0 ahead), every batch operation is refused; then the step
  // is finished.
  void ProbeBatchOpsOutOfStep();
  // A new cache like the current one but with `batch` rows, random left
  // padding and history (`same_offset`: at the current offset), mirrored.
  std::pair<std::string, std::unique_ptr<RefCache>> MakePartner(uint32_t batch, bool same_offset);
  // The driven cache, up to two partners (kept in `partners`), sometimes the
  // driven cache again, in random order; empty if a partner failed.
  std::vector<std::pair<std::string, const RefCache*>> MergeInputs(
      std::vector<std::pair<std::string, std::unique_ptr<RefCache>>>& partners);
  // Appends `tokens` to every layer of cache `id` (one stream per step),
  // mirrored in `reference`.
  void AppendTo(const std::string& id, RefCache& reference, uint64_t tokens);
  // Same code as the reference; counts the outcome. True when it succeeded.
  bool SameOutcome(absl::StatusCode expected, const absl::Status& actual);
  // Makes `id` (mirrored by `reference`) the driven cache, deleting the old one.
  void Adopt(const std::string& id, std::unique_ptr<RefCache> reference);
  void CheckCache(const std::string& id, const RefCache& reference);
  uint32_t Batch() const { return reference_->spec().batch_size; }

  // The snapshot way to speculate and the page check (driver_core_pages.cc).
  // The snapshot way: a snapshot at each drafted offset, one token per step
  // on every layer, then a restore to the snapshot at the accepted offset and
  // the others released (the restored one sometimes kept and tracked), each
  // call compared with the reference; then the page check.
  void SpeculateBySnapshots();
  void TakeDraftSnapshot(uint64_t from, std::vector<TrackedSnapshot>& taken);
  void ReleaseDraftSnapshots(const std::vector<TrackedSnapshot>& taken, size_t restored);
  // Plain updates of the first `kept` of a round's one-token `steps`: the
  // attention layers' tokens step by step, then each recurrent layer's live
  // state advancing by all of them.
  std::deque<StepPart> PlainSteps(const std::vector<std::deque<StepPart>>& steps,
                                  uint64_t kept) const;
  // Before a round: the shadow (nullopt when the reference says no fresh
  // cache can be restored from the snapshot). After it: the shadow takes
  // plain updates of what the round kept (`kept`), then it and the live cache
  // must be at the same offsets and take the same pool bytes; the shadow and
  // its snapshot are then dropped.
  std::optional<PageShadow> BeginPageShadow();
  void EndPageShadow(const PageShadow& shadow, const std::deque<StepPart>& kept);
  void ExpectSamePages(const PageShadow& shadow, const std::string& what);
  void DropPageShadow(const PageShadow& shadow);
  // Plain updates of the first `kept` tokens a speculation drafted (none when
  // `kept` is 0): one per attention layer, and each recurrent layer's live
  // state advancing by them.
  std::deque<StepPart> KeptParts(const RefSpeculation& reference, uint64_t kept) const;

  // Checks (driver_core.cc).
  void CheckSnapshotInfo(const SnapshotState& info, const RefCacheSnapshot& reference,
                         bool pinned);
  void CheckOffsets();
  // The snapshot list shows exactly this driver's snapshots, with their ranges.
  void CheckSnapshotList();

  // What the reference holds for a layer of the live cache (snapshot null) or
  // of a snapshot: stored tokens, or a recurrent layer's state (nullopt: none).
  std::vector<RefToken> Expected(uint32_t layer, const RefCacheSnapshot* snapshot) const;
  std::optional<RefState> ExpectedState(uint32_t layer, const RefCacheSnapshot* snapshot) const;
  bool IsRecurrent(uint32_t layer) const;
  uint64_t Offset() const;
  uint64_t Uniform(uint64_t low, uint64_t high);  // inclusive
  bool Chance(double p);
  uint64_t MaxUpdateTokens() const;
  size_t RandomSnapshotIndex();
  void Forget(const std::string& id);

  DriverAdapter& adapter_;
  const DriverConfig config_;
  std::mt19937_64 rng_;
  std::string cache_id_;
  std::set<std::string> cache_ids_;  // every cache this driver created (snapshots outlive them)
  std::unique_ptr<RefCache> reference_;
  std::vector<TrackedSnapshot> snapshots_;
  DriverStats stats_;
  bool has_standard_layer_ = false;  // standard or quantized: grows without bound
  bool all_recurrent_ = true;
};

}  // namespace kvcache::testing
