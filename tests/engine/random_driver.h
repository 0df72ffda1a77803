// The random driver (driver_core.h) on an Engine called directly, in lock
// step with the CPU reference. Beside the shared operations it reads the way
// the engine serves a Fetch: views of the live cache, of snapshots and of
// speculations, range by range (windows, sub-ranges that start inside a
// range, quantized layers in their stored form), recurrent layers through
// CacheSnapshot::ReadState. Its speculation rounds call the engine layer by
// layer, and can hold a view of a speculation across its end.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "driver_core.h"
#include "engine/engine.h"
#include "engine_adapter.h"
#include "reference_model.h"
#include "reference_speculation.h"

namespace kvcache::testing {

using RandomConfig = DriverConfig;
using RandomRunStats = DriverStats;

// One line of a run's speculation counts.
void PrintSpeculationStats(const RandomConfig& config, const RandomRunStats& stats);
// Every run commits (some partly), aborts and compares speculative views.
void ExpectSpeculationCoverage(const RandomConfig& config, const RandomRunStats& stats);

// Holds the adapter, so that it is built before the DriverCore that uses it.
struct EngineAdapterHolder {
  explicit EngineAdapterHolder(engine::Engine& engine) : engine_adapter(engine) {}
  EngineAdapter engine_adapter;
};

class RandomDriver : private EngineAdapterHolder, public DriverCore {
 public:
  RandomDriver(engine::Engine& engine, const RandomConfig& config);

  // Compares everything one last time, then releases all snapshots and caches.
  void Finish() override;

 private:
  engine::Engine& engine() { return engine_adapter.engine(); }

  void FetchLive() override;
  void FetchSnapshot() override;
  void CheckLayer(const engine::CacheSnapshot& view, uint32_t layer,
                  const std::vector<RefToken>& expected);
  // A recurrent layer of `view`: no tokens, and the state `expected` (nullopt:
  // the view holds nothing for the layer).
  void CheckState(const engine::CacheSnapshot& view, uint32_t layer,
                  const std::optional<RefState>& expected);
  void CheckReferenceShape(uint32_t layer, const std::vector<RefToken>& tokens);
  void CheckAllSnapshots();

  // A speculation round (random_driver_speculation.cc): begin (isolated
  // sometimes), draft 1..8 tokens on every layer in pieces, compare views of
  // the speculation and of the live cache, probe the refusals, then commit
  // 0..k accepted tokens or abort (or delete the cache), mirrored by
  // RefSpeculation; the page check around it.
  void Speculate() override;
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
  // it read. Only the engine can hold a view across other calls: a Fetch
  // over the wire ends before the next call starts.
  void EndWithReaderInFlight(const std::string& speculation_id, RefSpeculation& reference,
                             const std::optional<PageShadow>& shadow);
  // Commit with drafted layers out of step, then finish the step.
  void ProbeCommitOutOfStep(const std::string& speculation_id, RefSpeculation& reference);
  void ExpectSpeculationGone(const std::string& speculation_id);
};

}  // namespace kvcache::testing
