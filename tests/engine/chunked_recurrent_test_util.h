// Test helpers for chunked and recurrent layers: their specs, random states
// shaped for a layer, and reading a layer's state back through a view
// (Engine::Freeze -> CacheSnapshot::ReadState), for comparing against the CPU
// reference.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/layers/cache.h"
#include "engine/layers/layer.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "reference_model.h"

namespace kvcache::testing {

engine::LayerSpec ChunkedLayerSpec(uint32_t heads, uint32_t k_dim, uint32_t v_dim,
                                   uint32_t chunk_size);
engine::LayerSpec RecurrentLayerSpec(uint32_t conv_tail, uint32_t conv_dim, uint32_t num_v_heads,
                                     uint32_t head_v_dim, uint32_t head_k_dim);

// A state of random bytes for recurrent layer `layer`, conv and delta sized
// for the spec, plus `extra_conv` / `extra_delta` bytes (non-zero: a bad size).
RefState RandomState(const engine::CacheSpec& spec, size_t layer, std::mt19937_64& rng,
                     int64_t extra_conv = 0, int64_t extra_delta = 0);

// The engine's view of `state` advancing by `advance` tokens; `state` must
// outlive it.
engine::StateInput StateInputOf(const RefState& state, uint64_t advance);

// Layer `layer`'s state as `view` holds it.
absl::StatusOr<RefState> ReadLayerState(const engine::CacheSnapshot& view, uint32_t layer);

// A cache of any mix of kinds in an engine, with its reference mirror. A step
// sends each attention layer L tokens and each recurrent layer a new state
// advancing by L.
class HybridCache {
 public:
  HybridCache(engine::Engine& engine, const engine::CacheSpec& spec, uint64_t seed = 11);

  const std::string& id() const { return id_; }
  RefCache& reference() { return reference_; }
  uint64_t offset() const { return reference_.CommonOffset().value_or(0); }

  ::testing::AssertionResult Step(uint64_t tokens);
  // A snapshot from `from`, mirrored; its engine id ("" on failure).
  std::string Snapshot(uint64_t from, RefCacheSnapshotPtr* reference);
  // Restores (snapshot_id "" rewinds) in both; the engine's status. Adds a
  // test failure if the engine and the reference disagree.
  absl::Status Restore(const std::string& snapshot_id, const RefCacheSnapshot* reference,
                       uint64_t target);
  // Every layer of the live cache (tokens, or state) equals the reference.
  ::testing::AssertionResult Matches();

 private:
  engine::Engine& engine_;
  engine::CacheSpec spec_;
  std::string id_;
  RefCache reference_;
  std::mt19937_64 rng_;
};

// Every layer of snapshot `snapshot_id` (tokens, or state) equals `reference`.
::testing::AssertionResult HybridSnapshotMatches(engine::Engine& engine,
                                                 const std::string& snapshot_id,
                                                 const RefCacheSnapshot& reference);

// Everything visible from outside, recurrent states included (Fingerprint
// reads tokens only): for "a failed call changes nothing".
struct FullFingerprint {
  EngineFingerprint tokens;
  std::vector<std::string> states;  // per cache and snapshot, per layer: its bytes or status
  bool operator==(const FullFingerprint&) const = default;
};
FullFingerprint FullFingerprintOf(engine::Engine& engine);

}  // namespace kvcache::testing
