#include "speculation_test_util.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "reference_quantized.h"
#include "reference_recurrent.h"

namespace kvcache::testing {

::testing::AssertionResult LayerViewMatches(const engine::CacheSnapshot& view, uint32_t layer,
                                            const std::vector<RefToken>& tokens,
                                            const std::optional<RefState>& state) {
  if (engine::IsRecurrent(view.spec.layers[layer])) {
    absl::StatusOr<RefState> read = ReadLayerState(view, layer);
    if (!read.ok()) return ::testing::AssertionFailure() << "layer " << layer << ": " << read.status();
    if (!(*read == state.value_or(ZeroState(view.spec, layer)))) {
      return ::testing::AssertionFailure() << "layer " << layer << ": state bytes differ";
    }
    return ::testing::AssertionSuccess();
  }
  absl::StatusOr<std::vector<RefToken>> actual = FetchStoredLayer(view, layer, kEverything);
  if (!actual.ok()) return ::testing::AssertionFailure() << "layer " << layer << ": " << actual.status();
  ::testing::AssertionResult same = SameTokens(tokens, *actual);
  if (!same) return same << " (layer " << layer << ")";
  return ::testing::AssertionSuccess();
}

SpeculatingCache::SpeculatingCache(engine::Engine& engine, const engine::CacheSpec& spec,
                                   uint64_t seed)
    : engine_(engine), spec_(spec), reference_(spec), rng_(seed) {
  absl::StatusOr<engine::CacheInfo> info = engine_.CreateCache(spec);
  EXPECT_TRUE(info.ok()) << info.status();
  if (info.ok()) id_ = info->cache_id;
}

SpeculatingCache::~SpeculatingCache() { (void)engine_.DeleteCache(id_); }

::testing::AssertionResult SpeculatingCache::Step(uint64_t tokens) {
  for (uint32_t layer = 0; layer < spec_.layers.size(); ++layer) {
    absl::StatusOr<uint64_t> result;
    if (engine::IsRecurrent(spec_.layers[layer])) {
      RefState state = RandomState(spec_, layer, rng_);
      result = engine_.UpdateState(id_, layer, StateInputOf(state, tokens));
      if (result.ok()) reference_.UpdateState(layer, std::move(state), tokens);
    } else {
      const KvTensors kv = RandomLayerKv(spec_, layer, tokens, rng_);
      result = engine_.Update(id_, layer, kv.input());
      if (result.ok()) {
        reference_.Update(layer,
                          TokensFromTensors(ShapeOf(spec_, layer), kv.keys, kv.values, tokens));
      }
    }
    if (!result.ok()) return ::testing::AssertionFailure() << "layer " << layer << ": " << result.status();
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult SpeculatingCache::Begin(bool isolated) {
  absl::StatusOr<engine::SpeculationInfo> info = engine_.BeginSpeculation(id_, isolated);
  if (!info.ok()) return ::testing::AssertionFailure() << "Begin: " << info.status();
  speculation_id_ = info->speculation_id;
  speculation_ = std::make_unique<RefSpeculation>(reference_, isolated);
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult SpeculatingCache::DraftLayer(uint32_t layer, uint64_t tokens,
                                                        bool state_per_token) {
  absl::StatusOr<uint64_t> result;
  if (engine::IsRecurrent(spec_.layers[layer])) {
    const std::vector<uint64_t> advances =
        state_per_token ? std::vector<uint64_t>(tokens, 1) : std::vector<uint64_t>{tokens};
    for (uint64_t advance : advances) {
      RefState state = RandomState(spec_, layer, rng_);
      result = engine_.UpdateSpeculationState(speculation_id_, id_, layer,
                                              StateInputOf(state, advance));
      if (!result.ok()) break;
      speculation_->UpdateState(layer, std::move(state), advance);
    }
  } else {
    const KvTensors kv = RandomLayerKv(spec_, layer, tokens, rng_);
    result = engine_.UpdateSpeculation(speculation_id_, id_, layer, kv.input());
    if (result.ok()) {
      speculation_->Update(layer,
                           TokensFromTensors(ShapeOf(spec_, layer), kv.keys, kv.values, tokens));
    }
  }
  if (!result.ok()) return ::testing::AssertionFailure() << "layer " << layer << ": " << result.status();
  if (*result != speculation_->layer_offsets()[layer]) {
    return ::testing::AssertionFailure() << "layer " << layer << " at " << *result
                                         << ", the reference at "
                                         << speculation_->layer_offsets()[layer];
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult SpeculatingCache::Draft(uint64_t tokens, bool state_per_token) {
  for (uint32_t layer = 0; layer < spec_.layers.size(); ++layer) {
    ::testing::AssertionResult drafted = DraftLayer(layer, tokens, state_per_token);
    if (!drafted) return drafted;
  }
  return ::testing::AssertionSuccess();
}

absl::Status SpeculatingCache::Commit(uint64_t accepted) {
  const absl::StatusCode expected = speculation_->Commit(accepted, reference_);
  absl::StatusOr<engine::CacheInfo> info = engine_.CommitSpeculation(speculation_id_, accepted);
  EXPECT_EQ(info.status().code(), expected) << info.status();
  if (info.ok()) {
    EXPECT_EQ(info->layer_offsets, reference_.layer_offsets());
    speculation_.reset();
  }
  return info.status();
}

::testing::AssertionResult SpeculatingCache::Abort() {
  absl::StatusOr<engine::CacheInfo> info = engine_.AbortSpeculation(speculation_id_);
  if (!info.ok()) return ::testing::AssertionFailure() << "Abort: " << info.status();
  speculation_.reset();
  if (info->layer_offsets != reference_.layer_offsets()) {
    return ::testing::AssertionFailure() << "offsets moved on abort";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult SpeculatingCache::Matches() {
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view = engine_.Freeze(id_, "");
  if (!view.ok()) return ::testing::AssertionFailure() << "Freeze: " << view.status();
  return ViewMatches(
      **view, [&](uint32_t layer) { return reference_.layer(layer).Fetch(); },
      [&](uint32_t layer) { return reference_.layer(layer).FetchState(); });
}

::testing::AssertionResult SpeculatingCache::SpeculationMatches() {
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view =
      engine_.Freeze(id_, "", speculation_id_);
  if (!view.ok()) return ::testing::AssertionFailure() << "Freeze: " << view.status();
  return ViewMatches(
      **view, [&](uint32_t layer) { return speculation_->Fetch(layer); },
      [&](uint32_t layer) { return speculation_->FetchState(layer); });
}

::testing::AssertionResult SnapshotViewMatches(engine::Engine& engine,
                                               const std::string& snapshot_id,
                                               const RefCacheSnapshot& reference) {
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view =
      engine.Freeze("", snapshot_id);
  if (!view.ok()) return ::testing::AssertionFailure() << "Freeze: " << view.status();
  return ViewMatches(
      **view, [&](uint32_t layer) { return RefCache::FetchSnapshot(reference, layer); },
      [&](uint32_t layer) -> std::optional<RefState> {
        const RefLayerSnapshotPtr& part = reference.layers[layer];
        return part == nullptr ? std::nullopt : part->state;
      });
}

SpeculationFingerprint SpeculationFingerprintOf(engine::Engine& engine,
                                                const std::string& speculation_id) {
  SpeculationFingerprint fingerprint{.engine = FullFingerprintOf(engine)};
  if (speculation_id.empty()) return fingerprint;
  absl::StatusOr<engine::SpeculationInfo> info = engine.GetSpeculation(speculation_id);
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view =
      engine.Freeze("", "", speculation_id);
  if (!info.ok() || !view.ok()) {
    fingerprint.speculation = absl::StrCat(info.status().ToString(), view.status().ToString());
    return fingerprint;
  }
  std::string& out = fingerprint.speculation;
  for (uint64_t offset : info->layer_offsets) absl::StrAppend(&out, offset, ",");
  for (uint32_t layer = 0; layer < (*view)->spec.layers.size(); ++layer) {
    absl::StatusOr<std::vector<RefToken>> tokens = FetchLayer(**view, layer, kEverything);
    for (const RefToken& token : tokens.value_or(std::vector<RefToken>{})) {
      absl::StrAppend(&out, token.position, ":");
      out.append(reinterpret_cast<const char*>(token.keys.data()), token.keys.size());
      out.append(reinterpret_cast<const char*>(token.values.data()), token.values.size());
    }
    if (engine::IsRecurrent((*view)->spec.layers[layer])) {
      absl::StatusOr<RefState> state = ReadLayerState(**view, layer);
      if (state.ok()) {
        out.append(reinterpret_cast<const char*>(state->conv.data()), state->conv.size());
        out.append(reinterpret_cast<const char*>(state->delta.data()), state->delta.size());
      }
    }
  }
  return fingerprint;
}

void SpeculationTest::SetUp() {
  GpuTestBase::SetUp();
  pool_ = MakePool(kSpeculationPageBytes, 32 << 20);
  ASSERT_NE(pool_, nullptr);
  engine_ = std::make_unique<engine::Engine>(
      *pool_, engine::EngineOptions{.page_tokens = kSpeculationPageTokens});
}

void SpeculationTest::TearDown() {
  if (engine_ != nullptr) {
    ReleaseEverything(*engine_);
    EXPECT_EQ(pool_->stats().used_pages, 0u) << "pages leaked";
  }
  engine_.reset();
  pool_.reset();
  GpuTestBase::TearDown();
}

engine::CacheSpec StandardSpec() { return MakeSpec({StandardLayerSpec(2, 8, 4)}); }

engine::CacheSpec QuantizedSpec() {
  return MakeSpec({engine::LayerSpec{.num_kv_heads = 1, .k_head_dim = 64, .v_head_dim = 32,
                                     .kind = engine::QuantizedKind{.group_size = 32, .bits = 4}}});
}

engine::CacheSpec ChunkedSpec() { return MakeSpec({ChunkedLayerSpec(1, 8, 0, 6)}); }

engine::CacheSpec RotatingSpec(uint32_t keep) {
  return MakeSpec({RotatingLayerSpec(1, 8, 4, 7, keep)}, DType::kFloat32);
}

engine::CacheSpec RecurrentSpec() { return MakeSpec({RecurrentLayerSpec(2, 4, 1, 2, 2)}); }

engine::CacheSpec MixedLayout() {
  engine::CacheSpec spec = MakeSpec({StandardLayerSpec(1, 4), RotatingLayerSpec(1, 4, 0, 6, 2),
                                     RecurrentLayerSpec(2, 4, 1, 2, 2), ChunkedLayerSpec(1, 4, 8, 5)},
                                    DType::kBFloat16);
  spec.layers.push_back(QuantizedSpec().layers[0]);
  return spec;
}

engine::CacheSpec BatchedSpec() {
  engine::CacheSpec spec =
      MakeSpec({StandardLayerSpec(1, 4), RotatingLayerSpec(2, 4, 0, 6, 0)}, DType::kFloat16, 3);
  spec.left_padding = {2, 0, 1};
  return spec;
}

}  // namespace kvcache::testing
