// Helpers for the speculation tests: a cache driven in the engine and in the
// CPU reference together (live steps, and a speculation mirrored by
// RefSpeculation), views compared byte for byte with the reference (quantized
// layers in their packed form, recurrent layers by state), and a fixture whose
// refusals must change nothing: neither the engine's caches and snapshots nor
// the open speculation.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "chunked_recurrent_test_util.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "reference_model.h"
#include "reference_speculation.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {

// `view` holds, for every layer, what `tokens(layer)` / `state(layer)` say
// (quantized layers compared packed, recurrent ones by state: nullopt reads
// as zeros).
template <typename Tokens, typename State>
::testing::AssertionResult ViewMatches(const engine::CacheSnapshot& view, Tokens&& tokens,
                                       State&& state);

// A cache in an engine, its reference, and (while one is open) a speculation
// on it mirrored by RefSpeculation.
class SpeculatingCache {
 public:
  SpeculatingCache(engine::Engine& engine, const engine::CacheSpec& spec, uint64_t seed = 3);
  // Deletes the cache (if the test has not), ending its speculation.
  ~SpeculatingCache();
  SpeculatingCache(const SpeculatingCache&) = delete;
  SpeculatingCache& operator=(const SpeculatingCache&) = delete;

  const std::string& id() const { return id_; }
  const std::string& speculation_id() const { return speculation_id_; }
  const engine::CacheSpec& spec() const { return spec_; }
  RefCache& reference() { return reference_; }
  RefSpeculation* speculation() { return speculation_.get(); }
  uint64_t offset() const { return reference_.CommonOffset().value_or(0); }

  // `tokens` tokens on every layer of the live cache (a recurrent layer takes
  // one state advancing by `tokens`).
  ::testing::AssertionResult Step(uint64_t tokens);
  ::testing::AssertionResult Begin(bool isolated);
  // `tokens` drafted tokens on every layer; a recurrent layer takes one state
  // per token when `state_per_token`, else one for all of them.
  ::testing::AssertionResult Draft(uint64_t tokens, bool state_per_token = true);
  ::testing::AssertionResult DraftLayer(uint32_t layer, uint64_t tokens,
                                        bool state_per_token = true);
  // Commits in both; the engine's status (a failure when the two disagree).
  absl::Status Commit(uint64_t accepted);
  ::testing::AssertionResult Abort();

  // The live cache equals the reference; the speculative view equals the
  // RefSpeculation.
  ::testing::AssertionResult Matches();
  ::testing::AssertionResult SpeculationMatches();

 private:
  engine::Engine& engine_;
  engine::CacheSpec spec_;
  std::string id_;
  RefCache reference_;
  std::string speculation_id_;
  std::unique_ptr<RefSpeculation> speculation_;
  std::mt19937_64 rng_;
};

// Snapshot `snapshot_id` equals `reference` (ViewMatches: quantized layers packed).
::testing::AssertionResult SnapshotViewMatches(engine::Engine& engine,
                                               const std::string& snapshot_id,
                                               const RefCacheSnapshot& reference);

// Everything a refusal must leave as it was: the engine's caches, snapshots
// and pages (FullFingerprint), and the open speculation's offsets and view.
struct SpeculationFingerprint {
  FullFingerprint engine;
  std::string speculation;  // info and every layer's bytes, or the status
  bool operator==(const SpeculationFingerprint&) const = default;
};
SpeculationFingerprint SpeculationFingerprintOf(engine::Engine& engine,
                                                const std::string& speculation_id);

inline constexpr uint64_t kSpeculationPageBytes = 4 << 10;
inline constexpr uint32_t kSpeculationPageTokens = 4;

class SpeculationTest : public GpuTestBase {
 protected:
  void SetUp() override;
  void TearDown() override;
  int64_t UsedPages() const { return pool_->stats().used_pages; }
  // Runs `call`; expects `code`, `message_part` in the message, and no change.
  template <typename Call>
  void ExpectRefused(absl::StatusCode code, const std::string& message_part,
                     const std::string& speculation_id, Call call);

  std::unique_ptr<gpu::PagePool> pool_;
  std::unique_ptr<engine::Engine> engine_;
};

// Specs of every kind (and a mixed layout), small enough for 4-token pages.
engine::CacheSpec StandardSpec();
engine::CacheSpec QuantizedSpec();
engine::CacheSpec ChunkedSpec();
engine::CacheSpec RotatingSpec(uint32_t keep);
engine::CacheSpec RecurrentSpec();
engine::CacheSpec MixedLayout();   // standard, rotating with sinks, recurrent, chunked, quantized
engine::CacheSpec BatchedSpec();   // standard + rotating, 3 rows with left padding

// ------------------------------------------------------------------ templates

inline absl::Status StatusOfCall(const absl::Status& status) { return status; }
template <typename T>
absl::Status StatusOfCall(const absl::StatusOr<T>& result) {
  return result.status();
}

::testing::AssertionResult LayerViewMatches(const engine::CacheSnapshot& view, uint32_t layer,
                                            const std::vector<RefToken>& tokens,
                                            const std::optional<RefState>& state);

template <typename Tokens, typename State>
::testing::AssertionResult ViewMatches(const engine::CacheSnapshot& view, Tokens&& tokens,
                                       State&& state) {
  for (uint32_t layer = 0; layer < view.spec.layers.size(); ++layer) {
    const bool recurrent = engine::IsRecurrent(view.spec.layers[layer]);
    ::testing::AssertionResult same =
        LayerViewMatches(view, layer, recurrent ? std::vector<RefToken>{} : tokens(layer),
                         recurrent ? state(layer) : std::nullopt);
    if (!same) return same;
  }
  return ::testing::AssertionSuccess();
}

template <typename Call>
void SpeculationTest::ExpectRefused(absl::StatusCode code, const std::string& message_part,
                                    const std::string& speculation_id, Call call) {
  const SpeculationFingerprint before = SpeculationFingerprintOf(*engine_, speculation_id);
  const absl::Status status = StatusOfCall(call());
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_NE(std::string(status.message()).find(message_part), std::string::npos)
      << "message \"" << status.message() << "\" should name \"" << message_part << "\"";
  EXPECT_TRUE(SpeculationFingerprintOf(*engine_, speculation_id) == before)
      << "a refused call changed something";
}

}  // namespace kvcache::testing
