// Drives a kvcached over the wire (kvcache::Client) and the CPU reference
// (tests/engine/reference_*.h) in lock step through a seeded random sequence,
// asserting after each operation that both agree: status codes (OK,
// FAILED_PRECONDITION or INVALID_ARGUMENT), acknowledgements, offsets,
// snapshot ranges, and fetched ranges and bytes of the live cache and of
// snapshots. Every cache kind: quantized layers are fetched both dequantized
// (equal to the CPU dequantization of the reference's packed tokens) and packed
// (words, scales and biases equal to the reference quantizer's); recurrent
// layers take states and are read with FetchState.
//
// Unlike the engine's RandomDriver it also exercises what only the wire has:
// whole steps in one Update stream, streams that fail part way (a wrong
// expected_offset, or K/V sent to a recurrent layer and a state to an
// attention layer) and leave the cache out of step, windowed and chunked
// Fetch streams, and ListSnapshots. With batch_ops, ExtractRow, FilterRows,
// MergeCaches and ExtendCache too (wire_driver_batch.cc), against
// reference_batch.h. Speculation rounds (wire_driver_speculation.cc): Begin
// (isolated sometimes), drafts through Update streams with speculation_id,
// reads of the speculative view through Fetch with speculation_id, refused
// live operations, then Commit or Abort, against reference_speculation.h.
// Several drivers may share one server (each on its own cache), one per thread.
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

#include "absl/status/status.h"

#include "engine/cache_spec.h"
#include "engine_test_util.h"
#include "kvcache_client.h"
#include "gtest/gtest.h"
#include "reference_model.h"
#include "reference_speculation.h"

namespace kvcache::testing {

struct WireConfig {
  std::string name;
  engine::CacheSpec spec;
  uint64_t operations = 2000;
  uint64_t seed = 1;
  // Also extract, filter, merge and extend rows, with partner caches of random
  // batch sizes, padding and history.
  bool batch_ops = false;
  // Other drivers use the server at the same time: its page counts are not
  // this driver's alone, so it skips the checks that need them.
  bool shares_server = false;
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
  uint64_t state_updates = 0;      // recurrent layers
  uint64_t wrong_kind_streams = 0;  // K/V to a recurrent layer, a state to an attention one
  uint64_t packed_fetches = 0;     // quantized layers, FetchRequest.packed
  uint64_t batch_ops_ok = 0;       // extract, filter, merge, extend
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
  // Rounds whose live cache was compared with a shadow that took plain
  // updates of what it kept (wire_driver_page_check.cc).
  uint64_t page_checks = 0;
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
  // One layer's part of a step: tokens for an attention layer, a state
  // advancing by `advance` for a recurrent one. With `wrong_kind` it is sent
  // as the other kind (keys and values to a recurrent layer, a state alone
  // to an attention layer), which the server refuses. With `live` it is a
  // live update amid a speculation's drafts, refused while it is open.
  // Updates point into a StepPart, so it must not move once they are made
  // (keep them in a deque).
  struct StepPart {
    uint32_t layer = 0;
    bool recurrent = false;
    bool wrong_kind = false;
    bool live = false;
    KvTensors kv;
    RefState state;
    uint64_t advance = 0;
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
    kExtractRow,
    kFilterRows,
    kMergeCaches,
    kExtendCache,
    kSpeculate,
  };

  Op PickOp();
  void Step(Op op);
  void CreateCache();
  void Recreate();
  bool KeepStandardLayersSmall(uint64_t tokens);

  // Update streams (wire_driver_steps.cc).
  void UpdateStep();
  void StreamSteps();
  void TornStep();
  void ProbeOutOfStep();
  void Repair();
  void FinishStep();
  // Random data for one layer of cache `spec`: `tokens` tokens, or a state
  // advancing by `tokens`.
  StepPart RandomPart(const engine::CacheSpec& spec, uint32_t layer, uint64_t tokens);
  // Turns `part` into a wrong-kind one, with random data of the wrong kind.
  void MakeWrongKind(const engine::CacheSpec& spec, StepPart& part);
  static LayerUpdate UpdateOf(const engine::CacheSpec& spec, const StepPart& part);
  static std::vector<LayerUpdate> UpdatesOf(const engine::CacheSpec& spec,
                                            const std::deque<StepPart>& parts);
  // Sends `updates` (made from `parts`) in one stream. The reference applies
  // the first `applied`; if that is not all, part `applied` must end the
  // stream: INVALID_ARGUMENT if it is of the wrong kind, else
  // FAILED_PRECONDITION (a live update while a speculation is open, or its
  // expected_offset is wrong).
  void SendStream(const std::vector<LayerUpdate>& updates, const std::deque<StepPart>& parts,
                  size_t applied);
  // As above, with `mirror` applying each acknowledged part to the reference
  // the stream writes to and returning that layer's offset after it (the
  // acknowledged one).
  using Mirror = std::function<uint64_t(const StepPart&)>;
  void SendStream(const std::vector<LayerUpdate>& updates, const std::deque<StepPart>& parts,
                  size_t applied, const Mirror& mirror);
  static void ApplyTo(RefCache& reference, const StepPart& part);

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
  // A random FetchRequest of the layers it lists in `layers` (in order),
  // positions up to `bound`.
  v1::FetchRequest RandomFetchRequest(uint64_t bound, std::vector<uint32_t>& layers);

  // Speculation rounds (wire_driver_speculation.cc).
  void Speculate();
  // Drafts `tokens` tokens on every layer, in pieces sent in one Update
  // stream or several; recurrent layers mostly one state per token.
  void DraftTokens(const std::string& speculation_id, RefSpeculation& reference,
                   uint64_t tokens);
  void AddDraftParts(uint32_t layer, uint64_t tokens, std::deque<StepPart>& parts);
  // Sends `parts` as drafts in one stream, sometimes with one bad message
  // that ends it part way; then sends what it did not apply.
  void SendDraft(const std::string& speculation_id, RefSpeculation& reference,
                 std::deque<StepPart> parts);
  void CheckSpeculativeView(const std::string& speculation_id, const RefSpeculation& reference);
  ::testing::AssertionResult SpeculativeLayerMatches(const std::string& speculation_id,
                                                     uint32_t layer,
                                                     const RefSpeculation& reference);
  void FetchSpeculationWindow(const std::string& speculation_id, const RefSpeculation& reference);
  // Live mutations are refused while a speculation is open and change nothing;
  // reads and snapshots of the committed history are allowed.
  // Adds to `page_shift` the pages its snapshot took (or the release that made
  // room for it freed).
  void ProbeWhileSpeculating(const std::string& speculation_id, int64_t& page_shift);
  // Drafted layers out of step: a commit is refused.
  void ProbeCommitOutOfStep(const std::string& speculation_id, const RefSpeculation& reference);
  // Commits or aborts; returns the drafted tokens the live cache kept (none
  // when aborted or isolated).
  uint64_t EndSpeculation(const std::string& speculation_id, RefSpeculation& reference);
  // A speculation that kept nothing holds no page once it ends.
  void CheckPagesAfterSpeculation(bool isolated, uint64_t pages_before);
  // Pages in use on the server (nullopt when it is shared, see WireConfig).
  std::optional<uint64_t> PagesInUse();
  // Every use of the ended speculation is NOT_FOUND naming speculation_id; a
  // draft names `cache_id`, the cache it was open on.
  void ExpectSpeculationGone(const std::string& speculation_id, const std::string& cache_id);

  // The page check of a round (wire_driver_page_check.cc): a cache restored
  // from a snapshot (from 0) of the live one before the round (nullopt when
  // the reference says no fresh cache can be restored from it); after it, the
  // shadow takes plain updates of the `kept` drafted tokens and must take the
  // same pool bytes as the live cache; then it and its snapshot are dropped.
  struct PageShadow {
    std::string snapshot_id;  // empty when the live cache was at offset 0
    std::string cache_id;
    uint64_t offset = 0;      // the live cache's offset then
  };
  std::optional<PageShadow> BeginPageShadow();
  void EndPageShadow(const PageShadow& shadow, const RefSpeculation& reference, uint64_t kept);
  void SendToShadow(const PageShadow& shadow, const std::deque<StepPart>& parts);
  void DropPageShadow(const PageShadow& shadow);

  // Batch operations (wire_driver_batch.cc).
  void ExtractRow();
  void FilterRows();
  void MergeCaches();
  void ExtendCache();
  void ProbeBatchOpsOutOfStep();
  std::pair<std::string, std::unique_ptr<RefCache>> MakePartner(uint32_t batch, bool same_offset);
  std::vector<std::pair<std::string, const RefCache*>> MergeInputs(
      std::vector<std::pair<std::string, std::unique_ptr<RefCache>>>& partners);
  // Appends `tokens` to every layer of cache `id` (one stream per step),
  // mirrored in `reference`.
  void AppendTo(const std::string& id, RefCache& reference, uint64_t tokens);
  bool SameOutcome(absl::StatusCode expected, const absl::Status& actual);
  void Adopt(const std::string& id, std::unique_ptr<RefCache> reference);
  uint32_t Batch() const { return reference_->spec().batch_size; }

  // Reads and comparisons (wire_driver_checks.cc). `chunks` answer `request`
  // for the live cache, `snapshot` (not null) or `speculation` (not null).
  void CheckFetchedChunks(const v1::FetchRequest& request, const std::vector<uint32_t>& layers,
                          const std::vector<v1::FetchResponse>& chunks,
                          const RefCacheSnapshot* snapshot,
                          const RefSpeculation* speculation = nullptr);
  void CheckSnapshotInfo(const v1::SnapshotInfo& info, const RefCacheSnapshot& reference,
                         bool pinned);
  void CheckOffsets();
  void CheckSnapshotList();
  void CheckEverything();
  // Layer `layer` of cache `cache_id` or snapshot `snapshot_id`, read over
  // the wire, equals `expected` (tokens of attention layers; quantized ones
  // both dequantized and packed) or `state` (recurrent layers; nullopt: the
  // snapshot holds none).
  ::testing::AssertionResult LayerMatches(const std::string& cache_id,
                                          const std::string& snapshot_id, uint32_t layer,
                                          const engine::CacheSpec& spec,
                                          const std::vector<RefToken>& expected,
                                          const std::optional<RefState>& state);
  // Cache `id` over the wire equals `reference`: rows, padding, offsets, layers.
  void CheckCache(const std::string& id, const RefCache& reference);

  // What the reference holds for a layer of the live cache (snapshot null) or
  // of a snapshot: stored tokens (packed for quantized layers), or a state.
  std::vector<RefToken> Expected(uint32_t layer, const RefCacheSnapshot* snapshot) const;
  std::optional<RefState> ExpectedState(uint32_t layer, const RefCacheSnapshot* snapshot) const;
  bool IsRecurrent(uint32_t layer) const { return engine::IsRecurrent(config_.spec.layers[layer]); }
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
  bool has_standard_layer_ = false;  // standard or quantized: grows without bound
  bool all_recurrent_ = true;
};

}  // namespace kvcache::testing
