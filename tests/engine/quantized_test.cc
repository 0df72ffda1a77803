// Quantized layers (mlx-lm QuantizedKVCache) through the engine, on every
// transfer path: fetches against the CPU reference (packed byte for byte,
// dequantized as the CPU dequantizes, and within one quantization step of the
// input), zero-copy snapshots of quantized pages with copy-on-write, refusals
// that change nothing, and the memory a quantized cache takes.
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "engine_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference_quantized.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {
namespace {

using engine::CacheSpec;
using engine::Engine;
using ::testing::HasSubstr;

constexpr uint64_t kPageBytes = 16 << 10;
constexpr uint64_t kBudgetBytes = 32 << 20;

engine::LayerSpec QuantizedLayerSpec(uint32_t heads, uint32_t k_dim, uint32_t v_dim, uint32_t group,
                                     uint32_t bits) {
  return {.num_kv_heads = heads,
          .k_head_dim = k_dim,
          .v_head_dim = v_dim,
          .kind = engine::QuantizedKind{.group_size = group, .bits = bits}};
}

// A quantized layer (Dk != Dv) and a standard one, batch 2.
CacheSpec MixedSpec(DType dtype = DType::kBFloat16) {
  return MakeSpec({QuantizedLayerSpec(2, 64, 32, 32, 4), StandardLayerSpec(1, 8)}, dtype, 2);
}

class QuantizedEngineTest : public GpuTestBase {
 protected:
  void SetUp() override {
    GpuTestBase::SetUp();
    pool_ = MakePool(kPageBytes, kBudgetBytes);
    ASSERT_NE(pool_, nullptr);
    engine_ = std::make_unique<Engine>(*pool_, engine::EngineOptions{.page_tokens = 4});
  }
  void TearDown() override {
    if (engine_ != nullptr) {
      ReleaseEverything(*engine_);
      EXPECT_EQ(pool_->stats().used_pages, 0u) << "pages leaked";
    }
    engine_.reset();
    pool_.reset();
    GpuTestBase::TearDown();
  }

  std::string Create(const CacheSpec& spec) {
    absl::StatusOr<engine::CacheInfo> info = engine_->CreateCache(spec);
    EXPECT_TRUE(info.ok()) << info.status();
    reference_ = std::make_unique<RefCache>(spec);
    return info.ok() ? info->cache_id : "";
  }

  // `tokens` tokens into every layer of `id`, mirrored in the reference.
  void Append(const std::string& id, uint64_t tokens) {
    for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
      const KvTensors kv = RandomLayerKv(reference_->spec(), layer, tokens, rng_);
      ASSERT_TRUE(engine_->Update(id, layer, kv.input()).ok());
      reference_->Update(
          layer, TokensFromTensors(ShapeOf(reference_->spec(), layer), kv.keys, kv.values, tokens));
    }
  }

  ::testing::AssertionResult Matches(const std::string& cache_id, const std::string& snapshot_id,
                                     const RefCacheSnapshot* snapshot) {
    auto view = engine_->Freeze(cache_id, snapshot_id);
    if (!view.ok()) return ::testing::AssertionFailure() << view.status();
    for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
      absl::StatusOr<std::vector<RefToken>> actual = FetchStoredLayer(**view, layer, kEverything);
      if (!actual.ok()) return ::testing::AssertionFailure() << actual.status();
      const std::vector<RefToken> expected = snapshot == nullptr
                                                 ? reference_->layer(layer).Fetch()
                                                 : RefCache::FetchSnapshot(*snapshot, layer);
      if (auto same = SameTokens(expected, *actual); !same)
        return same << " (layer " << layer << ")";
    }
    return ::testing::AssertionSuccess();
  }

  int64_t UsedPages() const { return pool_->stats().used_pages; }

  std::unique_ptr<gpu::PagePool> pool_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<RefCache> reference_;
  std::mt19937_64 rng_{5};
};

TEST_P(QuantizedEngineTest, FetchesMatchTheReferenceForEveryFormat) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (uint32_t group : {32u, 64u, 128u}) {
      for (uint32_t bits : {4u, 8u}) {
        SCOPED_TRACE(::testing::Message()
                     << DTypeName(dtype).data() << " g" << group << " b" << bits);
        const std::string id =
            Create(MakeSpec({QuantizedLayerSpec(1, 128, 256, group, bits)}, dtype, 1));
        Append(id, 7);
        Append(id, 1);
        EXPECT_TRUE(Matches(id, "", nullptr));
        ASSERT_TRUE(engine_->DeleteCache(id).ok());
      }
    }
  }
}

// mlx's affine accuracy bound (within one quantization step), against the values sent rather than the reference.
TEST_P(QuantizedEngineTest, DequantizedValuesLieWithinOneStepOfTheInput) {
  const CacheSpec spec = MakeSpec({QuantizedLayerSpec(2, 64, 64, 64, 4)}, DType::kFloat16, 1);
  const std::string id = Create(spec);
  const KvTensors kv = RandomLayerKv(spec, 0, 9, rng_);
  ASSERT_TRUE(engine_->Update(id, 0, kv.input()).ok());
  auto view = engine_->Freeze(id, "");
  ASSERT_TRUE(view.ok());
  std::vector<std::byte> keys(kv.keys.size()), values(kv.values.size());
  ASSERT_TRUE((*view)->Read(0, {0, 9}, {absl::MakeSpan(keys), absl::MakeSpan(values)}).ok());
  const RefQuantFormat f{DType::kFloat16, 64, 4};
  const RefPacked packed = RefQuantize(f, kv.keys);
  for (size_t i = 0; i < keys.size() / 2; ++i) {
    const float x = RefLoad(f.dtype, kv.keys.data() + 2 * i);
    const float y = RefLoad(f.dtype, keys.data() + 2 * i);
    const float scale = RefLoad(f.dtype, packed.scales.data() + i / 64 * 2);
    const float bias = RefLoad(f.dtype, packed.biases.data() + i / 64 * 2);
    ASSERT_LE(std::abs(double{x} - y), RefErrorBound(f, scale, bias, x)) << "key value " << i;
  }
}

// Snapshot shares the pages; appending past its end writes the shared page in
// place (token_store.h AppendRight); a write over positions it holds copies the
// one shared page it touches; restore and merge share again (at most one
// boundary page each).
TEST_P(QuantizedEngineTest, SnapshotsShareQuantizedPages) {
  const std::string id = Create(MixedSpec());
  Append(id, 50);  // 13 pages a layer, the last one half full
  const int64_t filled = UsedPages();
  RefCacheSnapshotPtr whole = reference_->Snapshot(0);
  const std::string whole_id = engine_->Snapshot(id, 0)->snapshot_id;
  EXPECT_EQ(UsedPages(), filled) << "Snapshot copied pages";
  Append(id, 1);
  EXPECT_EQ(UsedPages(), filled) << "appending past the snapshot copied its page";
  EXPECT_TRUE(Matches("", whole_id, whole.get())) << "the write reached the snapshot";
  ASSERT_TRUE(engine_->Restore(id, "", 49).ok());  // back over position 49, which it holds
  ASSERT_TRUE(reference_->Restore(nullptr, 49));
  Append(id, 2);
  EXPECT_EQ(UsedPages(), filled + 2) << "one copy-on-write page per layer";
  EXPECT_TRUE(Matches("", whole_id, whole.get())) << "the write reached the snapshot";
  EXPECT_TRUE(Matches(id, "", nullptr));
  ASSERT_TRUE(engine_->Restore(id, whole_id, 50).ok());
  ASSERT_TRUE(reference_->Restore(whole.get(), 50));
  EXPECT_EQ(UsedPages(), filled) << "Restore copied pages";
  EXPECT_TRUE(Matches(id, "", nullptr));
  // [0, 22) + [22, 50): 22 ends mid-page, so the merge joins one page a layer.
  RefCacheSnapshotPtr lower = reference_->Snapshot(0);
  auto split = engine_->SplitSnapshot(whole_id, 22);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(UsedPages(), filled) << "Split copied pages";
  auto merged = engine_->MergeSnapshots(split->first.snapshot_id, split->second.snapshot_id);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_LE(UsedPages(), filled + 2) << "Merge copied more than a boundary page a layer";
  EXPECT_TRUE(Matches("", merged->snapshot_id, lower.get()));
}

TEST_P(QuantizedEngineTest, RefusedUpdatesChangeNothing) {
  const std::string id = Create(MixedSpec(DType::kFloat16));
  Append(id, 6);
  const EngineFingerprint before = Fingerprint(*engine_);
  KvTensors kv = RandomLayerKv(reference_->spec(), 0, 3, rng_);
  kv.keys.pop_back();
  absl::Status status = engine_->Update(id, 0, kv.input()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("keys"));
  // More tokens than the pool has pages for.
  const uint64_t too_many = kBudgetBytes / kPageBytes * 4 + 8;
  const KvTensors huge = RandomLayerKv(reference_->spec(), 0, too_many, rng_);
  status = engine_->Update(id, 0, huge.input()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_EQ(Fingerprint(*engine_), before) << Describe(Fingerprint(*engine_));
  EXPECT_TRUE(Matches(id, "", nullptr));
}

TEST_P(QuantizedEngineTest, ReadPackedRefusesBadBuffersRangesAndLayers) {
  const std::string id = Create(MixedSpec());
  Append(id, 5);
  auto view = engine_->Freeze(id, "");
  ASSERT_TRUE(view.ok());
  // Layer 0: 2 rows x 2 heads, Dk 64 and Dv 32 at 4 bits, group 32, bf16.
  const uint64_t rows = 2 * 2 * 3;
  std::vector<std::byte> kw(rows * 32), ks(rows * 4), kb(rows * 4), vw(rows * 16), vs(rows * 2),
      vb(rows * 2);
  const auto out = [&] {
    return engine::PackedOutput{{absl::MakeSpan(kw), absl::MakeSpan(ks), absl::MakeSpan(kb)},
                                {absl::MakeSpan(vw), absl::MakeSpan(vs), absl::MakeSpan(vb)}};
  };
  EXPECT_TRUE((*view)->ReadPacked(0, {1, 4}, out()).ok());
  vs.pop_back();
  absl::Status status = (*view)->ReadPacked(0, {1, 4}, out());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("values.scales"));
  vs.push_back(std::byte{0});
  status = (*view)->ReadPacked(0, {3, 6}, out());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("not held"));
  status = (*view)->ReadPacked(1, {1, 4}, out());  // the standard layer
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("packed"));
}

// Planes start 4-byte aligned only if pages do.
TEST_P(QuantizedEngineTest, PagesOfOddSizesAreRefused) {
  auto pool = MakePool(kPageBytes + 2, 1 << 20);
  ASSERT_NE(pool, nullptr);
  Engine engine(*pool, engine::EngineOptions{.page_tokens = 4});
  const absl::Status status = engine.CreateCache(MixedSpec()).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("multiple of 4 bytes"));
  EXPECT_TRUE(engine.ListCaches().empty());
  EXPECT_EQ(pool->stats().used_pages, 0u);
}

// A token of a quantized layer takes (bits/16 + 2/group) of its f16 bytes, and
// the cache exactly the pages that many bytes a token need (pages fill up to
// their byte size; bench/engine measures the ratio at 32k tokens).
TEST_P(QuantizedEngineTest, QuantizedCachesTakeTheBoundsBytes) {
  Engine engine(*pool_, engine::EngineOptions{.page_tokens = 1024});
  constexpr uint64_t kTokens = 64;
  for (uint32_t bits : {4u, 8u}) {
    SCOPED_TRACE(::testing::Message() << "bits " << bits);
    const CacheSpec quantized = MakeSpec({QuantizedLayerSpec(8, 128, 128, 64, bits)});
    const CacheSpec plain = MakeSpec({StandardLayerSpec(8, 128)});
    const auto q = engine::GeometryFor(quantized, 0, kPageBytes, 1024);
    const auto s = engine::GeometryFor(plain, 0, kPageBytes, 1024);
    ASSERT_TRUE(q.ok() && s.ok());
    EXPECT_DOUBLE_EQ(static_cast<double>(q->token_bytes()) / s->token_bytes(),
                     bits / 16.0 + 2.0 / 64);
    for (const CacheSpec* spec : {&quantized, &plain}) {
      const std::string id = engine.CreateCache(*spec)->cache_id;
      const KvTensors kv = RandomLayerKv(*spec, 0, kTokens, rng_);
      ASSERT_TRUE(engine.Update(id, 0, kv.input()).ok());
      const auto& g = spec == &quantized ? *q : *s;
      const uint64_t pages = (kTokens + g.page_tokens - 1) / g.page_tokens;
      EXPECT_EQ(engine.GetCache(id)->size_bytes, pages * kPageBytes);
      EXPECT_EQ(g.page_tokens, kPageBytes / g.token_bytes());
      ASSERT_TRUE(engine.DeleteCache(id).ok());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllPaths, QuantizedEngineTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
