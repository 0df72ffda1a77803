// Helpers shared by the engine tests: specs, random K/V tensors, fetching a
// layer through Engine::Freeze + Ranges + Read, comparing token lists, and a
// fingerprint of everything the engine shows from outside (for "a failed call
// changes nothing").
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "engine/layers/cache.h"
#include "gtest/gtest.h"
#include "reference_model.h"

namespace kvcache::testing {

inline constexpr engine::TokenRange kEverything{0, UINT64_MAX};

engine::LayerSpec StandardLayerSpec(uint32_t heads, uint32_t k_dim, uint32_t v_dim = 0);
engine::LayerSpec RotatingLayerSpec(uint32_t heads, uint32_t k_dim, uint32_t v_dim,
                                    uint32_t max_size, uint32_t keep);
engine::CacheSpec MakeSpec(std::vector<engine::LayerSpec> layers, DType dtype = DType::kFloat16,
                           uint32_t batch_size = 1);

// The most tokens a random update of `spec` should carry: for rotating layers,
// enough for one multi-token update to wrap the largest ring twice.
uint64_t LongestUsefulUpdate(const engine::CacheSpec& spec);

// L tokens of one layer as [B, H, L, Dk] keys and [B, H, L, Dv] values.
struct KvTensors {
  std::vector<std::byte> keys;
  std::vector<std::byte> values;
  uint64_t tokens = 0;

  engine::KvInput input() const {
    return {absl::MakeConstSpan(keys), absl::MakeConstSpan(values), tokens};
  }
};
KvTensors RandomKv(const RefShape& shape, uint64_t tokens, std::mt19937_64& rng);
KvTensors RandomKv(const engine::CacheSpec& spec, size_t layer, uint64_t tokens,
                   std::mt19937_64& rng);

// The tokens of `layer` inside `window`, read range by range from `view`.
absl::StatusOr<std::vector<RefToken>> FetchLayer(const engine::CacheSnapshot& view, uint32_t layer,
                                                 engine::TokenRange window);
// Reads `range` (inside one of the view's ranges) as tokens at those positions.
absl::StatusOr<std::vector<RefToken>> ReadRange(const engine::CacheSnapshot& view, uint32_t layer,
                                                engine::TokenRange range);
// `tokens` whose positions lie in `window`, order kept.
std::vector<RefToken> Clip(const std::vector<RefToken>& tokens, engine::TokenRange window);

// Same positions in the same order with the same K and V bytes; the message
// names the first difference.
::testing::AssertionResult SameTokens(const std::vector<RefToken>& expected,
                                      const std::vector<RefToken>& actual);
std::string RangesString(const std::vector<engine::TokenRange>& ranges);

// Everything visible from outside: caches (offsets and every layer's tokens),
// snapshots (ranges and tokens) and the pool's used pages.
struct EngineFingerprint {
  struct Layer {
    std::vector<engine::TokenRange> ranges;
    std::vector<std::byte> keys;
    std::vector<std::byte> values;
    bool operator==(const Layer&) const = default;
  };
  struct Entry {
    std::string id;
    std::string cache_id;
    std::vector<uint64_t> offsets;  // caches: layer offsets; snapshots: {from, to}
    std::vector<Layer> layers;
    bool operator==(const Entry&) const = default;
  };
  std::vector<Entry> caches;
  std::vector<Entry> snapshots;
  uint32_t used_pages = 0;
  bool operator==(const EngineFingerprint&) const = default;
};
EngineFingerprint Fingerprint(engine::Engine& engine);
std::string Describe(const EngineFingerprint& fingerprint);

// Releases every snapshot and deletes every cache.
void ReleaseEverything(engine::Engine& engine);

// A cache in an engine together with its reference mirror, for targeted tests.
class MirroredCache {
 public:
  MirroredCache(engine::Engine& engine, const engine::CacheSpec& spec, uint64_t seed = 7);

  const std::string& id() const { return id_; }
  const engine::CacheSpec& spec() const { return spec_; }
  engine::Engine& engine() { return engine_; }
  RefCache& reference() { return reference_; }
  uint64_t offset() const { return reference_.CommonOffset().value_or(0); }

  // Appends `tokens` random tokens to every layer (one Update each), mirrored.
  ::testing::AssertionResult Append(uint64_t tokens);
  // `steps` single-token decode steps.
  ::testing::AssertionResult Decode(uint64_t steps);
  // Appends to one layer only (leaves the cache out of step).
  ::testing::AssertionResult AppendLayer(uint32_t layer, uint64_t tokens);
  // A snapshot from `from`, mirrored; its engine id ("" on failure).
  std::string Snapshot(uint64_t from, RefCacheSnapshotPtr* reference);
  // Restores (snapshot_id "" rewinds), mirrored; fails if the two disagree.
  ::testing::AssertionResult Restore(const std::string& snapshot_id,
                                     const RefCacheSnapshot* reference, uint64_t target);

  // Every layer of the live cache equals the reference, bytes and positions.
  ::testing::AssertionResult Matches();

 private:
  engine::Engine& engine_;
  engine::CacheSpec spec_;
  std::string id_;
  RefCache reference_;
  std::mt19937_64 rng_;
};

// Every layer of snapshot `snapshot_id` equals `reference`.
::testing::AssertionResult SnapshotMatches(engine::Engine& engine, const std::string& snapshot_id,
                                           const RefCacheSnapshot& reference);

}  // namespace kvcache::testing
