#include "chunked_recurrent_test_util.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "reference_recurrent.h"

namespace kvcache::testing {
namespace {

std::vector<std::byte> RandomBytes(uint64_t size, std::mt19937_64& rng) {
  std::vector<std::byte> bytes(size);
  for (uint64_t i = 0; i < size; i += 8) {
    const uint64_t word = rng();
    std::memcpy(bytes.data() + i, &word, std::min<uint64_t>(8, size - i));
  }
  return bytes;
}

}  // namespace

engine::LayerSpec ChunkedLayerSpec(uint32_t heads, uint32_t k_dim, uint32_t v_dim,
                                   uint32_t chunk_size) {
  return engine::LayerSpec{.num_kv_heads = heads,
                           .k_head_dim = k_dim,
                           .v_head_dim = v_dim,
                           .kind = engine::ChunkedKind{.chunk_size = chunk_size}};
}

engine::LayerSpec RecurrentLayerSpec(uint32_t conv_tail, uint32_t conv_dim, uint32_t num_v_heads,
                                     uint32_t head_v_dim, uint32_t head_k_dim) {
  return engine::LayerSpec{.kind = engine::RecurrentKind{.conv_tail = conv_tail,
                                                         .conv_dim = conv_dim,
                                                         .num_v_heads = num_v_heads,
                                                         .head_v_dim = head_v_dim,
                                                         .head_k_dim = head_k_dim}};
}

RefState RandomState(const engine::CacheSpec& spec, size_t layer, std::mt19937_64& rng,
                     int64_t extra_conv, int64_t extra_delta) {
  return RefState{.conv = RandomBytes(ConvStateBytes(spec, layer) + extra_conv, rng),
                  .delta = RandomBytes(DeltaStateBytes(spec, layer) + extra_delta, rng)};
}

engine::StateInput StateInputOf(const RefState& state, uint64_t advance) {
  return engine::StateInput{.conv = absl::MakeConstSpan(state.conv),
                            .delta = absl::MakeConstSpan(state.delta),
                            .advance = advance};
}

absl::StatusOr<RefState> ReadLayerState(const engine::CacheSnapshot& view, uint32_t layer) {
  // A pattern, so bytes the engine fails to write show.
  RefState state{
      .conv = std::vector<std::byte>(ConvStateBytes(view.spec, layer), std::byte{0xA5}),
      .delta = std::vector<std::byte>(DeltaStateBytes(view.spec, layer), std::byte{0x5A})};
  absl::Status status = view.ReadState(
      layer, engine::StateOutput{absl::MakeSpan(state.conv), absl::MakeSpan(state.delta)});
  if (!status.ok()) return status;
  return state;
}

HybridCache::HybridCache(engine::Engine& engine, const engine::CacheSpec& spec, uint64_t seed)
    : engine_(engine), spec_(spec), reference_(spec), rng_(seed) {
  absl::StatusOr<engine::CacheInfo> info = engine_.CreateCache(spec);
  EXPECT_TRUE(info.ok()) << info.status();
  if (info.ok()) id_ = info->cache_id;
}

::testing::AssertionResult HybridCache::Step(uint64_t tokens) {
  for (uint32_t layer = 0; layer < spec_.layers.size(); ++layer) {
    absl::StatusOr<uint64_t> result;
    if (engine::IsRecurrent(spec_.layers[layer])) {
      RefState state = RandomState(spec_, layer, rng_);
      result = engine_.UpdateState(id_, layer, StateInputOf(state, tokens));
      if (result.ok()) reference_.UpdateState(layer, std::move(state), tokens);
    } else {
      const KvTensors kv = RandomKv(spec_, layer, tokens, rng_);
      result = engine_.Update(id_, layer, kv.input());
      if (result.ok()) {
        reference_.Update(layer,
                          TokensFromTensors(ShapeOf(spec_, layer), kv.keys, kv.values, tokens));
      }
    }
    if (!result.ok()) {
      return ::testing::AssertionFailure() << "layer " << layer << ": " << result.status();
    }
    if (*result != reference_.layer(layer).offset()) {
      return ::testing::AssertionFailure() << "layer " << layer << " offset " << *result
                                           << ", reference " << reference_.layer(layer).offset();
    }
  }
  return ::testing::AssertionSuccess();
}

std::string HybridCache::Snapshot(uint64_t from, RefCacheSnapshotPtr* reference) {
  absl::StatusOr<engine::SnapshotInfo> info = engine_.Snapshot(id_, from);
  EXPECT_TRUE(info.ok()) << info.status();
  *reference = reference_.Snapshot(from);
  EXPECT_NE(*reference, nullptr) << "the reference refuses Snapshot(" << from << ")";
  if (!info.ok() || *reference == nullptr) return "";
  return info->snapshot_id;
}

absl::Status HybridCache::Restore(const std::string& snapshot_id, const RefCacheSnapshot* reference,
                                  uint64_t target) {
  const bool expected = reference_.Restore(reference, target);
  absl::StatusOr<engine::CacheInfo> result = engine_.Restore(id_, snapshot_id, target);
  EXPECT_EQ(result.ok(), expected) << "Restore to " << target << ": engine " << result.status()
                                   << ", reference " << (expected ? "succeeds" : "refuses");
  if (result.ok()) EXPECT_EQ(result->layer_offsets, reference_.layer_offsets());
  return result.status();
}

namespace {

::testing::AssertionResult LayerMatches(const engine::CacheSnapshot& view, uint32_t layer,
                                        const std::vector<RefToken>& tokens,
                                        const std::optional<RefState>& state) {
  absl::StatusOr<std::vector<RefToken>> actual = FetchLayer(view, layer, kEverything);
  if (!actual.ok()) return ::testing::AssertionFailure() << "fetch: " << actual.status();
  ::testing::AssertionResult same = SameTokens(tokens, *actual);
  if (!same) return same << " (layer " << layer << ")";
  if (!engine::IsRecurrent(view.spec.layers[layer])) return ::testing::AssertionSuccess();
  absl::StatusOr<RefState> read = ReadLayerState(view, layer);
  if (!state.has_value()) {
    if (read.status().code() == absl::StatusCode::kInvalidArgument) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure()
           << "layer " << layer << " should hold no state, read " << read.status();
  }
  if (!read.ok()) return ::testing::AssertionFailure() << "state: " << read.status();
  if (!(*read == *state)) {
    return ::testing::AssertionFailure() << "layer " << layer << ": state bytes differ";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

::testing::AssertionResult HybridCache::Matches() {
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view = engine_.Freeze(id_, "");
  if (!view.ok()) return ::testing::AssertionFailure() << "Freeze: " << view.status();
  for (uint32_t layer = 0; layer < spec_.layers.size(); ++layer) {
    const RefLayer& ref = reference_.layer(layer);
    std::optional<RefState> state;
    if (engine::IsRecurrent(spec_.layers[layer])) {
      state = ref.FetchState();
      if (!state.has_value()) state = ZeroState(spec_, layer);
    }
    ::testing::AssertionResult same = LayerMatches(**view, layer, ref.Fetch(), state);
    if (!same) return same << " (live)";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult HybridSnapshotMatches(engine::Engine& engine,
                                                 const std::string& snapshot_id,
                                                 const RefCacheSnapshot& reference) {
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view =
      engine.Freeze("", snapshot_id);
  if (!view.ok()) return ::testing::AssertionFailure() << "Freeze: " << view.status();
  for (uint32_t layer = 0; layer < reference.spec.layers.size(); ++layer) {
    const RefLayerSnapshotPtr& part = reference.layers[layer];
    ::testing::AssertionResult same =
        LayerMatches(**view, layer, RefCache::FetchSnapshot(reference, layer),
                     part == nullptr ? std::nullopt : part->state);
    if (!same) return same << " (snapshot)";
  }
  return ::testing::AssertionSuccess();
}

namespace {

void AppendStates(const engine::CacheSnapshot& view, std::vector<std::string>& out) {
  for (uint32_t layer = 0; layer < view.spec.layers.size(); ++layer) {
    if (!engine::IsRecurrent(view.spec.layers[layer])) continue;
    absl::StatusOr<RefState> state = ReadLayerState(view, layer);
    if (!state.ok()) {
      out.push_back(state.status().ToString());
      continue;
    }
    std::string bytes(reinterpret_cast<const char*>(state->conv.data()), state->conv.size());
    bytes.append(reinterpret_cast<const char*>(state->delta.data()), state->delta.size());
    out.push_back(std::move(bytes));
  }
}

}  // namespace

FullFingerprint FullFingerprintOf(engine::Engine& engine) {
  FullFingerprint fingerprint{.tokens = Fingerprint(engine)};
  for (const EngineFingerprint::Entry& cache : fingerprint.tokens.caches) {
    if (auto view = engine.Freeze(cache.id, ""); view.ok())
      AppendStates(**view, fingerprint.states);
  }
  for (const EngineFingerprint::Entry& snapshot : fingerprint.tokens.snapshots) {
    if (auto view = engine.Freeze("", snapshot.id); view.ok()) {
      AppendStates(**view, fingerprint.states);
    }
  }
  return fingerprint;
}

}  // namespace kvcache::testing
