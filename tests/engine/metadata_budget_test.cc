// The metadata budget (engine/metadata_budget.h): caches and snapshots past
// it are RESOURCE_EXHAUSTED naming metadata_bytes and change nothing; every
// charge comes back when its handle goes; and the charges are an upper bound
// of the host memory the handles really take (malloc's own count, measured
// around patterns of every kind), yet not wildly above it.
#include "engine/metadata_budget.h"

#include <malloc.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "chunked_recurrent_test_util.h"
#include "engine_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {
namespace {

using engine::Engine;
using ::testing::HasSubstr;

constexpr uint64_t kPageBytes = 8 << 10;
constexpr uint64_t kBudgetBytes = 16 << 20;
constexpr uint32_t kPageTokens = 4;

// Bytes malloc has handed out and not had back, over every arena.
int64_t HeapInUse() {
  const struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
}

engine::LayerSpec QuantizedLayer() {
  return engine::LayerSpec{.num_kv_heads = 1,
                           .k_head_dim = 32,
                           .kind = engine::QuantizedKind{.group_size = 32, .bits = 8}};
}

// One layer of every kind, repeated to `layers`.
engine::CacheSpec EveryKind(size_t layers) {
  const std::vector<engine::LayerSpec> kinds = {
      StandardLayerSpec(1, 8), RotatingLayerSpec(1, 8, 0, 6, 2), QuantizedLayer(),
      ChunkedLayerSpec(1, 8, 0, 5), RecurrentLayerSpec(2, 4, 1, 2, 2)};
  std::vector<engine::LayerSpec> spec;
  for (size_t i = 0; i < layers; ++i) spec.push_back(kinds[i % kinds.size()]);
  return MakeSpec(spec);
}

class MetadataBudgetTest : public GpuTestBase {
 protected:
  void SetUp() override {
    GpuTestBase::SetUp();
    pool_ = MakePool(kPageBytes, kBudgetBytes);
    ASSERT_NE(pool_, nullptr);
  }
  void TearDown() override {
    if (engine_ != nullptr) {
      ReleaseEverything(*engine_);
      EXPECT_EQ(pool_->stats().used_pages, 0u) << "pages leaked";
      EXPECT_EQ(engine_->Stats().metadata_bytes, baseline_) << "charges not returned";
    }
    engine_.reset();
    pool_.reset();
    GpuTestBase::TearDown();
  }
  void StartEngine(uint64_t metadata_bytes) {
    engine_ = std::make_unique<Engine>(
        *pool_,
        engine::EngineOptions{.page_tokens = kPageTokens, .metadata_bytes = metadata_bytes});
    baseline_ = engine_->Stats().metadata_bytes;
  }
  // Appends `tokens` to every layer of `cache_id` (recurrent layers: a state
  // advanced by `tokens`), from buffers made once per spec.
  void Append(const std::string& cache_id, const engine::CacheSpec& spec, uint64_t tokens) {
    std::mt19937_64 rng(tokens);
    for (uint32_t layer = 0; layer < spec.layers.size(); ++layer) {
      if (engine::IsRecurrent(spec.layers[layer])) {
        const RefState state = RandomState(spec, layer, rng);
        const absl::StatusOr<uint64_t> updated =
            engine_->UpdateState(cache_id, layer, StateInputOf(state, tokens));
        ASSERT_TRUE(updated.ok()) << updated.status();
      } else {
        const KvTensors kv = RandomKv(spec, layer, tokens, rng);
        const absl::StatusOr<uint64_t> updated = engine_->Update(cache_id, layer, kv.input());
        ASSERT_TRUE(updated.ok()) << updated.status();
      }
    }
  }
  uint64_t Used() const { return engine_->Stats().metadata_bytes; }

  std::unique_ptr<gpu::PagePool> pool_;
  std::unique_ptr<Engine> engine_;
  uint64_t baseline_ = 0;
};

TEST_P(MetadataBudgetTest, CachesPastTheBudgetAreRefusedNamingItAndChangeNothing) {
  StartEngine(4 << 20);
  const engine::CacheSpec spec = EveryKind(1024);
  std::vector<std::string> ids;
  absl::StatusOr<engine::CacheInfo> created;
  while ((created = engine_->CreateCache(spec)).ok()) {
    ids.push_back(created->cache_id);
    ASSERT_LT(ids.size(), 100u) << "a 4 MiB budget held 100 caches of 1,024 layers";
  }
  ASSERT_GE(ids.size(), 1u);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(created.status().message(), HasSubstr("metadata_bytes"));
  const engine::EngineStats full = engine_->Stats();
  EXPECT_LE(full.metadata_bytes, full.max_metadata_bytes);
  EXPECT_EQ(full.caches, ids.size());
  EXPECT_FALSE(engine_->CreateCache(spec).ok());
  EXPECT_EQ(engine_->Stats().metadata_bytes, full.metadata_bytes) << "a refusal changed the count";

  ASSERT_TRUE(engine_->DeleteCache(ids.back()).ok());
  EXPECT_LT(Used(), full.metadata_bytes);
  ASSERT_TRUE(engine_->CreateCache(spec).ok()) << "a delete gave no room back";
}

TEST_P(MetadataBudgetTest, SnapshotsPastTheBudgetAreRefusedAndReleasesGiveItBack) {
  StartEngine(3 << 20);
  const engine::CacheSpec spec = EveryKind(256);
  const absl::StatusOr<engine::CacheInfo> cache_or = engine_->CreateCache(spec);
  ASSERT_TRUE(cache_or.ok()) << cache_or.status();
  const engine::CacheInfo& cache = *cache_or;
  Append(cache.cache_id, spec, 3);
  const uint64_t with_cache = Used();
  std::vector<std::string> snapshots;
  absl::StatusOr<engine::SnapshotInfo> taken;
  for (uint64_t step = 0; (taken = engine_->Snapshot(cache.cache_id, 0)).ok(); ++step) {
    snapshots.push_back(taken->snapshot_id);
    Append(cache.cache_id, spec, 1);  // each snapshot comes to own its last chunks
    ASSERT_LT(snapshots.size(), 1000u);
  }
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(taken.status().message(), HasSubstr("metadata_bytes"));
  EXPECT_EQ(engine_->ListSnapshots().size(), snapshots.size()) << "the refusal registered one";

  // A split needs room for both halves while its input still exists.
  const absl::StatusOr<std::pair<engine::SnapshotInfo, engine::SnapshotInfo>> split =
      engine_->SplitSnapshot(snapshots.back(), 2);
  if (!split.ok()) {
    EXPECT_EQ(split.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(split.status().message(), HasSubstr("metadata_bytes"));
    EXPECT_TRUE(engine_->ReleaseSnapshot(snapshots.back()).ok()) << "a refused split consumed it";
    snapshots.pop_back();
  }
  for (const std::string& id : snapshots) ASSERT_TRUE(engine_->ReleaseSnapshot(id).ok());
  if (split.ok()) {
    ASSERT_TRUE(engine_->ReleaseSnapshot(split->first.snapshot_id).ok());
    ASSERT_TRUE(engine_->ReleaseSnapshot(split->second.snapshot_id).ok());
  }
  EXPECT_EQ(Used(), with_cache);
}

TEST_P(MetadataBudgetTest, BatchResultsAreChargedAndRefusedPastTheBudget) {
  const engine::CacheSpec spec =
      MakeSpec(std::vector<engine::LayerSpec>(512, StandardLayerSpec(1, 8)), DType::kFloat16, 2);
  StartEngine(0);
  const uint64_t per_cache = engine::CacheMetadataBytes(spec);
  engine_.reset();
  // Room for the pool's tables, two caches and a little: the third is refused.
  StartEngine(baseline_ + 2 * per_cache + per_cache / 2);
  const absl::StatusOr<engine::CacheInfo> cache_or = engine_->CreateCache(spec);
  ASSERT_TRUE(cache_or.ok()) << cache_or.status();
  const engine::CacheInfo& cache = *cache_or;
  Append(cache.cache_id, spec, 2);
  const absl::StatusOr<engine::CacheInfo> row_or = engine_->ExtractRow(cache.cache_id, 1);
  ASSERT_TRUE(row_or.ok()) << row_or.status();
  const engine::CacheInfo& row = *row_or;
  const absl::StatusOr<engine::CacheInfo> third = engine_->ExtractRow(cache.cache_id, 0);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("metadata_bytes"));
  EXPECT_EQ(engine_->Stats().caches, 2u);
  ASSERT_TRUE(engine_->DeleteCache(row.cache_id).ok());
  const uint32_t keep[] = {1};
  ASSERT_TRUE(engine_->FilterRows(cache.cache_id, keep).ok());
  EXPECT_EQ(Used(),
            baseline_ + engine::CacheMetadataBytes(engine_->GetSpec(cache.cache_id).value()));
}

// What the charges are for: measured with malloc's own count around each
// pattern (pool slabs touched beforehand, so only tables and handles grow).
class MetadataChargeTest : public MetadataBudgetTest {
 protected:
  // Takes every pool page once, so that later patterns allocate no slabs.
  void WarmPool(const engine::CacheSpec& spec) {
    const absl::StatusOr<engine::CacheInfo> cache_or = engine_->CreateCache(spec);
    ASSERT_TRUE(cache_or.ok()) << cache_or.status();
    const engine::CacheInfo& cache = *cache_or;
    for (int i = 0; i < 64 && pool_->available_pages() > 64; ++i) Append(cache.cache_id, spec, 16);
    ASSERT_TRUE(engine_->DeleteCache(cache.cache_id).ok());
    malloc_trim(0);
  }
  // Charged and measured bytes of what `pattern` leaves behind.
  // ... at least what it took, and at most `most_over` times that (0: no
  // upper check).
  template <typename Pattern>
  void ExpectCharged(const char* what, uint64_t most_over, Pattern pattern) {
    const uint64_t charged_before = Used();
    const int64_t heap_before = HeapInUse();
    pattern();
    const int64_t measured = HeapInUse() - heap_before;
    const uint64_t charged = Used() - charged_before;
    std::printf("%-44s measured %10lld  charged %10llu  (%.2fx)\n", what,
                static_cast<long long>(measured), static_cast<unsigned long long>(charged),
                measured > 0 ? static_cast<double>(charged) / measured : 0.0);
    EXPECT_GE(static_cast<int64_t>(charged), measured) << what << ": charged below what it took";
    if (most_over == 0) return;
    EXPECT_LE(charged, most_over * static_cast<uint64_t>(std::max<int64_t>(measured, 1)))
        << what << ": charged far above what it took";
  }
};

// An empty cache is charged the chunk each layer's table takes at its first
// token, so here only the lower bound holds.
TEST_P(MetadataChargeTest, EmptyCachesOfManyLayers) {
  StartEngine(256 << 20);
  const engine::CacheSpec spec = EveryKind(1024);
  WarmPool(EveryKind(5));
  ExpectCharged("200 empty caches of 1,024 layers", /*most_over=*/0, [&] {
    for (int i = 0; i < 200; ++i) ASSERT_TRUE(engine_->CreateCache(spec).ok());
  });
}

TEST_P(MetadataChargeTest, CachesOfManyLayersHoldingATokenEach) {
  StartEngine(256 << 20);
  // A page per layer each: 10 x 150 fit the pool.
  const engine::CacheSpec spec = EveryKind(150);
  WarmPool(EveryKind(5));
  ExpectCharged("10 caches of 150 layers, one token each", /*most_over=*/4, [&] {
    for (int i = 0; i < 10; ++i) {
      const absl::StatusOr<engine::CacheInfo> cache = engine_->CreateCache(spec);
      ASSERT_TRUE(cache.ok()) << cache.status();
      Append(cache->cache_id, spec, 1);
    }
  });
}

TEST_P(MetadataChargeTest, SnapshotsOfAnUnchangingCache) {
  StartEngine(256 << 20);
  const engine::CacheSpec spec = EveryKind(1024);
  WarmPool(EveryKind(5));
  const absl::StatusOr<engine::CacheInfo> cache_or = engine_->CreateCache(spec);
  ASSERT_TRUE(cache_or.ok()) << cache_or.status();
  const engine::CacheInfo& cache = *cache_or;
  Append(cache.cache_id, spec, 3);
  ExpectCharged("300 snapshots of one 1,024-layer cache", /*most_over=*/4, [&] {
    for (int i = 0; i < 300; ++i) ASSERT_TRUE(engine_->Snapshot(cache.cache_id, 0).ok());
  });
}

TEST_P(MetadataChargeTest, SnapshotsEachOwningTheirLastChunks) {
  StartEngine(256 << 20);
  // Each snapshot keeps pages the cache then copies: 20 layers x 60 fit the pool.
  const engine::CacheSpec spec = EveryKind(20);
  WarmPool(EveryKind(5));
  const absl::StatusOr<engine::CacheInfo> cache_or = engine_->CreateCache(spec);
  ASSERT_TRUE(cache_or.ok()) << cache_or.status();
  const engine::CacheInfo& cache = *cache_or;
  Append(cache.cache_id, spec, 3);
  ExpectCharged("60 snapshots of 20 layers, a token appended after each", /*most_over=*/4, [&] {
    for (int i = 0; i < 60; ++i) {
      ASSERT_TRUE(engine_->Snapshot(cache.cache_id, 0).ok());
      Append(cache.cache_id, spec, 1);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(TransferPaths, MetadataBudgetTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });
INSTANTIATE_TEST_SUITE_P(TransferPaths, MetadataChargeTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
