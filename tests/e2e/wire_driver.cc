// WireDriver (wire_driver.h): fetches of the live cache, of snapshots and of
// speculations (whole layers, windows cut into small chunks, quantized layers
// dequantized and packed, recurrent states), and the final comparison.
#include <algorithm>
#include <map>
#include <tuple>
#include <variant>

#include "absl/strings/str_cat.h"
#include "e2e_test_util.h"
#include "gtest/gtest.h"
#include "reference_recurrent.h"
#include "wire_driver.h"
#include "wire_forms_util.h"

namespace kvcache::testing {

::testing::AssertionResult WireDriver::LayerMatches(const std::string& cache_id,
                                                    const std::string& snapshot_id,
                                                    uint32_t layer, const engine::CacheSpec& spec,
                                                    const std::vector<RefToken>& expected,
                                                    const std::optional<RefState>& state) {
  stats_.packed_fetches += std::holds_alternative<engine::QuantizedKind>(spec.layers[layer].kind);
  return LayerMatchesReference(wire_adapter.For(snapshot_id.empty() ? cache_id : snapshot_id),
                               cache_id, snapshot_id, spec, layer, expected, state);
}

void WireDriver::FetchLive() {
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  SCOPED_TRACE(absl::StrCat("fetch live layer ", layer));
  ASSERT_TRUE(LayerMatches(cache_id_, "", layer, reference_->spec(), Expected(layer, nullptr),
                           ExpectedState(layer, nullptr)));
  ++stats_.fetches;
}

void WireDriver::FetchSnapshot() {
  if (snapshots_.empty()) return;
  const TrackedSnapshot& snapshot = snapshots_[RandomSnapshotIndex()];
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  SCOPED_TRACE(absl::StrCat("fetch snapshot [", snapshot.reference->from, ",",
                            snapshot.reference->to, ") layer ", layer));
  // A snapshot is found by its id alone; the live cache named beside it is
  // renewed, not read.
  const std::string cache_id = Chance(0.5) ? cache_id_ : "";
  const RefCacheSnapshot* reference = snapshot.reference.get();
  ASSERT_TRUE(LayerMatches(cache_id, snapshot.id, layer, reference->spec,
                           Expected(layer, reference), ExpectedState(layer, reference)));
  ++stats_.snapshot_fetches;
}

v1::FetchRequest WireDriver::RandomFetchRequest(uint64_t bound, std::vector<uint32_t>& layers) {
  v1::FetchRequest request;
  layers.resize(reference_->num_layers());
  for (uint32_t l = 0; l < layers.size(); ++l) layers[l] = l;
  if (Chance(0.7)) {
    std::shuffle(layers.begin(), layers.end(), rng_);
    layers.resize(Uniform(1, layers.size()));
    for (uint32_t l : layers) request.add_layers(l);
  }
  request.set_start(Uniform(0, bound));
  if (Chance(0.7)) request.set_end(Uniform(request.start(), bound + 1));
  request.set_max_chunk_tokens(Chance(0.3) ? 0 : Uniform(1, 9));
  request.set_packed(Chance(0.3));  // only quantized layers have another form
  return request;
}

// A Fetch of the live cache or a snapshot with a random window, a random
// subset of layers in random order, small chunks, and sometimes `packed`.
void WireDriver::FetchWindow() {
  const TrackedSnapshot* snapshot =
      !snapshots_.empty() && Chance(0.4) ? &snapshots_[RandomSnapshotIndex()] : nullptr;
  const uint64_t bound = (snapshot ? snapshot->reference->to : reference_->layer_offsets()[0]) + 2;
  std::vector<uint32_t> layers;
  v1::FetchRequest request = RandomFetchRequest(bound, layers);
  request.set_cache_id(cache_id_);
  if (snapshot != nullptr) request.set_snapshot_id(snapshot->id);
  SCOPED_TRACE(absl::StrCat("fetch ", request.ShortDebugString()));
  std::vector<v1::FetchResponse> chunks;
  const absl::Status status = wire_adapter.For(snapshot ? snapshot->id : cache_id_)
                                  .Fetch(request, [&](const v1::FetchResponse& chunk) {
                                    chunks.push_back(chunk);
                                    return absl::OkStatus();
                                  });
  ASSERT_TRUE(status.ok()) << status;
  CheckFetchedChunks(request, layers, chunks, snapshot ? snapshot->reference.get() : nullptr);
  ++(snapshot ? stats_.snapshot_fetches : stats_.fetches);
}

void WireDriver::FetchSpeculationWindow(const std::string& id, const RefSpeculation& reference) {
  const std::vector<uint64_t> offsets = reference.layer_offsets();
  std::vector<uint32_t> layers;
  v1::FetchRequest request =
      RandomFetchRequest(*std::max_element(offsets.begin(), offsets.end()) + 2, layers);
  request.set_speculation_id(id);
  if (Chance(0.5)) request.set_cache_id(cache_id_);
  SCOPED_TRACE(absl::StrCat("fetch ", request.ShortDebugString()));
  absl::StatusOr<std::vector<v1::FetchResponse>> chunks = wire_adapter.For(id).FetchAll(request);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  CheckFetchedChunks(request, layers, *chunks, nullptr, &reference);
}

namespace {

// A token chunk is shaped [B, H, L, D] in the cache dtype, L at least 1 and
// at most max_chunk_tokens (when set).
::testing::AssertionResult TokenChunkShaped(const v1::FetchResponse& chunk, const RefShape& shape,
                                            DType dtype, uint32_t max_chunk_tokens) {
  if (chunk.keys().shape_size() != 4) {
    return ::testing::AssertionFailure() << "keys of rank " << chunk.keys().shape_size();
  }
  const uint64_t length = chunk.keys().shape(2);
  const std::vector<uint64_t> keys(chunk.keys().shape().begin(), chunk.keys().shape().end());
  const std::vector<uint64_t> values(chunk.values().shape().begin(), chunk.values().shape().end());
  if (keys != std::vector<uint64_t>{shape.batch, shape.heads, length, shape.k_dim} ||
      values != std::vector<uint64_t>{shape.batch, shape.heads, length, shape.v_dim} ||
      chunk.keys().dtype() != static_cast<int>(dtype) || length == 0 ||
      (max_chunk_tokens > 0 && length > max_chunk_tokens)) {
    return ::testing::AssertionFailure() << "chunk " << chunk.ShortDebugString().substr(0, 200);
  }
  return ::testing::AssertionSuccess();
}

uint64_t PackedLength(const v1::FetchResponse& chunk) {
  return chunk.packed_keys().wq().shape_size() == 4 ? chunk.packed_keys().wq().shape(2) : 0;
}

}  // namespace

// Chunks come layer by layer in the requested order, each one layer and one
// contiguous range of at most max_chunk_tokens: [B, H, L, D] keys and values,
// a quantized layer's stored form when `packed`, or one chunk with a
// recurrent layer's state at its offset (whatever the window).
void WireDriver::CheckFetchedChunks(const v1::FetchRequest& request,
                                    const std::vector<uint32_t>& layers,
                                    const std::vector<v1::FetchResponse>& chunks,
                                    const RefCacheSnapshot* snapshot,
                                    const RefSpeculation* speculation) {
  const engine::CacheSpec& spec = snapshot ? snapshot->spec : reference_->spec();
  const engine::TokenRange window{request.start(), request.has_end() ? request.end() : UINT64_MAX};
  // What the source holds: tokens, a recurrent layer's state and its offset.
  const auto tokens_of = [&](uint32_t layer) {
    return speculation ? speculation->Fetch(layer) : Expected(layer, snapshot);
  };
  const auto state_of = [&](uint32_t layer) -> std::optional<RefState> {
    if (speculation == nullptr) return ExpectedState(layer, snapshot);
    return speculation->FetchState(layer).value_or(ZeroState(spec, layer));
  };
  const auto state_offset = [&](uint32_t layer) {
    if (speculation != nullptr) return speculation->layer_offsets()[layer];
    return snapshot ? snapshot->layers[layer]->to : reference_->layer(layer).offset();
  };
  size_t next = 0;
  for (uint32_t layer : layers) {
    SCOPED_TRACE(absl::StrCat("layer ", layer));
    std::vector<v1::FetchResponse> mine;
    for (; next < chunks.size() && chunks[next].layer() == layer; ++next) {
      mine.push_back(chunks[next]);
    }
    if (engine::IsRecurrent(spec.layers[layer])) {
      const std::optional<RefState> state = state_of(layer);
      ASSERT_EQ(mine.size(), state.has_value() ? 1u : 0u);
      if (!state.has_value()) continue;
      ASSERT_EQ(mine[0].start(), state_offset(layer));
      absl::StatusOr<RefState> actual = StateOf(spec, layer, mine[0].state());
      ASSERT_TRUE(actual.ok()) << actual.status();
      ASSERT_TRUE(*actual == *state) << "state bytes differ";
      continue;
    }
    const std::vector<RefToken> expected = Clip(tokens_of(layer), window);
    const bool quantized = std::holds_alternative<engine::QuantizedKind>(spec.layers[layer].kind);
    if (request.packed() && quantized) {
      for (const v1::FetchResponse& chunk : mine) {
        ASSERT_GE(PackedLength(chunk), 1u);
        if (request.max_chunk_tokens() > 0) {
          ASSERT_LE(PackedLength(chunk), request.max_chunk_tokens());
        }
      }
      absl::StatusOr<std::vector<RefToken>> tokens = PackedTokensOf(spec, layer, mine);
      ASSERT_TRUE(tokens.ok()) << tokens.status();
      ASSERT_TRUE(SameTokens(expected, *tokens)) << "packed";
      ++stats_.packed_fetches;
      continue;
    }
    for (const v1::FetchResponse& chunk : mine) {
      ASSERT_TRUE(TokenChunkShaped(chunk, ShapeOf(spec, layer), spec.dtype,
                                   request.max_chunk_tokens()));
    }
    ASSERT_TRUE(HistoryMatches(AsFetched(spec, layer, expected), AssembleHistory(mine),
                               ShapeOf(spec, layer)));
  }
  ASSERT_EQ(next, chunks.size()) << "a chunk of layer " << chunks[next].layer()
                                 << " out of the requested layer order";
}

void WireDriver::CheckEverything() {
  for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
    EXPECT_TRUE(LayerMatches(cache_id_, "", layer, reference_->spec(), Expected(layer, nullptr),
                             ExpectedState(layer, nullptr)))
        << "live layer " << layer;
    for (const TrackedSnapshot& s : snapshots_) {
      const RefCacheSnapshot* reference = s.reference.get();
      EXPECT_TRUE(LayerMatches("", s.id, layer, reference->spec, Expected(layer, reference),
                               ExpectedState(layer, reference)))
          << "snapshot " << s.id << " layer " << layer;
    }
  }
  CheckSnapshotList();
}

WireDriver::WireDriver(Client& client, const WireConfig& config)
    : WireAdapterHolder(client), DriverCore(wire_adapter, config) {
  Start();
}

WireDriver::WireDriver(ShardedClient& fleet, const WireConfig& config)
    : WireAdapterHolder(fleet), DriverCore(wire_adapter, config) {
  Start();
}

void WireDriver::Finish() {
  SCOPED_TRACE(absl::StrCat(config_.name, " seed=", config_.seed, " final check"));
  if (!::testing::Test::HasFailure()) CheckEverything();
  for (const TrackedSnapshot& s : snapshots_)
    EXPECT_TRUE(wire_adapter.For(s.id).ReleaseSnapshot(s.id).ok());
  snapshots_.clear();
  EXPECT_TRUE(wire_adapter.For(cache_id_).DeleteCache(cache_id_).ok());
}

}  // namespace kvcache::testing
