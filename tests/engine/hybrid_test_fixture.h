// The fixture shared by the chunked, recurrent and mixed-layout tests: an
// engine over a small pool (4-token pages, 4 KiB) whose pages must all be free
// again after each test, and helpers that act on the engine and the CPU
// reference together (snapshot, merge, split) and check refusals change nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "chunked_recurrent_test_util.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {

inline constexpr uint64_t kHybridPageBytes = 4 << 10;
inline constexpr uint64_t kHybridBudgetBytes = 32 << 20;
inline constexpr uint32_t kHybridPageTokens = 4;

// conv 3 x 20 and delta 4 x 16 x 32 in float32 at batch 1: 240 + 8192 bytes,
// three 4 KiB pages, both parts crossing page ends.
inline engine::LayerSpec ThreePageState() { return RecurrentLayerSpec(3, 20, 4, 16, 32); }
inline engine::LayerSpec SmallState() { return RecurrentLayerSpec(2, 4, 1, 2, 2); }

inline ::testing::AssertionResult Mentions(const absl::Status& status, const std::string& text) {
  if (std::string(status.message()).find(text) != std::string::npos) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << status << " does not mention \"" << text << "\"";
}

class HybridEngineTest : public GpuTestBase {
 protected:
  void SetUp() override {
    GpuTestBase::SetUp();
    pool_ = MakePool(kHybridPageBytes, kHybridBudgetBytes);
    ASSERT_NE(pool_, nullptr);
    engine_ = std::make_unique<engine::Engine>(
        *pool_, engine::EngineOptions{.page_tokens = kHybridPageTokens});
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

  int64_t UsedPages() const { return pool_->stats().used_pages; }

  std::vector<engine::TokenRange> LiveRanges(const std::string& id, uint32_t layer) {
    auto view = engine_->Freeze(id, "");
    EXPECT_TRUE(view.ok()) << view.status();
    return view.ok() ? (*view)->Ranges(layer, kEverything) : std::vector<engine::TokenRange>{};
  }

  // `status` is FAILED_PRECONDITION naming `reason`, and nothing changed.
  void ExpectRefusedUnchanged(const absl::Status& status, const FullFingerprint& before,
                              const std::string& reason) {
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_TRUE(Mentions(status, reason));
    EXPECT_TRUE(FullFingerprintOf(*engine_) == before) << Describe(before.tokens);
  }

  // A snapshot in the engine and its reference.
  struct Tracked {
    std::string id;
    RefCacheSnapshotPtr ref;
  };

  Tracked Take(HybridCache& cache, uint64_t from) {
    Tracked tracked;
    tracked.id = cache.Snapshot(from, &tracked.ref);
    return tracked;
  }

  // Merges in both; the engine's status (the two must agree on success).
  absl::Status Merge(const Tracked& parent, const Tracked& child, Tracked* merged) {
    RefCacheSnapshotPtr expected = RefCache::Merge(parent.ref, child.ref);
    absl::StatusOr<engine::SnapshotInfo> result = engine_->MergeSnapshots(parent.id, child.id);
    EXPECT_EQ(result.ok(), expected != nullptr) << result.status();
    if (!result.ok() || expected == nullptr) return result.status();
    *merged = {result->snapshot_id, expected};
    EXPECT_TRUE(HybridSnapshotMatches(*engine_, merged->id, *expected));
    return absl::OkStatus();
  }

  // Splits in both; both must succeed.
  void Split(const Tracked& snapshot, uint64_t at, Tracked* parent, Tracked* child) {
    auto expected = RefCache::Split(snapshot.ref, at);
    ASSERT_TRUE(expected.has_value());
    auto result = engine_->SplitSnapshot(snapshot.id, at);
    ASSERT_TRUE(result.ok()) << result.status();
    *parent = {result->first.snapshot_id, expected->first};
    *child = {result->second.snapshot_id, expected->second};
    EXPECT_TRUE(HybridSnapshotMatches(*engine_, parent->id, *parent->ref));
    EXPECT_TRUE(HybridSnapshotMatches(*engine_, child->id, *child->ref));
  }

  std::vector<engine::TokenRange> SnapshotRanges(const std::string& id, uint32_t layer) {
    auto view = engine_->Freeze("", id);
    EXPECT_TRUE(view.ok()) << view.status();
    return view.ok() ? (*view)->Ranges(layer, kEverything) : std::vector<engine::TokenRange>{};
  }

  std::unique_ptr<gpu::PagePool> pool_;
  std::unique_ptr<engine::Engine> engine_;
};

}  // namespace kvcache::testing
