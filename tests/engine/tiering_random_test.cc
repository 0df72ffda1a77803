// Random sessions on an oversubscribed device, against the CPU reference.
//
// Many chat sessions share a device pool that holds about a third of their
// state, with host memory and a disk tier below it. A session's history lives
// in a snapshot between turns (its cache is gone); a turn restores it into a
// fresh cache (sometimes rewound), checks every byte, appends tokens, takes a
// new snapshot and drops the old one. Between turns, sessions' snapshots are
// read directly (a Fetch), pinned and unpinned, or dropped. Pages move down
// when the device is full and come back when read: every byte must match the
// reference wherever it went, pinned snapshots never move, and every page of
// every tier is free at the end.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "chunked_recurrent_test_util.h"
#include "engine/engine.h"
#include "engine/files/safetensors.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "speculation_test_util.h"
#include "support/gpu_test_base.h"

namespace kvcache::testing {
namespace {

constexpr uint64_t kPageBytes = 4096;
constexpr uint32_t kPageTokens = 4;
constexpr uint32_t kSessions = 16;
constexpr uint32_t kMaxPinned = 1;
constexpr uint64_t kDirectTurns = 1500;
constexpr uint64_t kStagingTurns = 300;

struct Session {
  std::string snapshot_id;  // empty: no history yet
  RefCacheSnapshotPtr reference;
  bool pinned = false;
};

class TieringRandomTest : public GpuTestBase {
 protected:
  void RunSessions(const std::string& name, const engine::CacheSpec& spec, uint32_t device_pages,
                   uint64_t max_tokens) {
    SCOPED_TRACE(name);
    std::unique_ptr<gpu::PagePool> pool = TieredPool(device_pages);
    ASSERT_NE(pool, nullptr);
    const uint64_t turns = GetParam() == TransferPath::kDirect ? kDirectTurns : kStagingTurns;
    uint64_t most_pages = 0;  // in all tiers
    {
      engine::Engine engine(*pool, engine::EngineOptions{.page_tokens = kPageTokens});
      std::vector<Session> sessions(kSessions);
      std::mt19937_64 rng(0x7157 + name.size());
      const auto uniform = [&](uint64_t lo, uint64_t hi) {
        return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
      };
      for (uint64_t turn = 0; turn < turns && !HasFailure(); ++turn) {
        SCOPED_TRACE(absl::StrCat("turn ", turn));
        Session& session = sessions[uniform(0, kSessions - 1)];
        const uint64_t action = uniform(0, 99);
        if (action < 70) {
          Turn(engine, spec, session, max_tokens, uniform);
        } else if (action < 85 && !session.snapshot_id.empty()) {
          EXPECT_TRUE(SnapshotMatches(engine, session.snapshot_id, *session.reference));
        } else if (action < 95 && !session.snapshot_id.empty()) {
          const bool pin = !session.pinned && PinnedCount(sessions) < kMaxPinned;
          ASSERT_TRUE(engine.SetPinned(session.snapshot_id, pin).ok());
          session.pinned = pin;
        } else if (!session.snapshot_id.empty()) {
          ASSERT_TRUE(engine.ReleaseSnapshot(session.snapshot_id).ok());
          session = Session{};
        }
        const gpu::PoolStats stats = pool->stats();
        most_pages = std::max<uint64_t>(
            most_pages, uint64_t{stats.used_pages} + stats.host_pages + stats.disk_pages);
        ExpectPinnedOnDevice(engine);
      }
      for (const Session& session : sessions) {
        if (!session.snapshot_id.empty()) {
          EXPECT_TRUE(SnapshotMatches(engine, session.snapshot_id, *session.reference));
        }
      }
      ReleaseEverything(engine);
    }
    ExpectOversubscribedAndFree(name, *pool, most_pages, device_pages);
  }

  struct EncodedSession {
    std::string snapshot_id;
    uint64_t to = 0;
    std::string encoded;  // ExportSnapshot's bytes when it was made
    bool pinned = false;
  };

  static std::string Encoded(engine::Engine& engine, const std::string& snapshot_id) {
    absl::StatusOr<engine::PromptCacheFile> file = engine.ExportSnapshot(snapshot_id, {});
    EXPECT_TRUE(file.ok()) << file.status();
    if (!file.ok()) return "";
    absl::StatusOr<std::string> bytes = engine::EncodeSafetensorsBytes(*file);
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    return bytes.ok() ? *std::move(bytes) : "";
  }

  // `tokens` more on every layer: K/V, or a recurrent state advancing by them.
  static void Advance(engine::Engine& engine, const std::string& cache_id,
                      const engine::CacheSpec& spec, uint64_t tokens, std::mt19937_64& rng) {
    for (uint32_t layer = 0; layer < spec.layers.size(); ++layer) {
      if (engine::IsRecurrent(spec.layers[layer])) {
        const RefState state = RandomState(spec, layer, rng);
        const absl::StatusOr<uint64_t> done =
            engine.UpdateState(cache_id, layer, StateInputOf(state, tokens));
        ASSERT_TRUE(done.ok()) << done.status() << " " << DescribeTiers(engine.pool());
      } else {
        const KvTensors kv = RandomKv(spec, layer, tokens, rng);
        const absl::StatusOr<uint64_t> done = engine.Update(cache_id, layer, kv.input());
        ASSERT_TRUE(done.ok()) << done.status() << " " << DescribeTiers(engine.pool());
      }
    }
  }

  void RunEncoded(const std::string& name, const engine::CacheSpec& spec, uint32_t device_pages,
                  uint64_t max_tokens) {
    SCOPED_TRACE(name);
    std::unique_ptr<gpu::PagePool> pool = TieredPool(device_pages);
    ASSERT_NE(pool, nullptr);
    const uint64_t turns = GetParam() == TransferPath::kDirect ? kDirectTurns : kStagingTurns;
    uint64_t most_pages = 0;
    {
      engine::Engine engine(*pool, engine::EngineOptions{.page_tokens = kPageTokens});
      std::vector<EncodedSession> sessions(kSessions);
      std::mt19937_64 rng(0x5e55 + name.size());
      const auto uniform = [&](uint64_t lo, uint64_t hi) {
        return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
      };
      for (uint64_t turn = 0; turn < turns && !HasFailure(); ++turn) {
        SCOPED_TRACE(absl::StrCat("turn ", turn));
        EncodedSession& session = sessions[uniform(0, kSessions - 1)];
        const uint64_t action = uniform(0, 99);
        if (action < 70) {
          absl::StatusOr<engine::CacheInfo> cache = engine.CreateCache(spec);
          ASSERT_TRUE(cache.ok()) << cache.status();
          if (!session.snapshot_id.empty() && session.to < max_tokens) {
            const auto restored = engine.Restore(cache->cache_id, session.snapshot_id, session.to);
            ASSERT_TRUE(restored.ok()) << restored.status() << " " << DescribeTiers(*pool);
            // What came back from wherever it was is what was saved.
            absl::StatusOr<engine::SnapshotInfo> again = engine.Snapshot(cache->cache_id, 0);
            ASSERT_TRUE(again.ok()) << again.status();
            EXPECT_EQ(Encoded(engine, again->snapshot_id), session.encoded);
            ASSERT_TRUE(engine.ReleaseSnapshot(again->snapshot_id).ok());
          }
          Advance(engine, cache->cache_id, spec, uniform(1, max_tokens / 4), rng);
          absl::StatusOr<engine::SnapshotInfo> taken =
              engine.Snapshot(cache->cache_id, 0, session.pinned);
          ASSERT_TRUE(taken.ok()) << taken.status();
          if (!session.snapshot_id.empty()) {
            ASSERT_TRUE(engine.ReleaseSnapshot(session.snapshot_id).ok());
          }
          session.snapshot_id = taken->snapshot_id;
          session.to = taken->to_offset;
          session.encoded = Encoded(engine, taken->snapshot_id);
          ASSERT_TRUE(engine.DeleteCache(cache->cache_id).ok());
        } else if (action < 85 && !session.snapshot_id.empty()) {
          EXPECT_EQ(Encoded(engine, session.snapshot_id), session.encoded);
        } else if (action < 95 && !session.snapshot_id.empty()) {
          const bool pin =
              !session.pinned && std::none_of(sessions.begin(), sessions.end(),
                                              [](const EncodedSession& s) { return s.pinned; });
          ASSERT_TRUE(engine.SetPinned(session.snapshot_id, pin).ok());
          session.pinned = pin;
        } else if (!session.snapshot_id.empty()) {
          ASSERT_TRUE(engine.ReleaseSnapshot(session.snapshot_id).ok());
          session = EncodedSession{};
        }
        const gpu::PoolStats stats = pool->stats();
        most_pages = std::max<uint64_t>(
            most_pages, uint64_t{stats.used_pages} + stats.host_pages + stats.disk_pages);
        ExpectPinnedOnDevice(engine);
      }
      for (const EncodedSession& session : sessions) {
        if (!session.snapshot_id.empty()) {
          EXPECT_EQ(Encoded(engine, session.snapshot_id), session.encoded);
        }
      }
      ReleaseEverything(engine);
    }
    ExpectOversubscribedAndFree(name, *pool, most_pages, device_pages);
  }

  // Restore (maybe rewound), check, append, snapshot, drop the old snapshot.
  template <typename Uniform>
  void Turn(engine::Engine& engine, const engine::CacheSpec& spec, Session& session,
            uint64_t max_tokens, Uniform& uniform) {
    MirroredCache cache(engine, spec, uniform(1, 1 << 30));
    // A long history ends: the session starts a new conversation.
    if (!session.snapshot_id.empty() && session.reference->to < max_tokens) {
      const uint64_t to = session.reference->to;
      const uint64_t target = uniform(0, 3) == 0 ? uniform(session.reference->from, to) : to;
      ASSERT_TRUE(cache.Restore(session.snapshot_id, session.reference.get(), target));
      ASSERT_TRUE(cache.Matches());
    }
    if (uniform(0, 1) == 0) {
      ASSERT_TRUE(cache.Append(uniform(1, max_tokens / 4)));
    } else {
      ASSERT_TRUE(cache.Decode(uniform(1, 6)));
    }
    RefCacheSnapshotPtr reference;
    const std::string snapshot_id = cache.Snapshot(0, &reference);
    ASSERT_FALSE(snapshot_id.empty());
    if (session.pinned) ASSERT_TRUE(engine.SetPinned(snapshot_id, true).ok());
    if (!session.snapshot_id.empty()) {
      ASSERT_TRUE(engine.ReleaseSnapshot(session.snapshot_id).ok());
    }
    session.snapshot_id = snapshot_id;
    session.reference = std::move(reference);
    ASSERT_TRUE(engine.DeleteCache(cache.id()).ok());
  }

  static uint32_t PinnedCount(const std::vector<Session>& sessions) {
    return std::count_if(sessions.begin(), sessions.end(),
                         [](const Session& session) { return session.pinned; });
  }

  static std::string DescribeTiers(const gpu::PagePool& pool) {
    const gpu::PoolStats stats = pool.stats();
    return absl::StrCat("(device ", stats.used_pages, "/", stats.max_pages, ", host ",
                        stats.host_pages, "/", stats.max_host_pages, ", disk ", stats.disk_pages,
                        "/", stats.max_disk_pages, ")");
  }

  // Host memory as large as the device, a disk tier eight times as large.
  std::unique_ptr<gpu::PagePool> TieredPool(uint32_t device_pages) {
    gpu::PoolOptions options{
        .page_bytes = kPageBytes,
        .budget_bytes = device_pages * kPageBytes,
        .host_bytes = device_pages * kPageBytes,
        .disk_path = absl::StrCat(::testing::TempDir(), "/tiering-random-", ::getpid(), ".pages"),
        .disk_bytes = 8 * device_pages * kPageBytes};
    auto pool = gpu::PagePool::Create(device(), options);
    EXPECT_TRUE(pool.ok()) << pool.status();
    return pool.ok() ? *std::move(pool) : nullptr;
  }

  void ExpectOversubscribedAndFree(const std::string& name, const gpu::PagePool& pool,
                                   uint64_t most_pages, uint32_t device_pages) {
    const gpu::PoolStats after = pool.stats();
    std::printf(
        "[ tiers ] %-10s %llu pages at most on a %u-page device (%.1fx): %llu evicted, "
        "%llu host to disk, %llu back from host, %llu back from disk\n",
        name.c_str(), (unsigned long long)most_pages, device_pages,
        double(most_pages) / device_pages, (unsigned long long)after.evictions,
        (unsigned long long)after.demotions, (unsigned long long)after.promotions_from_host,
        (unsigned long long)after.promotions_from_disk);
    EXPECT_GE(most_pages, 2 * device_pages) << "not oversubscribed";
    EXPECT_GT(after.evictions, 0u);
    EXPECT_GT(after.demotions, 0u);
    EXPECT_GT(after.promotions_from_host, 0u);
    EXPECT_GT(after.promotions_from_disk, 0u);
    EXPECT_EQ(after.used_pages, 0u);
    EXPECT_EQ(after.host_pages, 0u);
    EXPECT_EQ(after.disk_pages, 0u);
  }

  void ExpectPinnedOnDevice(engine::Engine& engine) {
    for (const engine::SnapshotInfo& info : engine.ListSnapshots()) {
      if (info.pinned) {
        EXPECT_EQ(info.tiers.host + info.tiers.disk, 0u) << "pinned " << info.snapshot_id;
      }
    }
  }
};

// Sessions of up to a quarter of the device each (a pinned one, the one in a
// turn and its new tokens always fit), sixteen of them: up to 4x the device.
TEST_P(TieringRandomTest, StandardSessions) { RunSessions("standard", StandardSpec(), 48, 64); }
TEST_P(TieringRandomTest, RotatingSessions) { RunSessions("rotating", RotatingSpec(4), 20, 64); }
TEST_P(TieringRandomTest, ChunkedSessions) { RunSessions("chunked", ChunkedSpec(), 20, 64); }
TEST_P(TieringRandomTest, BatchedSessions) { RunSessions("batched", BatchedSpec(), 64, 64); }

// Every other kind (recurrent states, quantized pages, a layout mixing all
// five): the same sessions, checked through the snapshot's whole encoding
// (ExportSnapshot: every tensor as stored, packed or state) against the one
// taken while it was new, after each restore and each read from a lower tier.
TEST_P(TieringRandomTest, RecurrentSessions) { RunEncoded("recurrent", RecurrentSpec(), 6, 64); }
TEST_P(TieringRandomTest, QuantizedSessions) { RunEncoded("quantized", QuantizedSpec(), 24, 24); }
TEST_P(TieringRandomTest, MixedSessions) { RunEncoded("mixed", MixedLayout(), 64, 16); }

INSTANTIATE_TEST_SUITE_P(AllPaths, TieringRandomTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
