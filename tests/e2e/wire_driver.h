// The random driver (tests/engine/driver_core.h) on a whole kvcached driven
// over the wire through kvcache::Client (wire_adapter.h: over gRPC, or with
// Update and Fetch on the data lane), in lock step with the CPU reference.
// Beside the shared operations it reads the way a client does: quantized
// layers both dequantized (equal to the CPU dequantization of the reference's
// packed tokens) and packed (words, scales and biases equal to the reference
// quantizer's), recurrent layers with FetchState, and Fetch streams with a
// random window, a random subset of layers in random order, small chunks,
// of the live cache, snapshots and speculations (whose rounds DriverCore runs).
// Several drivers may share one server (each on its own cache), one per thread.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "driver_core.h"
#include "gtest/gtest.h"
#include "kvcache_client.h"
#include "reference_model.h"
#include "reference_speculation.h"
#include "wire_adapter.h"

namespace kvcache::testing {

using WireConfig = DriverConfig;
using WireRunStats = DriverStats;

// Holds the adapter, so that it is built before the DriverCore that uses it.
struct WireAdapterHolder {
  explicit WireAdapterHolder(Client& client) : wire_adapter(client) {}
  explicit WireAdapterHolder(ShardedClient& fleet) : wire_adapter(fleet) {}
  WireAdapter wire_adapter;
};

class WireDriver : private WireAdapterHolder, public DriverCore {
 public:
  WireDriver(Client& client, const WireConfig& config);
  // Its cache placed by the fleet, every call sent to the replica that owns it.
  WireDriver(ShardedClient& fleet, const WireConfig& config);

  // Compares everything once more, then releases its snapshots and deletes its cache.
  void Finish() override;

 private:
  // Reads.
  void FetchLive() override;
  void FetchSnapshot() override;
  // A Fetch of the live cache or a snapshot with a random window, a random
  // subset of layers in random order, small chunks, and sometimes `packed`.
  void FetchWindow() override;
  // A random FetchRequest of the layers it lists in `layers` (in order),
  // positions up to `bound`.
  v1::FetchRequest RandomFetchRequest(uint64_t bound, std::vector<uint32_t>& layers);
  // `chunks` answer `request` for the live cache, `snapshot` (not null) or
  // `speculation` (not null).
  void CheckFetchedChunks(const v1::FetchRequest& request, const std::vector<uint32_t>& layers,
                          const std::vector<v1::FetchResponse>& chunks,
                          const RefCacheSnapshot* snapshot,
                          const RefSpeculation* speculation = nullptr);
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

  // A Fetch of the speculation as FetchWindow reads the live cache (the
  // speculation hook of driver_core.h).
  void FetchSpeculationWindow(const std::string& speculation_id,
                              const RefSpeculation& reference) override;
};

}  // namespace kvcache::testing
