#include "engine_test_util.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvcache::testing {

uint64_t LongestUsefulUpdate(const engine::CacheSpec& spec) {
  uint64_t largest_window = 0;
  for (const engine::LayerSpec& layer : spec.layers) {
    if (const auto* rotating = std::get_if<engine::RotatingKind>(&layer.kind)) {
      largest_window = std::max<uint64_t>(largest_window, rotating->max_size);
    }
  }
  return largest_window > 0 ? 2 * largest_window + 3 : 24;
}

engine::LayerSpec StandardLayerSpec(uint32_t heads, uint32_t k_dim, uint32_t v_dim) {
  return engine::LayerSpec{.num_kv_heads = heads, .k_head_dim = k_dim, .v_head_dim = v_dim,
                           .kind = engine::StandardKind{}};
}

engine::LayerSpec RotatingLayerSpec(uint32_t heads, uint32_t k_dim, uint32_t v_dim,
                                    uint32_t max_size, uint32_t keep) {
  return engine::LayerSpec{.num_kv_heads = heads, .k_head_dim = k_dim, .v_head_dim = v_dim,
                           .kind = engine::RotatingKind{.max_size = max_size, .keep = keep}};
}

engine::CacheSpec MakeSpec(std::vector<engine::LayerSpec> layers, DType dtype,
                           uint32_t batch_size) {
  engine::CacheSpec spec;
  spec.layers = std::move(layers);
  spec.dtype = dtype;
  spec.batch_size = batch_size;
  spec.model = "test-model";
  return spec;
}

namespace {
void FillRandom(std::vector<std::byte>& bytes, std::mt19937_64& rng) {
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    const uint64_t word = rng();
    std::memcpy(bytes.data() + i, &word, 8);
  }
  for (; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(rng());
}
}  // namespace

KvTensors RandomKv(const RefShape& shape, uint64_t tokens, std::mt19937_64& rng) {
  KvTensors kv;
  kv.tokens = tokens;
  kv.keys.resize(shape.KTensorBytes(tokens));
  kv.values.resize(shape.VTensorBytes(tokens));
  FillRandom(kv.keys, rng);
  FillRandom(kv.values, rng);
  return kv;
}

KvTensors RandomKv(const engine::CacheSpec& spec, size_t layer, uint64_t tokens,
                   std::mt19937_64& rng) {
  return RandomKv(ShapeOf(spec, layer), tokens, rng);
}

absl::StatusOr<std::vector<RefToken>> ReadRange(const engine::CacheSnapshot& view, uint32_t layer,
                                                engine::TokenRange range) {
  const RefShape shape = ShapeOf(view.spec, layer);
  // Fill with a pattern so bytes the engine fails to write are visible.
  std::vector<std::byte> keys(shape.KTensorBytes(range.size()), std::byte{0xA5});
  std::vector<std::byte> values(shape.VTensorBytes(range.size()), std::byte{0x5A});
  absl::Status status = view.Read(layer, range, engine::KvOutput{absl::MakeSpan(keys), absl::MakeSpan(values)});
  if (!status.ok()) return status;
  std::vector<RefToken> tokens = TokensFromTensors(shape, keys, values, range.size());
  for (uint64_t i = 0; i < tokens.size(); ++i) tokens[i].position = range.begin + i;
  return tokens;
}

absl::StatusOr<std::vector<RefToken>> FetchLayer(const engine::CacheSnapshot& view, uint32_t layer,
                                                 engine::TokenRange window) {
  std::vector<RefToken> tokens;
  for (const engine::TokenRange& range : view.Ranges(layer, window)) {
    absl::StatusOr<std::vector<RefToken>> part = ReadRange(view, layer, range);
    if (!part.ok()) return part.status();
    for (RefToken& token : *part) tokens.push_back(std::move(token));
  }
  return tokens;
}

std::vector<RefToken> Clip(const std::vector<RefToken>& tokens, engine::TokenRange window) {
  std::vector<RefToken> out;
  for (const RefToken& token : tokens) {
    if (token.position >= window.begin && token.position < window.end) out.push_back(token);
  }
  return out;
}

std::string RangesString(const std::vector<engine::TokenRange>& ranges) {
  return absl::StrCat(
      "{", absl::StrJoin(ranges, ", ", [](std::string* out, const engine::TokenRange& r) {
        absl::StrAppend(out, "[", r.begin, ",", r.end, ")");
      }), "}");
}

::testing::AssertionResult SameTokens(const std::vector<RefToken>& expected,
                                      const std::vector<RefToken>& actual) {
  const std::string ranges = absl::StrCat("expected ranges ", RangesString(RangesOf(expected)),
                                          ", actual ", RangesString(RangesOf(actual)));
  if (expected.size() != actual.size()) {
    return ::testing::AssertionFailure()
           << "token count " << actual.size() << " != expected " << expected.size() << "; "
           << ranges;
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    const RefToken& e = expected[i];
    const RefToken& a = actual[i];
    if (e.position != a.position) {
      return ::testing::AssertionFailure() << "token " << i << " at position " << a.position
                                           << ", expected " << e.position << "; " << ranges;
    }
    if (e.keys != a.keys || e.values != a.values) {
      return ::testing::AssertionFailure()
             << "bytes of position " << e.position << " differ (" << (e.keys != a.keys ? "K" : "")
             << (e.values != a.values ? "V" : "") << "); " << ranges;
    }
  }
  return ::testing::AssertionSuccess();
}

namespace {

std::vector<EngineFingerprint::Layer> FingerprintLayers(const engine::CacheSnapshot& view) {
  std::vector<EngineFingerprint::Layer> layers;
  for (uint32_t l = 0; l < view.spec.layers.size(); ++l) {
    EngineFingerprint::Layer layer;
    layer.ranges = view.Ranges(l, kEverything);
    absl::StatusOr<std::vector<RefToken>> tokens = FetchLayer(view, l, kEverything);
    if (tokens.ok()) {
      TensorsFromTokens(ShapeOf(view.spec, l), *tokens, layer.keys, layer.values);
    } else {
      layer.ranges.push_back({0, 0});  // marks an unreadable layer
    }
    layers.push_back(std::move(layer));
  }
  return layers;
}

}  // namespace

EngineFingerprint Fingerprint(engine::Engine& engine) {
  EngineFingerprint fingerprint;
  for (const engine::CacheInfo& info : engine.ListCaches()) {
    EngineFingerprint::Entry entry{.id = info.cache_id, .cache_id = info.cache_id,
                                   .offsets = info.layer_offsets};
    if (auto view = engine.Freeze(info.cache_id, ""); view.ok())
      entry.layers = FingerprintLayers(**view);
    fingerprint.caches.push_back(std::move(entry));
  }
  for (const engine::SnapshotInfo& info : engine.ListSnapshots()) {
    EngineFingerprint::Entry entry{.id = info.snapshot_id, .cache_id = info.cache_id,
                                   .offsets = {info.from_offset, info.to_offset}};
    if (auto view = engine.Freeze("", info.snapshot_id); view.ok()) {
      entry.layers = FingerprintLayers(**view);
    }
    fingerprint.snapshots.push_back(std::move(entry));
  }
  auto by_id = [](const auto& a, const auto& b) { return a.id < b.id; };
  std::sort(fingerprint.caches.begin(), fingerprint.caches.end(), by_id);
  std::sort(fingerprint.snapshots.begin(), fingerprint.snapshots.end(), by_id);
  fingerprint.used_pages = engine.pool().stats().used_pages;
  return fingerprint;
}

std::string Describe(const EngineFingerprint& fingerprint) {
  std::string out = absl::StrCat("used_pages=", fingerprint.used_pages);
  for (const auto& c : fingerprint.caches) {
    absl::StrAppend(&out, "\n cache ", c.id, " offsets {", absl::StrJoin(c.offsets, ","), "}");
    for (const auto& l : c.layers) absl::StrAppend(&out, " ", RangesString(l.ranges));
  }
  for (const auto& s : fingerprint.snapshots) {
    absl::StrAppend(&out, "\n snapshot ", s.id, " of ", s.cache_id, " [",
                    absl::StrJoin(s.offsets, ","), ")");
    for (const auto& l : s.layers) absl::StrAppend(&out, " ", RangesString(l.ranges));
  }
  return out;
}

void ReleaseEverything(engine::Engine& engine) {
  for (const engine::SnapshotInfo& info : engine.ListSnapshots()) {
    EXPECT_TRUE(engine.ReleaseSnapshot(info.snapshot_id).ok());
  }
  for (const engine::CacheInfo& info : engine.ListCaches()) {
    EXPECT_TRUE(engine.DeleteCache(info.cache_id).ok());
  }
}

}  // namespace kvcache::testing

namespace kvcache::testing {

MirroredCache::MirroredCache(engine::Engine& engine, const engine::CacheSpec& spec, uint64_t seed)
    : engine_(engine), spec_(spec), reference_(spec), rng_(seed) {
  absl::StatusOr<engine::CacheInfo> info = engine_.CreateCache(spec);
  EXPECT_TRUE(info.ok()) << info.status();
  if (info.ok()) id_ = info->cache_id;
}

::testing::AssertionResult MirroredCache::AppendLayer(uint32_t layer, uint64_t tokens) {
  const KvTensors kv = RandomKv(spec_, layer, tokens, rng_);
  absl::StatusOr<uint64_t> result = engine_.Update(id_, layer, kv.input());
  if (!result.ok()) {
    return ::testing::AssertionFailure() << "Update layer " << layer << ": " << result.status();
  }
  reference_.Update(layer, TokensFromTensors(ShapeOf(spec_, layer), kv.keys, kv.values, tokens));
  if (*result != reference_.layer(layer).offset()) {
    return ::testing::AssertionFailure() << "layer " << layer << " offset " << *result
                                         << ", reference " << reference_.layer(layer).offset();
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult MirroredCache::Append(uint64_t tokens) {
  for (uint32_t layer = 0; layer < spec_.layers.size(); ++layer) {
    ::testing::AssertionResult result = AppendLayer(layer, tokens);
    if (!result) return result;
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult MirroredCache::Decode(uint64_t steps) {
  for (uint64_t i = 0; i < steps; ++i) {
    ::testing::AssertionResult result = Append(1);
    if (!result) return result;
  }
  return ::testing::AssertionSuccess();
}

std::string MirroredCache::Snapshot(uint64_t from, RefCacheSnapshotPtr* reference) {
  absl::StatusOr<engine::SnapshotInfo> info = engine_.Snapshot(id_, from);
  EXPECT_TRUE(info.ok()) << info.status();
  *reference = reference_.Snapshot(from);
  EXPECT_NE(*reference, nullptr) << "the reference refuses Snapshot(" << from << ")";
  if (!info.ok() || *reference == nullptr) return "";
  EXPECT_EQ(info->from_offset, (*reference)->from);
  EXPECT_EQ(info->to_offset, (*reference)->to);
  return info->snapshot_id;
}

::testing::AssertionResult MirroredCache::Restore(const std::string& snapshot_id,
                                                  const RefCacheSnapshot* reference,
                                                  uint64_t target) {
  const bool expected = reference_.Restore(reference, target);
  absl::StatusOr<engine::CacheInfo> result = engine_.Restore(id_, snapshot_id, target);
  if (result.ok() != expected) {
    return ::testing::AssertionFailure() << "Restore to " << target << ": engine "
                                         << result.status() << ", reference "
                                         << (expected ? "succeeds" : "refuses");
  }
  if (result.ok() && result->layer_offsets != reference_.layer_offsets()) {
    return ::testing::AssertionFailure() << "offsets differ after Restore to " << target;
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult MirroredCache::Matches() {
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view = engine_.Freeze(id_, "");
  if (!view.ok()) return ::testing::AssertionFailure() << "Freeze: " << view.status();
  for (uint32_t layer = 0; layer < spec_.layers.size(); ++layer) {
    absl::StatusOr<std::vector<RefToken>> actual = FetchLayer(**view, layer, kEverything);
    if (!actual.ok()) return ::testing::AssertionFailure() << "fetch: " << actual.status();
    ::testing::AssertionResult same = SameTokens(reference_.layer(layer).Fetch(), *actual);
    if (!same) return same << " (live layer " << layer << ")";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult SnapshotMatches(engine::Engine& engine, const std::string& snapshot_id,
                                           const RefCacheSnapshot& reference) {
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view =
      engine.Freeze("", snapshot_id);
  if (!view.ok()) return ::testing::AssertionFailure() << "Freeze: " << view.status();
  for (uint32_t layer = 0; layer < reference.spec.layers.size(); ++layer) {
    absl::StatusOr<std::vector<RefToken>> actual = FetchLayer(**view, layer, kEverything);
    if (!actual.ok()) return ::testing::AssertionFailure() << "fetch: " << actual.status();
    ::testing::AssertionResult same =
        SameTokens(RefCache::FetchSnapshot(reference, layer), *actual);
    if (!same) return same << " (snapshot layer " << layer << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace kvcache::testing
