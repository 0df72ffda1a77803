// The fixture of the batch-operation tests (batch_test.cc, batch_misuse_test.cc):
// an engine on a small pool, caches whose K/V values name their cache, row and
// position (so expectations can be written by hand), and reading one row of a
// layer back. Every test ends with every page free.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {

// K element d of row `row` at position `position` of a cache tagged `tag`
// (V is its negation). Exact in float32 for the sizes used here.
inline float TaggedValue(int tag, uint32_t row, uint64_t position, uint32_t d) {
  return static_cast<float>(tag * 10000 + row * 1000 + position * 10 + d);
}

// float32, one head, k_head_dim = v_head_dim = 2: small enough to spell out.
engine::LayerSpec TinyStandard();
engine::LayerSpec TinyRotating(uint32_t max_size, uint32_t keep);
engine::CacheSpec TinySpec(std::vector<engine::LayerSpec> layers, std::vector<uint32_t> padding);

class BatchTestBase : public GpuTestBase {
 protected:
  void SetUp() override;
  void TearDown() override;
  void StartEngine(uint64_t budget_bytes, engine::EngineOptions options);

  std::string NewCache(const engine::CacheSpec& spec);
  // Appends `tokens` tokens to every layer of a tiny cache, in updates of
  // `step` tokens: row r at position p holds TaggedValue(tag, r, p, d).
  void Append(const std::string& id, uint64_t tokens, int tag, uint64_t step = 0);

  // What row `row` of `layer` holds: its positions (every row has the same)
  // and its K element 0 at each (V is checked to be -K).
  struct RowContents {
    std::vector<engine::TokenRange> ranges;
    std::vector<float> keys;  // element 0 of K per position, in order
  };
  RowContents Row(const std::string& id, uint32_t layer, uint32_t row);
  // The K element 0 a row holds at [begin, end): `source` row of cache `tag`
  // from `source_begin` on, or zeros where tag < 0.
  static std::vector<float> Expected(int tag, uint32_t source_row, uint64_t source_begin,
                                     uint64_t count);

  // Runs `call`, expecting `code` with `message_part`, and nothing changed.
  template <typename Call>
  void ExpectRefused(absl::StatusCode code, const std::string& message_part, Call call) {
    const EngineFingerprint before = Fingerprint(*engine_);
    const absl::Status status = call().status();
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_NE(std::string(status.message()).find(message_part), std::string::npos)
        << "message \"" << status.message() << "\" should name \"" << message_part << "\"";
    const EngineFingerprint after = Fingerprint(*engine_);
    EXPECT_TRUE(before == after) << "before:\n"
                                 << Describe(before) << "\nafter:\n"
                                 << Describe(after);
  }

  std::unique_ptr<gpu::PagePool> pool_;
  std::unique_ptr<engine::Engine> engine_;
};

}  // namespace kvcache::testing
