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
// snapshot way to speculate, speculation rounds and the page check. The
// engine's RandomDriver (random_driver.h) and the wire's WireDriver
// (tests/e2e/wire_driver.h) add the reads, whose forms differ: the engine
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
#include "engine/layers/cache_spec.h"
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

// One line of a run's speculation counts (driver_core_speculation.cc).
void PrintSpeculationStats(const DriverConfig& config, const DriverStats& stats);
// Every run commits (some partly), aborts, isolates, ends rounds by the
// snapshot way, reads speculative views, probes refusals and checks pages.
void ExpectSpeculationCoverage(const std::string& name, const DriverStats& stats);

// Whether `id` is one the server makes: 32 lowercase hex digits, after the
// replica's "<name>:" where it runs with one (protos/wire/ids/replica_id.h).
bool IsServerId(const std::string& id);

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

  // Reads in the subclass's own forms.
  virtual void FetchLive() = 0;
  virtual void FetchSnapshot() = 0;
  // A windowed read of the live cache or a snapshot; by default FetchLive.
  virtual void FetchWindow() { FetchLive(); }
  // A windowed read of a speculation's view: ranges and sub-ranges of a
  // frozen view on the engine, a Fetch of random layers, window and chunks
  // (sometimes packed) over the wire. SpeculationMatches reads whole layers.
  virtual void FetchSpeculationWindow(const std::string& speculation_id,
                                      const RefSpeculation& reference) = 0;
  // A read of the speculation that stays in flight across its end: the
  // returned check runs once the round has ended and the live cache has
  // written over the drafted positions. Only the engine can hold one (a
  // view); a Fetch over the wire ends before the next call starts, so by
  // default there is none (null).
  using HeldRead = std::function<void()>;
  virtual HeldRead HoldSpeculationRead(const std::string& /*speculation_id*/,
                                       const RefSpeculation& /*reference*/) {
    return nullptr;
  }

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
  // To cache `cache_id` (empty: named by the parts' speculation alone).
  void SendStream(const std::deque<StepPart>& parts, size_t applied, const Mirror& mirror,
                  const std::string& cache_id);
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

  // Speculation rounds (driver_core_speculation.cc), mirrored by
  // RefSpeculation: begin (isolated sometimes), draft 1..8 tokens on every
  // layer, probe the refusals while it is open, read its view, then commit
  // 0..k accepted tokens, abort, or delete the cache; the page check and the
  // pool's page count around it.
  void Speculate();
  // Drafts 1..kMaxDraft tokens, probing refusals before or after sometimes;
  // adds to `page_shift` the pages the probes' snapshots took (or freed).
  void DraftAndProbe(const std::string& speculation_id, RefSpeculation& reference,
                     int64_t& page_shift);
  // `tokens` on every layer, in pieces sent in one stream or several.
  void DraftTokens(const std::string& speculation_id, RefSpeculation& reference, uint64_t tokens);
  void AddDraftParts(uint32_t layer, uint64_t tokens, std::deque<StepPart>& parts);
  // Sends `parts` as drafts in one stream, sometimes with one bad message
  // that ends it part way; then sends what it did not apply.
  void SendDraft(const std::string& speculation_id, RefSpeculation& reference,
                 std::deque<StepPart> parts);
  // A draft named with a cache that is not the speculation's: NOT_FOUND.
  void ProbeDraftElsewhere(const std::string& speculation_id, StepPart part);
  // A token drafted on layer 0 alone, a commit refused, then the others.
  void DraftOutOfStep(const std::string& speculation_id, RefSpeculation& reference);
  // Drafted layers out of step (else nothing): a commit is refused.
  void ProbeCommitOutOfStep(const std::string& speculation_id, const RefSpeculation& reference);
  void CheckSpeculativeView(const std::string& speculation_id, const RefSpeculation& reference);
  // Live mutations are refused while a speculation is open and change
  // nothing; reads, snapshots and ExtractRow of the committed history are not.
  void ProbeWhileSpeculating(const std::string& speculation_id, int64_t& page_shift);
  // Commits or aborts; returns the drafted tokens the live cache kept.
  uint64_t EndSpeculation(const std::string& speculation_id, RefSpeculation& reference);
  // A speculation that kept nothing holds no page once it ends.
  void CheckPagesAfterSpeculation(bool isolated, uint64_t pages_before);
  // Pages in use (nullopt when the server is shared, see DriverConfig).
  std::optional<uint64_t> PagesInUse();
  // Every use of the ended speculation (a draft to `cache_id`) is NOT_FOUND.
  void ExpectSpeculationGone(const std::string& speculation_id, const std::string& cache_id);

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
