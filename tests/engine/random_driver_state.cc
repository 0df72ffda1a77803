// RandomDriver's recurrent layers (engine/recurrent_layer.h): state updates
// with wrong-kind, wrong-size and wrong-offset attempts refused first, and
// states compared with the reference through CacheSnapshot::ReadState.
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "chunked_recurrent_test_util.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "random_driver.h"
#include "reference_recurrent.h"

namespace kvcache::testing {

bool RandomDriver::IsRecurrentLayer(uint32_t layer) const {
  return engine::IsRecurrent(config_.spec.layers[layer]);
}

void RandomDriver::UpdateStateLayer(uint32_t layer, uint64_t advance) {
  const uint64_t before = reference_->layer(layer).offset();
  if (Chance(0.03)) {  // keys and values for a recurrent layer
    const KvTensors kv = RandomKv(RefShape{}, 1, rng_);
    EXPECT_EQ(engine_.Update(cache_id_, layer, kv.input()).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  if (Chance(0.03)) {  // a conv or delta state of the wrong size
    const int64_t wrong = Chance(0.5) ? 2 : -2;
    const bool conv = Chance(0.5);
    const RefState bad =
        RandomState(reference_->spec(), layer, rng_, conv ? wrong : 0, conv ? 0 : wrong);
    const absl::Status status =
        engine_.UpdateState(cache_id_, layer, StateInputOf(bad, advance)).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find(conv ? "state.conv_state" : "state.delta_state"),
              absl::string_view::npos) << status;
  }
  if (Chance(0.03)) {
    const RefState state = RandomState(reference_->spec(), layer, rng_);
    EXPECT_EQ(engine_.UpdateState(cache_id_, layer, StateInputOf(state, advance), before + 1)
                  .status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  if (Chance(0.1)) ApplyState(layer, 0);  // a state that consumed no token
  ApplyState(layer, advance);
}

void RandomDriver::ApplyState(uint32_t layer, uint64_t advance) {
  RefState state = RandomState(reference_->spec(), layer, rng_);
  std::optional<uint64_t> expected_offset;
  if (Chance(0.2)) expected_offset = reference_->layer(layer).offset();
  absl::StatusOr<uint64_t> result =
      engine_.UpdateState(cache_id_, layer, StateInputOf(state, advance), expected_offset);
  ASSERT_TRUE(result.ok()) << result.status();
  reference_->UpdateState(layer, std::move(state), advance);
  ASSERT_EQ(*result, reference_->layer(layer).offset());
  ++stats_.state_updates;
}

RefState RandomDriver::LiveState(uint32_t layer) const {
  std::optional<RefState> state = reference_->layer(layer).FetchState();
  return state.has_value() ? *std::move(state) : ZeroState(reference_->spec(), layer);
}

std::optional<RefState> RandomDriver::SnapshotState(const RefCacheSnapshot& reference,
                                                    uint32_t layer) {
  if (reference.layers[layer] == nullptr) return std::nullopt;
  return reference.layers[layer]->state;
}

void RandomDriver::CheckState(const engine::CacheSnapshot& view, uint32_t layer,
                              const std::optional<RefState>& expected) {
  SCOPED_TRACE(absl::StrCat("recurrent layer ", layer));
  EXPECT_TRUE(view.Ranges(layer, kEverything).empty());
  absl::StatusOr<RefState> actual = ReadLayerState(view, layer);
  if (!expected.has_value()) {
    ASSERT_EQ(actual.status().code(), absl::StatusCode::kInvalidArgument) << actual.status();
    return;
  }
  ASSERT_TRUE(actual.ok()) << actual.status();
  ASSERT_TRUE(actual->conv == expected->conv) << "conv state bytes differ";
  ASSERT_TRUE(actual->delta == expected->delta) << "delta state bytes differ";
  if (Chance(0.1)) {  // a recurrent layer has no tokens to read
    EXPECT_EQ(ReadRange(view, layer, {0, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace kvcache::testing
