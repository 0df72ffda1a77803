// Leases and pins (engine/lease.h): a handle that no call names within its
// ttl is released as DeleteCache / ReleaseSnapshot would release it, and is
// NOT_FOUND afterwards; any call naming it renews it; RenewLease renews all
// or none; pinned snapshots never expire and stay within max_pinned_bytes.
// Time is a manual clock, so expiry is exact; one test runs the reaper thread
// on the system clock.
#include "engine/lease.h"

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "engine/lease_reaper.h"
#include "engine_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "manual_clock.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {
namespace {

using engine::Engine;
using ::testing::HasSubstr;

constexpr uint64_t kPageBytes = 8 << 10;
constexpr uint64_t kBudgetBytes = 32 << 20;

class LeaseTest : public GpuTestBase {
 protected:
  void SetUp() override {
    GpuTestBase::SetUp();
    pool_ = MakePool(kPageBytes, kBudgetBytes);
    ASSERT_NE(pool_, nullptr);
  }
  // An engine whose handles get `default_ttl` unless they ask otherwise.
  void StartEngine(absl::Duration default_ttl, uint64_t max_pinned_bytes = 0) {
    engine_ =
        std::make_unique<Engine>(*pool_, engine::EngineOptions{.page_tokens = 4,
                                                               .default_ttl = default_ttl,
                                                               .max_pinned_bytes = max_pinned_bytes,
                                                               .clock = &clock_});
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

  engine::CacheSpec Spec() const {
    return MakeSpec({StandardLayerSpec(2, 8), RotatingLayerSpec(1, 4, 0, 9, 4)});
  }
  // Advances the clock by `by`, then runs the reaper's pass.
  std::pair<uint64_t, uint64_t> AdvanceAndExpire(absl::Duration by) {
    clock_.Advance(by);
    return engine_->ExpireLeases();
  }

  ManualClock clock_;
  std::unique_ptr<gpu::PagePool> pool_;
  std::unique_ptr<Engine> engine_;
};

TEST_P(LeaseTest, ACacheNoCallNamesExpiresAndItsPagesGoBack) {
  StartEngine(absl::Seconds(10));
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(21));
  auto info = engine_->GetCache(cache.id());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->ttl, absl::Seconds(10));
  EXPECT_EQ(info->expires_at, clock_.Now() + absl::Seconds(10));
  EXPECT_GT(pool_->stats().used_pages, 0u);

  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(9)), std::make_pair(uint64_t{0}, uint64_t{0}));
  ASSERT_TRUE(cache.Append(3));  // renews: ten more seconds from now
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(9)), std::make_pair(uint64_t{0}, uint64_t{0}));
  EXPECT_TRUE(cache.Matches());  // reads renew too
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(10)), std::make_pair(uint64_t{1}, uint64_t{0}));

  EXPECT_EQ(engine_->GetCache(cache.id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->DeleteCache(cache.id()).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool_->stats().used_pages, 0u);
  EXPECT_EQ(engine_->Stats().caches_expired, 1u);
  EXPECT_EQ(engine_->Stats().caches, 0u);
}

TEST_P(LeaseTest, ASnapshotExpiresButPagesALiveHandleSharesStay) {
  StartEngine(absl::Seconds(5));
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(19));
  RefCacheSnapshotPtr reference;
  const std::string snapshot_id = cache.Snapshot(0, &reference);
  auto listed = engine_->ListSnapshots();
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].ttl, absl::Seconds(5));
  EXPECT_EQ(listed[0].expires_at, clock_.Now() + absl::Seconds(5));
  // A second cache restored from it shares its pages; a frozen read holds them too.
  MirroredCache restored(*engine_, Spec(), 11);
  ASSERT_TRUE(restored.Restore(snapshot_id, reference.get(), 19));
  auto frozen = engine_->Freeze("", snapshot_id);
  ASSERT_TRUE(frozen.ok()) << frozen.status();

  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(4)), std::make_pair(uint64_t{0}, uint64_t{0}));
  ASSERT_TRUE(engine_->RenewLease({cache.id(), restored.id()}, {}).ok());
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(2)), std::make_pair(uint64_t{0}, uint64_t{1}));
  EXPECT_EQ(engine_->Freeze("", snapshot_id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Restore(cache.id(), snapshot_id, 19).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->ReleaseSnapshot(snapshot_id).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->SetPinned(snapshot_id, true).status().code(), absl::StatusCode::kNotFound);
  // The live handles' bytes are intact, and so is the read in flight.
  EXPECT_TRUE(cache.Matches());
  EXPECT_TRUE(restored.Matches());
  EXPECT_EQ((*frozen)->to, 19u);
  frozen->reset();
  EXPECT_EQ(engine_->Stats().snapshots_expired, 1u);
}

TEST_P(LeaseTest, ARunOutLeaseIsNotFoundBeforeTheReaperComes) {
  StartEngine(absl::Seconds(3));
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(5));
  RefCacheSnapshotPtr reference;
  const std::string snapshot_id = cache.Snapshot(0, &reference);
  auto begun = engine_->BeginSpeculation(cache.id(), false);
  ASSERT_TRUE(begun.ok()) << begun.status();
  clock_.Advance(absl::Seconds(3));  // no ExpireLeases: the handles are still registered
  EXPECT_EQ(engine_->GetCache(cache.id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->DeleteCache(cache.id()).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->GetSpeculation(begun->speculation_id).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Freeze("", snapshot_id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->ReleaseSnapshot(snapshot_id).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->SetPinned(snapshot_id, true).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->RenewLease({cache.id()}, {}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->RenewLease({}, {snapshot_id}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(engine_->ListSnapshots().empty());
  EXPECT_EQ(engine_->ExpireLeases(), std::make_pair(uint64_t{1}, uint64_t{1}));
  EXPECT_EQ(pool_->stats().used_pages, 0u);
}

TEST_P(LeaseTest, RestoreAndFetchRenewASnapshot) {
  StartEngine(absl::Seconds(3));
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(7));
  RefCacheSnapshotPtr reference;
  const std::string id = cache.Snapshot(0, &reference);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(AdvanceAndExpire(absl::Seconds(2)), std::make_pair(uint64_t{0}, uint64_t{0}));
    if (i % 2 == 0) {
      ASSERT_TRUE(cache.Restore(id, reference.get(), 7));
    } else {
      EXPECT_TRUE(SnapshotMatches(*engine_, id, *reference));
      ASSERT_TRUE(engine_->GetCache(cache.id()).ok());
    }
  }
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(3)), std::make_pair(uint64_t{1}, uint64_t{1}));
}

// A Fetch of a snapshot that also names a cache reads the snapshot, and the
// cache, named, is renewed; a cache that is gone is NOT_FOUND naming it.
TEST_P(LeaseTest, AFetchOfASnapshotRenewsTheCacheNamedBesideIt) {
  StartEngine(absl::Seconds(3));
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(7));
  RefCacheSnapshotPtr reference;
  const std::string id = cache.Snapshot(0, &reference);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(AdvanceAndExpire(absl::Seconds(2)), std::make_pair(uint64_t{0}, uint64_t{0}));
    auto view = engine_->Freeze(cache.id(), id);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ((*view)->to, 7u);
  }
  ASSERT_TRUE(engine_->DeleteCache(cache.id()).ok());
  const auto gone = engine_->Freeze(cache.id(), id);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(gone.status().message(), HasSubstr("cache_id"));
  EXPECT_TRUE(engine_->Freeze("", id).ok());
}

TEST_P(LeaseTest, RenewLeaseRenewsAllOrNone) {
  StartEngine(absl::Seconds(10));
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(5));
  RefCacheSnapshotPtr reference;
  const std::string snapshot_id = cache.Snapshot(0, &reference);
  clock_.Advance(absl::Seconds(8));
  const std::vector<std::string> caches = {cache.id()};
  const std::vector<std::string> unknown = {snapshot_id, "0123456789abcdef0123456789abcdef"};
  const auto refused = engine_->RenewLease(caches, unknown);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(refused.status().message(), HasSubstr("snapshot_ids[1]"));
  // Nothing was renewed: both run out at 10 s.
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(2)), std::make_pair(uint64_t{1}, uint64_t{1}));

  MirroredCache second(*engine_, Spec());
  ASSERT_TRUE(second.Append(5));
  const std::string second_snapshot = second.Snapshot(0, &reference);
  clock_.Advance(absl::Seconds(8));
  const std::vector<std::string> cache_ids = {second.id()};
  const std::vector<std::string> snapshot_ids = {second_snapshot};
  const auto renewed = engine_->RenewLease(cache_ids, snapshot_ids);
  ASSERT_TRUE(renewed.ok()) << renewed.status();
  ASSERT_EQ(renewed->caches.size(), 1u);
  ASSERT_EQ(renewed->snapshots.size(), 1u);
  EXPECT_EQ(renewed->caches[0].id, second.id());
  EXPECT_EQ(renewed->caches[0].expires_at, clock_.Now() + absl::Seconds(10));
  EXPECT_EQ(renewed->snapshots[0].expires_at, clock_.Now() + absl::Seconds(10));
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(9)), std::make_pair(uint64_t{0}, uint64_t{0}));
  EXPECT_TRUE(second.Matches());
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(11)), std::make_pair(uint64_t{1}, uint64_t{1}));
}

TEST_P(LeaseTest, PinnedSnapshotsNeverExpireAndStayWithinTheirBudget) {
  StartEngine(absl::Seconds(5), /*max_pinned_bytes=*/1 << 20);
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(13));
  auto pinned = engine_->Snapshot(cache.id(), 0, /*pinned=*/true);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_EQ(pinned->expires_at, absl::InfiniteFuture());
  EXPECT_EQ(engine_->Stats().pinned_bytes, pinned->size_bytes);
  ASSERT_TRUE(engine_->RenewLease({cache.id()}, {}).ok());
  EXPECT_EQ(AdvanceAndExpire(absl::Hours(1)), std::make_pair(uint64_t{1}, uint64_t{0}));
  EXPECT_TRUE(engine_->Freeze("", pinned->snapshot_id).ok());

  // Unpinned, its lease runs from now.
  auto unpinned = engine_->SetPinned(pinned->snapshot_id, false);
  ASSERT_TRUE(unpinned.ok()) << unpinned.status();
  EXPECT_FALSE(unpinned->pinned);
  EXPECT_EQ(unpinned->expires_at, clock_.Now() + absl::Seconds(5));
  EXPECT_EQ(engine_->Stats().pinned_bytes, 0u);
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(6)), std::make_pair(uint64_t{0}, uint64_t{1}));
  EXPECT_EQ(engine_->SetPinned(pinned->snapshot_id, true).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_P(LeaseTest, PinningPastTheBudgetIsRefusedAndChangesNothing) {
  StartEngine(absl::Seconds(5));
  MirroredCache probe(*engine_, Spec());
  ASSERT_TRUE(probe.Append(40));
  auto sized = engine_->Snapshot(probe.id(), 0);
  ASSERT_TRUE(sized.ok());
  const uint64_t bytes = sized->size_bytes;
  ReleaseEverything(*engine_);
  engine_.reset();

  StartEngine(absl::Seconds(5), /*max_pinned_bytes=*/bytes + bytes / 2);
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(40));
  auto first = engine_->Snapshot(cache.id(), 0, /*pinned=*/true);
  ASSERT_TRUE(first.ok()) << first.status();
  const auto second = engine_->Snapshot(cache.id(), 0, /*pinned=*/true);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(second.status().message(), HasSubstr("max_pinned_bytes"));
  EXPECT_EQ(engine_->ListSnapshots().size(), 1u);
  auto unpinned = engine_->Snapshot(cache.id(), 0);
  ASSERT_TRUE(unpinned.ok());
  const auto pin = engine_->SetPinned(unpinned->snapshot_id, true);
  EXPECT_EQ(pin.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(pin.status().message(), HasSubstr("max_pinned_bytes"));
  EXPECT_EQ(engine_->Stats().pinned_bytes, first->size_bytes);
  // Still unpinned: it expires with its lease.
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(5)), std::make_pair(uint64_t{1}, uint64_t{1}));
  EXPECT_EQ(engine_->ListSnapshots().size(), 1u);
}

TEST_P(LeaseTest, MergeAndSplitKeepThePinAndTheLongestLease) {
  StartEngine(absl::ZeroDuration());
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(8));
  auto parent = engine_->Snapshot(cache.id(), 0, false, absl::Seconds(4));
  ASSERT_TRUE(parent.ok());
  ASSERT_TRUE(cache.Append(8));
  auto child = engine_->Snapshot(cache.id(), 8, false, absl::Seconds(20));
  ASSERT_TRUE(child.ok());
  auto merged = engine_->MergeSnapshots(parent->snapshot_id, child->snapshot_id);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->ttl, absl::Seconds(20));
  ASSERT_TRUE(engine_->SetPinned(merged->snapshot_id, true).ok());
  auto halves = engine_->SplitSnapshot(merged->snapshot_id, 8);
  ASSERT_TRUE(halves.ok()) << halves.status();
  EXPECT_TRUE(halves->first.pinned);
  EXPECT_TRUE(halves->second.pinned);
  EXPECT_EQ(engine_->Stats().pinned_bytes, halves->first.size_bytes + halves->second.size_bytes);
  EXPECT_EQ(AdvanceAndExpire(absl::Hours(2)), std::make_pair(uint64_t{0}, uint64_t{0}));
  ASSERT_TRUE(engine_->SetPinned(halves->first.snapshot_id, false).ok());
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(21)), std::make_pair(uint64_t{0}, uint64_t{1}));
  EXPECT_EQ(engine_->ListSnapshots().size(), 1u);
}

TEST_P(LeaseTest, NamingAHandleOftenKeepsOneDeadlineQueued) {
  StartEngine(absl::Seconds(60));
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(8));
  auto snapshot = engine_->Snapshot(cache.id(), 0);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  EXPECT_EQ(engine_->QueuedLeaseDeadlines(), 2u);
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 500; ++i) {
      ASSERT_TRUE(engine_->SetPinned(snapshot->snapshot_id, false).ok());
      ASSERT_TRUE(engine_->SetPinned(snapshot->snapshot_id, i % 2 == 0).ok());
      ASSERT_TRUE(engine_->RenewLease({cache.id()}, {snapshot->snapshot_id}).ok());
    }
    EXPECT_LE(engine_->QueuedLeaseDeadlines(), 2u);
    EXPECT_EQ(AdvanceAndExpire(absl::Seconds(59)), std::make_pair(uint64_t{0}, uint64_t{0}));
    ASSERT_TRUE(engine_->RenewLease({cache.id()}, {snapshot->snapshot_id}).ok());
    EXPECT_EQ(AdvanceAndExpire(absl::Seconds(59)), std::make_pair(uint64_t{0}, uint64_t{0}));
    EXPECT_LE(engine_->QueuedLeaseDeadlines(), 2u);
  }
  // The one deadline still finds it when no call names it any more.
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(61)), std::make_pair(uint64_t{1}, uint64_t{1}));
  EXPECT_EQ(engine_->QueuedLeaseDeadlines(), 0u);
}

TEST_P(LeaseTest, MergingWithAHandleWithoutALeaseGivesNone) {
  StartEngine(absl::ZeroDuration());
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(8));
  auto forever = engine_->Snapshot(cache.id(), 0);  // no ttl, no default: never expires
  ASSERT_TRUE(forever.ok());
  ASSERT_TRUE(cache.Append(8));
  auto leased = engine_->Snapshot(cache.id(), 8, false, absl::Seconds(30));
  ASSERT_TRUE(leased.ok());
  auto merged = engine_->MergeSnapshots(forever->snapshot_id, leased->snapshot_id);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->ttl, absl::ZeroDuration());
  EXPECT_EQ(merged->expires_at, absl::InfiniteFuture());
  EXPECT_EQ(AdvanceAndExpire(absl::Hours(1)), std::make_pair(uint64_t{0}, uint64_t{0}));
  EXPECT_TRUE(engine_->Freeze("", merged->snapshot_id).ok());
  auto halves = engine_->SplitSnapshot(merged->snapshot_id, 8);
  ASSERT_TRUE(halves.ok()) << halves.status();
  EXPECT_EQ(halves->first.expires_at, absl::InfiniteFuture());
  EXPECT_EQ(halves->second.expires_at, absl::InfiniteFuture());
}

TEST_P(LeaseTest, AnExpiredCacheEndsItsSpeculation) {
  StartEngine(absl::Seconds(2));
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(4));
  auto begun = engine_->BeginSpeculation(cache.id(), false);
  ASSERT_TRUE(begun.ok()) << begun.status();
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(engine_->GetSpeculation(begun->speculation_id).ok());  // renews the cache
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(1)), std::make_pair(uint64_t{0}, uint64_t{0}));
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(2)), std::make_pair(uint64_t{1}, uint64_t{0}));
  EXPECT_EQ(engine_->GetSpeculation(begun->speculation_id).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->AbortSpeculation(begun->speculation_id).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_P(LeaseTest, OnePassExpiresMoreThanOneBatch) {
  StartEngine(absl::Seconds(1));
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(6));
  const size_t count = 3 * engine::kExpiriesPerLock + 5;
  for (size_t i = 0; i < count; ++i) ASSERT_TRUE(engine_->Snapshot(cache.id(), i % 6).ok());
  EXPECT_EQ(AdvanceAndExpire(absl::Seconds(1)), std::make_pair(uint64_t{1}, uint64_t{count}));
  EXPECT_EQ(engine_->ListSnapshots().size(), 0u);
  EXPECT_EQ(pool_->stats().used_pages, 0u);
}

TEST_P(LeaseTest, TheReaperThreadExpiresOnTheSystemClock) {
  engine_ = std::make_unique<Engine>(
      *pool_, engine::EngineOptions{.page_tokens = 4, .default_ttl = absl::Seconds(1)});
  MirroredCache cache(*engine_, Spec());
  ASSERT_TRUE(cache.Append(9));
  engine::LeaseReaper reaper(*engine_, absl::Milliseconds(20));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (engine_->Stats().caches_expired == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(engine_->Stats().caches_expired, 1u);
  EXPECT_EQ(engine_->GetCache(cache.id()).status().code(), absl::StatusCode::kNotFound);
}

INSTANTIATE_TEST_SUITE_P(TransferPaths, LeaseTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
