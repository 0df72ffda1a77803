// Every misuse returns the right status and changes nothing: each refused call
// is wrapped in ExpectRefused, which compares a fingerprint of the engine (cache
// offsets, every layer's fetched bytes, snapshots and their bytes, pool pages)
// before and after.
#include <functional>
#include <string>
#include <vector>

#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {
namespace {

using engine::CacheSpec;
using engine::Engine;
using engine::EngineOptions;

constexpr uint64_t kPageBytes = 8 << 10;
constexpr uint64_t kBudgetBytes = 16 << 20;
constexpr char kUnknownId[] = "0123456789abcdef0123456789abcdef";

absl::Status StatusOf(const absl::Status& status) { return status; }
template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& result) {
  return result.status();
}

// A standard layer and a rotating one (window 8, 4 sinks), as a model with
// sliding-window layers has.
CacheSpec MixedSpec() {
  return MakeSpec({StandardLayerSpec(2, 4), RotatingLayerSpec(1, 8, 4, 8, 4)}, DType::kFloat16, 1);
}

class EngineMisuseTest : public GpuTestBase {
 protected:
  void SetUp() override {
    GpuTestBase::SetUp();
    StartEngine(kBudgetBytes, EngineOptions{.page_tokens = 4});
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

  void StartEngine(uint64_t budget_bytes, EngineOptions options) {
    engine_.reset();
    pool_ = MakePool(kPageBytes, budget_bytes);
    ASSERT_NE(pool_, nullptr);
    engine_ = std::make_unique<Engine>(*pool_, options);
  }

  // Runs `call`, expecting `code` (and `message_part` in the message), and
  // that nothing visible changed.
  template <typename Call>
  void ExpectRefused(absl::StatusCode code, const std::string& message_part, Call call) {
    const EngineFingerprint before = Fingerprint(*engine_);
    const absl::Status status = StatusOf(call());
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_NE(std::string(status.message()).find(message_part), std::string::npos)
        << "message \"" << status.message() << "\" should name \"" << message_part << "\"";
    const EngineFingerprint after = Fingerprint(*engine_);
    EXPECT_TRUE(before == after) << "before:\n" << Describe(before) << "\nafter:\n"
                                 << Describe(after);
  }

  // A cache with history and a snapshot, so there is something to disturb.
  std::unique_ptr<MirroredCache> Populated(const CacheSpec& spec, uint64_t tokens) {
    auto cache = std::make_unique<MirroredCache>(*engine_, spec);
    EXPECT_TRUE(cache->Append(tokens));
    RefCacheSnapshotPtr unused;
    EXPECT_NE(cache->Snapshot(0, &unused), "");
    return cache;
  }

  std::unique_ptr<gpu::PagePool> pool_;
  std::unique_ptr<Engine> engine_;
};

struct SpecCase {
  std::string what;
  std::function<void(CacheSpec&)> mutate;
  std::vector<std::string> named;  // substrings the message must contain
};

std::vector<SpecCase> InvalidSpecCases() {
  auto rotating = [](uint32_t max_size, uint32_t keep) {
    return [=](CacheSpec& s) { s.layers[1] = RotatingLayerSpec(1, 8, 4, max_size, keep); };
  };
  return {
      {"no layers", [](CacheSpec& s) { s.layers.clear(); }, {"layers"}},
      {"zero heads", [](CacheSpec& s) { s.layers[1].num_kv_heads = 0; },
       {"layers[1]", "num_kv_heads"}},
      {"zero k head dim", [](CacheSpec& s) { s.layers[1].k_head_dim = 0; },
       {"layers[1]", "k_head_dim"}},
      {"batch 0", [](CacheSpec& s) { s.batch_size = 0; }, {"batch_size"}},
      {"bad dtype", [](CacheSpec& s) { s.dtype = static_cast<DType>(9); }, {"dtype"}},
      {"rotating max_size 0", rotating(0, 0), {"layers[1]", "max_size"}},
      {"keep == max_size", rotating(8, 8), {"layers[1]", "keep"}},
      {"keep > max_size", rotating(8, 12), {"layers[1]", "keep"}},
      // The limits below are those of the engine in the test (SpecLimits).
      {"too many layers", [](CacheSpec& s) { s.layers.resize(5, s.layers[0]); }, {"layers"}},
      {"too many heads", [](CacheSpec& s) { s.layers[1].num_kv_heads = 5; },
       {"layers[1]", "num_kv_heads"}},
      {"k head dim too big", [](CacheSpec& s) { s.layers[1].k_head_dim = 65; },
       {"layers[1]", "k_head_dim"}},
      {"v head dim too big", [](CacheSpec& s) { s.layers[1].v_head_dim = 65; },
       {"layers[1]", "v_head_dim"}},
      {"batch too big", [](CacheSpec& s) { s.batch_size = 9; }, {"batch_size"}},
      {"window too big", rotating(129, 4), {"layers[1]", "max_size"}},
      // 4 heads x (64 + 64) dims x 4 bytes x batch 8: 16 KiB, over one 8 KiB page.
      {"token wider than a page",
       [](CacheSpec& s) {
         s.dtype = DType::kFloat32;
         s.batch_size = 8;
         s.layers[1] = StandardLayerSpec(4, 64, 64);
       },
       {"layers[1]"}},
  };
}

TEST_P(EngineMisuseTest, InvalidSpecsNameTheField) {
  engine::SpecLimits limits{.max_layers = 4, .max_kv_heads = 4, .max_head_dim = 64,
                            .max_batch_size = 8, .max_window = 128};
  StartEngine(kBudgetBytes, EngineOptions{.page_tokens = 4, .limits = limits});
  auto existing = Populated(MixedSpec(), 5);
  for (const SpecCase& c : InvalidSpecCases()) {
    SCOPED_TRACE(c.what);
    CacheSpec spec = MixedSpec();
    c.mutate(spec);
    for (const std::string& name : c.named) {
      ExpectRefused(absl::StatusCode::kInvalidArgument, name,
                    [&] { return engine_->CreateCache(spec); });
    }
  }
}

TEST_P(EngineMisuseTest, UnknownIdsAreNotFound) {
  auto cache = Populated(MixedSpec(), 6);
  const std::string snapshot = engine_->ListSnapshots()[0].snapshot_id;
  std::mt19937_64 rng(1);
  const KvTensors kv = RandomKv(MixedSpec(), 0, 1, rng);
  const auto not_found = absl::StatusCode::kNotFound;
  ExpectRefused(not_found, "", [&] { return engine_->GetCache(kUnknownId); });
  ExpectRefused(not_found, "", [&] { return engine_->DeleteCache(kUnknownId); });
  ExpectRefused(not_found, "", [&] { return engine_->Update(kUnknownId, 0, kv.input()); });
  ExpectRefused(not_found, "", [&] { return engine_->Freeze(kUnknownId, ""); });
  ExpectRefused(not_found, "", [&] { return engine_->Freeze(cache->id(), kUnknownId); });
  ExpectRefused(not_found, "", [&] { return engine_->Trim(kUnknownId, 1); });
  ExpectRefused(not_found, "", [&] { return engine_->Snapshot(kUnknownId, 0); });
  ExpectRefused(not_found, "", [&] { return engine_->Restore(kUnknownId, "", 0); });
  ExpectRefused(not_found, "", [&] { return engine_->Restore(kUnknownId, snapshot, 6); });
  ExpectRefused(not_found, "", [&] { return engine_->Restore(cache->id(), kUnknownId, 6); });
  ExpectRefused(not_found, "", [&] { return engine_->MergeSnapshots(snapshot, kUnknownId); });
  ExpectRefused(not_found, "", [&] { return engine_->MergeSnapshots(kUnknownId, snapshot); });
  ExpectRefused(not_found, "", [&] { return engine_->SplitSnapshot(kUnknownId, 3); });
  ExpectRefused(not_found, "", [&] { return engine_->ReleaseSnapshot(kUnknownId); });
  ExpectRefused(not_found, "", [&] { return engine_->ReleaseSnapshot(""); });
  EXPECT_TRUE(engine_->ListSnapshots(kUnknownId).empty());
}

TEST_P(EngineMisuseTest, MalformedUpdatesAreInvalidArguments) {
  auto cache = Populated(MixedSpec(), 6);
  std::mt19937_64 rng(3);
  const auto invalid = absl::StatusCode::kInvalidArgument;
  KvTensors kv = RandomKv(MixedSpec(), 0, 2, rng);
  ExpectRefused(invalid, "layer", [&] { return engine_->Update(cache->id(), 2, kv.input()); });
  ExpectRefused(invalid, "layer", [&] { return engine_->Update(cache->id(), 99, kv.input()); });

  KvTensors short_keys = kv;
  short_keys.keys.pop_back();
  ExpectRefused(invalid, "keys", [&] { return engine_->Update(cache->id(), 0, short_keys.input()); });
  KvTensors long_values = kv;
  long_values.values.resize(long_values.values.size() + 2);
  ExpectRefused(invalid, "values",
                [&] { return engine_->Update(cache->id(), 0, long_values.input()); });
  // Bytes for 2 tokens declared as 3: both tensors are the wrong size.
  KvTensors miscounted = kv;
  miscounted.tokens = 3;
  ExpectRefused(invalid, "", [&] { return engine_->Update(cache->id(), 0, miscounted.input()); });
  // Layer 1 has other dims (8/4 against 4/4): layer 0's tensors do not fit it.
  ExpectRefused(invalid, "", [&] { return engine_->Update(cache->id(), 1, kv.input()); });

  KvTensors empty = RandomKv(MixedSpec(), 0, 0, rng);
  ExpectRefused(invalid, "", [&] { return engine_->Update(cache->id(), 0, empty.input()); });
}

TEST_P(EngineMisuseTest, UpdateTooLargeIsInvalidArgument) {
  StartEngine(kBudgetBytes, EngineOptions{.page_tokens = 4, .max_update_tokens = 8});
  auto cache = Populated(MixedSpec(), 6);
  std::mt19937_64 rng(4);
  KvTensors kv = RandomKv(MixedSpec(), 0, 9, rng);
  ExpectRefused(absl::StatusCode::kInvalidArgument, "",
                [&] { return engine_->Update(cache->id(), 0, kv.input()); });
}

TEST_P(EngineMisuseTest, ExpectedOffsetMismatchIsFailedPrecondition) {
  auto cache = Populated(MixedSpec(), 6);
  std::mt19937_64 rng(5);
  KvTensors kv = RandomKv(MixedSpec(), 0, 1, rng);
  for (uint64_t wrong : {0, 5, 7, 100}) {
    ExpectRefused(absl::StatusCode::kFailedPrecondition, "",
                  [&] { return engine_->Update(cache->id(), 0, kv.input(), wrong); });
  }
  absl::StatusOr<uint64_t> right = engine_->Update(cache->id(), 0, kv.input(), 6);
  ASSERT_TRUE(right.ok()) << right.status();
  EXPECT_EQ(*right, 7u);
}

TEST_P(EngineMisuseTest, SnapshotNeedsTokensBeyondFrom) {
  MirroredCache empty(*engine_, MixedSpec());
  const auto refused = absl::StatusCode::kFailedPrecondition;
  ExpectRefused(refused, "", [&] { return engine_->Snapshot(empty.id(), 0); });
  auto cache = Populated(MixedSpec(), 6);
  ExpectRefused(refused, "", [&] { return engine_->Snapshot(cache->id(), 6); });
  ExpectRefused(refused, "", [&] { return engine_->Snapshot(cache->id(), 7); });
  EXPECT_TRUE(engine_->Snapshot(cache->id(), 5).ok());
}

TEST_P(EngineMisuseTest, OutOfStepLayersRefuseSnapshotAndTrim) {
  auto cache = Populated(MixedSpec(), 6);
  ASSERT_TRUE(cache->AppendLayer(0, 2));
  absl::StatusOr<engine::CacheInfo> info = engine_->GetCache(cache->id());
  ASSERT_TRUE(info.ok());
  EXPECT_FALSE(info->in_step);
  EXPECT_EQ(info->offset, 6u);
  EXPECT_EQ(info->layer_offsets, (std::vector<uint64_t>{8, 6}));
  const auto refused = absl::StatusCode::kFailedPrecondition;
  ExpectRefused(refused, "", [&] { return engine_->Snapshot(cache->id(), 0); });
  ExpectRefused(refused, "", [&] { return engine_->Trim(cache->id(), 1); });
  ExpectRefused(refused, "", [&] { return engine_->Trim(cache->id(), 0); });
  // Finishing the step puts them back in step.
  ASSERT_TRUE(cache->AppendLayer(1, 2));
  EXPECT_TRUE(engine_->Snapshot(cache->id(), 0).ok());
  EXPECT_TRUE(cache->Matches());
}

// Not a misuse: restoring is how a worker recovers from a torn step.
TEST_P(EngineMisuseTest, RestoreRecoversFromATornStep) {
  MirroredCache cache(*engine_, MixedSpec());
  ASSERT_TRUE(cache.Append(6));
  RefCacheSnapshotPtr reference;
  const std::string snapshot = cache.Snapshot(0, &reference);
  ASSERT_TRUE(cache.AppendLayer(0, 3));
  ASSERT_TRUE(cache.Restore(snapshot, reference.get(), 6));
  absl::StatusOr<engine::CacheInfo> info = engine_->GetCache(cache.id());
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->in_step);
  EXPECT_EQ(info->offset, 6u);
  EXPECT_TRUE(cache.Matches());
}

TEST_P(EngineMisuseTest, WrappedRotatingLayerRefusesTrimAndLiveRewind) {
  auto cache = Populated(MixedSpec(), 6);
  ASSERT_TRUE(cache->Decode(6));  // offset 12 > max_size 8: the window has shifted
  const auto refused = absl::StatusCode::kFailedPrecondition;
  ExpectRefused(refused, "", [&] { return engine_->Trim(cache->id(), 1); });
  ExpectRefused(refused, "", [&] { return engine_->Restore(cache->id(), "", 11); });
  ExpectRefused(refused, "", [&] { return engine_->Restore(cache->id(), "", 0); });
  ExpectRefused(refused, "", [&] { return engine_->Restore(cache->id(), "", 13); });
  // Rewinding to where it is is not a rewind.
  EXPECT_TRUE(cache->Restore("", nullptr, 12));
  EXPECT_TRUE(cache->Matches());
}

TEST_P(EngineMisuseTest, UnreachableRestoresAreRefused) {
  auto cache = Populated(MixedSpec(), 5);
  const auto refused = absl::StatusCode::kFailedPrecondition;
  ExpectRefused(refused, "", [&] { return engine_->Restore(cache->id(), "", 6); });

  // A wrapped rotating snapshot cannot be clamped: the window would be incomplete.
  ASSERT_TRUE(cache->Append(7));  // offset 12
  RefCacheSnapshotPtr wrapped;
  const std::string wrapped_id = cache->Snapshot(0, &wrapped);
  ExpectRefused(refused, "", [&] { return engine_->Restore(cache->id(), wrapped_id, 11); });
  ExpectRefused(refused, "", [&] { return engine_->Restore(cache->id(), wrapped_id, 13); });
  EXPECT_TRUE(cache->Restore(wrapped_id, wrapped.get(), 12));

  // A standard snapshot [from, to) restores only onto a live prefix of at least from.
  MirroredCache standard(*engine_, MakeSpec({StandardLayerSpec(1, 4)}));
  ASSERT_TRUE(standard.Append(10));
  RefCacheSnapshotPtr tail;
  const std::string tail_id = standard.Snapshot(6, &tail);
  ASSERT_TRUE(engine_->Trim(standard.id(), 6).ok());  // offset 4 < from 6
  ASSERT_TRUE(standard.reference().Trim(6).has_value());
  ExpectRefused(refused, "", [&] { return engine_->Restore(standard.id(), tail_id, 10); });
  ExpectRefused(refused, "", [&] { return engine_->Restore(standard.id(), tail_id, 8); });
  ASSERT_TRUE(standard.Append(3));  // offset 7 >= from: reachable again
  EXPECT_TRUE(standard.Restore(tail_id, tail.get(), 9));
  EXPECT_TRUE(standard.Matches());
}

TEST_P(EngineMisuseTest, RestoreOfAnotherLayoutIsRefused) {
  auto source = Populated(MixedSpec(), 6);
  const std::string snapshot = engine_->ListSnapshots(source->id())[0].snapshot_id;
  std::vector<CacheSpec> others = {MixedSpec(), MixedSpec(), MixedSpec(), MixedSpec(),
                                   MakeSpec({StandardLayerSpec(2, 4)})};
  others[0].dtype = DType::kBFloat16;
  others[1].batch_size = 2;
  others[2].layers[1] = RotatingLayerSpec(1, 8, 4, 8, 0);  // other keep
  others[3].layers[0].v_head_dim = 8;
  for (const CacheSpec& spec : others) {
    MirroredCache target(*engine_, spec);
    ASSERT_TRUE(target.Append(6));
    ExpectRefused(absl::StatusCode::kFailedPrecondition, "",
                  [&] { return engine_->Restore(target.id(), snapshot, 6); });
  }
}

TEST_P(EngineMisuseTest, MergeAndSplitRefusals) {
  MirroredCache cache(*engine_, MixedSpec());
  ASSERT_TRUE(cache.Append(5));
  RefCacheSnapshotPtr unused;
  const std::string first = cache.Snapshot(0, &unused);  // [0, 5)
  ASSERT_TRUE(cache.Append(4));
  const std::string gap = cache.Snapshot(6, &unused);    // [6, 9)
  const std::string whole = cache.Snapshot(2, &unused);  // [2, 9)
  MirroredCache other(*engine_, MakeSpec({StandardLayerSpec(2, 4), StandardLayerSpec(1, 8)}));
  ASSERT_TRUE(other.Append(9));
  const std::string other_layout = other.Snapshot(5, &unused);  // [5, 9), another layout

  const auto refused = absl::StatusCode::kFailedPrecondition;
  ExpectRefused(refused, "", [&] { return engine_->MergeSnapshots(first, gap); });
  ExpectRefused(refused, "", [&] { return engine_->MergeSnapshots(gap, first); });
  ExpectRefused(refused, "", [&] { return engine_->MergeSnapshots(first, whole); });
  ExpectRefused(refused, "", [&] { return engine_->MergeSnapshots(first, first); });
  ExpectRefused(refused, "", [&] { return engine_->MergeSnapshots(first, other_layout); });
  for (uint64_t at : {0, 1, 2, 9, 10, 1000}) {
    ExpectRefused(refused, "", [&] { return engine_->SplitSnapshot(whole, at); });
  }
  EXPECT_TRUE(engine_->SplitSnapshot(whole, 3).ok());
}

// The pool holds 4 pages of 2 tokens: updates, copy-on-write and restores
// that need more are RESOURCE_EXHAUSTED and leave everything as it was.
TEST_P(EngineMisuseTest, PoolExhaustionChangesNothing) {
  StartEngine(4 * kPageBytes, EngineOptions{.page_tokens = 2});
  MirroredCache cache(*engine_, MakeSpec({StandardLayerSpec(1, 4)}));
  ASSERT_TRUE(cache.Append(5));  // 3 pages
  std::mt19937_64 rng(6);
  KvTensors four = RandomKv(cache.spec(), 0, 4, rng);
  const auto exhausted = absl::StatusCode::kResourceExhausted;
  ExpectRefused(exhausted, "", [&] { return engine_->Update(cache.id(), 0, four.input()); });
  ASSERT_TRUE(cache.Append(2));  // offset 7: 4 pages, the whole pool
  EXPECT_EQ(pool_->stats().used_pages, 4u);
  RefCacheSnapshotPtr snapshot;
  const std::string snapshot_id = cache.Snapshot(0, &snapshot);
  // Rewriting position 6, which the snapshot holds, needs a copy of its page:
  // there is no room for one.
  ASSERT_TRUE(cache.Restore("", nullptr, 6));
  KvTensors one = RandomKv(cache.spec(), 0, 1, rng);
  ExpectRefused(exhausted, "", [&] { return engine_->Update(cache.id(), 0, one.input()); });
  ASSERT_TRUE(engine_->ReleaseSnapshot(snapshot_id).ok());
  ASSERT_TRUE(cache.Append(1));
  EXPECT_TRUE(cache.Matches());
}

TEST_P(EngineMisuseTest, SnapshotsSurviveDeleteCache) {
  const CacheSpec spec = MixedSpec();
  auto source = std::make_unique<MirroredCache>(*engine_, spec, 11);
  ASSERT_TRUE(source->Append(7));
  ASSERT_TRUE(source->Decode(5));  // offset 12: the rotating layer has wrapped
  RefCacheSnapshotPtr reference;
  const std::string snapshot = source->Snapshot(3, &reference);
  ASSERT_TRUE(engine_->DeleteCache(source->id()).ok());
  EXPECT_EQ(engine_->GetCache(source->id()).status().code(), absl::StatusCode::kNotFound);

  ASSERT_EQ(engine_->ListSnapshots().size(), 1u);
  EXPECT_EQ(engine_->ListSnapshots()[0].cache_id, source->id());
  EXPECT_TRUE(SnapshotMatches(*engine_, snapshot, *reference));

  // A fresh cache with the same spec cannot take [3, 12) onto an empty prefix
  // (the standard layer needs offset >= 3), but can after 3 tokens of its own.
  MirroredCache target(*engine_, spec, 12);
  ExpectRefused(absl::StatusCode::kFailedPrecondition, "",
                [&] { return engine_->Restore(target.id(), snapshot, 12); });
  ASSERT_TRUE(target.Append(3));
  EXPECT_TRUE(target.Restore(snapshot, reference.get(), 12));
  EXPECT_TRUE(target.Matches());
  EXPECT_TRUE(SnapshotMatches(*engine_, snapshot, *reference));
}

INSTANTIATE_TEST_SUITE_P(TransferPaths, EngineMisuseTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
