// Leases and pins through a whole server: handles whose leases run out are
// released by the server's reaper and are NOT_FOUND afterwards; Update
// streams (over gRPC and over the data lane), Fetch and Restore renew the
// handles they name; RenewLease and SetPinned answer as the contract says,
// refusing bad input with a status naming the field.
#include <algorithm>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service_test_util.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;


class E2eLeaseTest : public ::testing::Test {
 protected:
  void Start(absl::Duration default_ttl, uint64_t max_pinned_bytes = 0) {
    server_ = TestServer::Start(ServerSetup{.default_ttl = default_ttl,
                                            .max_pinned_bytes = max_pinned_bytes,
                                            .lease_check_interval = absl::Milliseconds(20)});
    ASSERT_NE(server_, nullptr);
    lane_client_ = server_->Connect(/*dedicated=*/true, "auto");
  }
  void TearDown() override {
    lane_client_.reset();
    if (server_ != nullptr) server_->CleanUpAndCheck();
  }
  Client& client() { return server_->client(); }

  // One token on every layer of `cache_id`, through `via`.
  absl::Status Step(Client& via, const v1::CacheInfo& cache) {
    std::vector<v1::UpdateRequest> requests;
    std::vector<LayerUpdate> updates;
    for (int layer = 0; layer < cache.spec().layers_size(); ++layer) {
      requests.push_back(RandomUpdate(cache.cache_id(), cache.spec(), layer, 1, rng_));
    }
    for (const v1::UpdateRequest& request : requests) updates.push_back(ToLayerUpdate(request));
    return via.Update(cache.cache_id(), updates).status();
  }

  // Waits (at most 10 s) until `listed` is false. Listings name no handle,
  // so polling them renews nothing.
  static bool Disappears(const std::function<bool()>& listed) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      if (!listed()) return true;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return false;
  }
  bool CacheListed(const std::string& cache_id) {
    auto caches = client().ListCaches();
    EXPECT_TRUE(caches.ok()) << caches.status();
    return caches.ok() && std::any_of(caches->begin(), caches->end(), [&](const auto& cache) {
             return cache.cache_id() == cache_id;
           });
  }
  bool SnapshotListed(const std::string& snapshot_id) {
    auto snapshots = client().ListSnapshots();
    EXPECT_TRUE(snapshots.ok()) << snapshots.status();
    return snapshots.ok() &&
           std::any_of(snapshots->begin(), snapshots->end(),
                       [&](const auto& snapshot) { return snapshot.snapshot_id() == snapshot_id; });
  }

  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Client> lane_client_;
  std::mt19937_64 rng_{5};
};

TEST_F(E2eLeaseTest, HandlesNoCallNamesRunOutWhileUpdatesKeepTheirCacheAlive) {
  ASSERT_NO_FATAL_FAILURE(Start(absl::Seconds(1)));
  auto cache = client().CreateCache(ProtoSpec(2, 2, 8), {.ttl_seconds = 2});
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(cache->ttl_seconds(), 2u);
  EXPECT_TRUE(cache->has_expires_at());
  EXPECT_NEAR(cache->expires_at().seconds(), absl::ToUnixSeconds(absl::Now() + absl::Seconds(2)),
              1);
  ASSERT_TRUE(Step(client(), *cache).ok());
  auto snapshot = client().Snapshot(cache->cache_id());  // the server's default: 1 s
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  EXPECT_EQ(snapshot->ttl_seconds(), 1u);
  const std::string snapshot_id = snapshot->snapshot_id();

  // Updates over gRPC and over the lane, every 300 ms for 3 s (longer than
  // the cache's lease), keep the cache; the snapshot nobody names runs out.
  const absl::Time until = absl::Now() + absl::Seconds(3);
  uint64_t steps = 1;
  for (int i = 0; absl::Now() < until; ++i, ++steps) {
    ASSERT_TRUE(Step(i % 2 == 0 ? client() : *lane_client_, *cache).ok()) << "step " << i;
    absl::SleepFor(absl::Milliseconds(300));
  }
  EXPECT_EQ(client().FetchLayer("", snapshot_id, 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client().ReleaseSnapshot(snapshot_id).code(), absl::StatusCode::kNotFound);
  auto info = client().GetCache(cache->cache_id());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->offset(), steps);

  EXPECT_TRUE(Disappears([&] { return CacheListed(cache->cache_id()); }));
  EXPECT_EQ(client().GetCache(cache->cache_id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Step(*lane_client_, *cache).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Step(client(), *cache).code(), absl::StatusCode::kNotFound);
  // Gone for callers at once; released by the reaper within its interval.
  absl::StatusOr<v1::Stats> stats;
  EXPECT_TRUE(Disappears([&] {
    stats = client().GetStats();
    return stats.ok() && stats->caches_expired() == 0;
  }));
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->caches_expired(), 1u);
  EXPECT_EQ(stats->snapshots_expired(), 1u);
  EXPECT_EQ(stats->pages_used(), 0u);
}

TEST_F(E2eLeaseTest, FetchRestoreAndRenewLeaseRenew) {
  ASSERT_NO_FATAL_FAILURE(Start(absl::Seconds(1)));
  auto cache = client().CreateCache(ProtoSpec(1, 2, 8), {.ttl_seconds = 60});
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(Step(client(), *cache).ok());
  auto fetched = client().Snapshot(cache->cache_id());
  auto restored = client().Snapshot(cache->cache_id());
  auto renewed = client().Snapshot(cache->cache_id());
  ASSERT_TRUE(fetched.ok() && restored.ok() && renewed.ok());
  for (int i = 0; i < 8; ++i) {  // 2.4 s, past every 1 s lease
    ASSERT_TRUE(lane_client_->FetchLayer("", fetched->snapshot_id(), 0).ok()) << i;
    ASSERT_TRUE(client().Restore(cache->cache_id(), restored->snapshot_id(), 1).ok()) << i;
    auto leases = client().RenewLease({}, {renewed->snapshot_id()});
    ASSERT_TRUE(leases.ok()) << leases.status();
    ASSERT_EQ(leases->snapshots_size(), 1);
    EXPECT_EQ(leases->snapshots(0).id(), renewed->snapshot_id());
    EXPECT_EQ(leases->snapshots(0).ttl_seconds(), 1u);
    absl::SleepFor(absl::Milliseconds(300));
  }
  auto listed = client().ListSnapshots({.cache_id = cache->cache_id()});
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->size(), 3u);
}

TEST_F(E2eLeaseTest, RenewLeaseRefusesBadIdsNamingThem) {
  ASSERT_NO_FATAL_FAILURE(Start(absl::ZeroDuration()));
  auto cache = client().CreateCache(ProtoSpec(1, 2, 8));
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_FALSE(cache->has_expires_at()) << "no lease without a ttl";
  auto malformed = client().RenewLease({cache->cache_id(), ""}, {});
  EXPECT_EQ(malformed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(malformed.status().message(), HasSubstr("cache_ids[1]"));
  auto unknown = client().RenewLease({cache->cache_id()}, {kUnknownId});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unknown.status().message(), HasSubstr("snapshot_ids[0]"));
  auto unknown_cache = client().RenewLease({kUnknownId}, {});
  EXPECT_EQ(unknown_cache.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(unknown_cache.status().message(), HasSubstr("cache_ids[0]"));
  auto leases = client().RenewLease({cache->cache_id()}, {});
  ASSERT_TRUE(leases.ok()) << leases.status();
  EXPECT_EQ(leases->caches(0).ttl_seconds(), 0u);
  EXPECT_FALSE(leases->caches(0).has_expires_at());
}

TEST_F(E2eLeaseTest, PinsOutliveLeasesWithinTheirBudget) {
  ASSERT_NO_FATAL_FAILURE(Start(absl::Seconds(1), /*max_pinned_bytes=*/64 << 10));
  auto cache = client().CreateCache(ProtoSpec(2, 2, 8), {.ttl_seconds = 60});
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(Step(client(), *cache).ok());
  auto pinned = client().Snapshot(cache->cache_id(), {.pinned = true});
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_FALSE(pinned->has_expires_at());
  auto stats = client().GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->pinned_bytes(), pinned->size_bytes());
  EXPECT_EQ(stats->max_pinned_bytes(), 64u << 10);

  // Pinning past the budget: RESOURCE_EXHAUSTED naming it, nothing pinned.
  std::vector<std::string> more;
  absl::Status refused;
  for (int i = 0; i < 64 && refused.ok(); ++i) {
    auto snapshot = client().Snapshot(cache->cache_id(), {.pinned = true});
    if (snapshot.ok()) more.push_back(snapshot->snapshot_id());
    refused = snapshot.status();
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("max_pinned_bytes"));
  EXPECT_EQ(client().SetPinned(kUnknownId, true).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client().SetPinned("", true).status().code(), absl::StatusCode::kInvalidArgument);

  absl::SleepFor(absl::Milliseconds(1500));  // past the 1 s default lease
  EXPECT_TRUE(client().FetchLayer("", pinned->snapshot_id(), 0).ok());
  auto unpinned = client().SetPinned(pinned->snapshot_id(), false);
  ASSERT_TRUE(unpinned.ok()) << unpinned.status();
  EXPECT_TRUE(unpinned->has_expires_at());
  EXPECT_TRUE(Disappears([&] { return SnapshotListed(pinned->snapshot_id()); }));
  EXPECT_EQ(client().FetchLayer("", pinned->snapshot_id(), 0).status().code(),
            absl::StatusCode::kNotFound);
  for (const std::string& id : more) EXPECT_TRUE(client().ReleaseSnapshot(id).ok());
}

}  // namespace
}  // namespace kvcache::testing
