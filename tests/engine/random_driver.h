// The random driver (driver_core.h) on an Engine called directly, in lock
// step with the CPU reference. Beside the shared operations it reads the way
// the engine serves a Fetch: views of the live cache, of snapshots and of
// speculations, range by range (windows, sub-ranges that start inside a
// range, quantized layers in their stored form), recurrent layers through
// CacheSnapshot::ReadState; and it can hold a view of a speculation across
// its end.
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

  // The speculation hooks (driver_core.h): a frozen view of the speculation
  // read range by range, and one held across the round's end.
  void FetchSpeculationWindow(const std::string& speculation_id,
                              const RefSpeculation& reference) override;
  HeldRead HoldSpeculationRead(const std::string& speculation_id,
                               const RefSpeculation& reference) override;
};

}  // namespace kvcache::testing
