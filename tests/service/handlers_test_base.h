// The fixture of the handler tests (no network): an engine on a small pool
// behind service::Handlers, on each transfer path with the validation layer
// on, whose pages must all be free again after each test; refusals checked to
// change nothing (recurrent states included); caches created and stepped
// through the handlers, mirrored in the CPU reference.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "chunked_recurrent_test_util.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference_model.h"
#include "service/handlers.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {

class HandlersTestBase : public GpuTestBase {
 protected:
  void SetUp() override;
  void TearDown() override;

  // Runs `call`, expects `code` with `field` in the message, and no change.
  void ExpectRefused(absl::StatusCode code, const std::string& field,
                     const std::function<absl::Status()>& call);

  // A cache of `spec` created through the handlers; its id ("" on failure).
  std::string Create(const engine::CacheSpec& spec);
  // What a random update carries: an attention layer's tokens, or a
  // recurrent layer's state.
  struct LayerUpdateData {
    std::vector<RefToken> tokens;
    RefState state;
  };
  // A random update of `layer` of cache `id` (of `spec`): `tokens` tokens, or
  // a state advancing by `tokens`; its contents also in `data`.
  v1::UpdateRequest RandomLayerUpdate(const std::string& id, const engine::CacheSpec& spec,
                                      uint32_t layer, uint64_t tokens, LayerUpdateData& data);
  // One step of random data for every layer (tokens, or states advancing by
  // `tokens`) through Handlers::Update, mirrored in `reference`.
  ::testing::AssertionResult Step(const std::string& id, RefCache& reference, uint64_t tokens);
  // Cache `id` as the engine holds it equals `reference`: rows, padding,
  // offsets, every layer's stored tokens or state.
  ::testing::AssertionResult Matches(const std::string& id, const RefCache& reference);

  std::mt19937_64 rng_{42};
  std::unique_ptr<gpu::PagePool> pool_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<service::Handlers> handlers_;
};

}  // namespace kvcache::testing
