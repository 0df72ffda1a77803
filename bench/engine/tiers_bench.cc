// Tiers, each beside what the same bytes cost without kvcached:
//   BM_Evict/<tier>, BM_Promote/<tier>   PagePool::Evict / Promote of 64 MiB of
//       pages (64 KiB each) to and from host memory or the disk tier, vs
//   BM_MemcpyPages                        memcpy of the same bytes; goal >= 0.5x (host)
//   BM_RestoreFrom/<tier>                 Restore of a 32k-token snapshot (4 layers,
//       8 KV heads, head dim 128, f16: 512 MiB) into a fresh cache, its pages
//       evicted to that tier first (device: none evicted); p50 and p99 in counters
//   BM_Sessions/<fits>                    64 workers' sessions (restore the session's
//       snapshot, append 128 tokens, snapshot, drop the old one), 2 threads, on a
//       device that holds every session (fits=1) or half of them (fits=0), host
//       memory and disk below; turns/s, then every session's bytes checked
// KVCACHED_BENCH_DIR picks the disk tier's directory (default /tmp);
// KVCACHED_BENCH_STAGING=1 runs the pool through the staging path.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "gpu/device.h"
#include "gpu/page_pool.h"

namespace kvcache::engine {
namespace {

constexpr uint64_t kPageBytes = 64 << 10;
constexpr uint32_t kHeads = 8;
constexpr uint32_t kHeadDim = 128;
constexpr uint64_t kTokenBytes = uint64_t{kHeads} * kHeadDim * 2;  // K or V, f16
constexpr int kTierHost = 0;
constexpr int kTierDisk = 1;
constexpr int kTierDevice = 2;

gpu::Device& SharedDevice() {
  static gpu::Device* device = [] {
    gpu::DeviceOptions options;
    options.force_staging = std::getenv("KVCACHED_BENCH_STAGING") != nullptr;
    return gpu::Device::Create(options)->release();
  }();
  return *device;
}

std::string DiskPath(const char* what) {
  const char* dir = std::getenv("KVCACHED_BENCH_DIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/kvcached_tiers_bench_", what, "_", getpid());
}

std::unique_ptr<gpu::PagePool> MakePool(uint64_t device_bytes, uint64_t lower_bytes, int tier) {
  gpu::PoolOptions options{.page_bytes = kPageBytes, .budget_bytes = device_bytes};
  if (tier == kTierHost) options.host_bytes = lower_bytes;
  if (tier == kTierDisk) {
    options.disk_path = DiskPath("pages");
    options.disk_bytes = lower_bytes;
  }
  return *gpu::PagePool::Create(SharedDevice(), options);
}

const char* TierName(int tier) {
  return tier == kTierHost ? "host" : tier == kTierDisk ? "disk" : "device";
}

// ---------------------------------------------------------------- page moves

constexpr uint64_t kMoveBytes = 64 << 20;
constexpr uint32_t kMovePages = kMoveBytes / kPageBytes;

struct MoveFixture {
  explicit MoveFixture(int tier) : pool(MakePool(kMoveBytes, kMoveBytes, tier)) {
    if (!pool->Allocate(kMovePages, pages).ok()) std::abort();
    std::vector<std::byte> fill(kPageBytes, std::byte{5});
    std::vector<gpu::WriteRun> runs;
    for (gpu::PageId page : pages) runs.push_back({page, 0, fill.data(), kPageBytes});
    if (!pool->Write(runs).ok()) std::abort();
  }
  ~MoveFixture() {
    for (gpu::PageId page : pages) pool->Release(page);
  }
  std::unique_ptr<gpu::PagePool> pool;
  std::vector<gpu::PageId> pages;
};

template <typename F>
double Seconds(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void BM_Evict(benchmark::State& state) {
  MoveFixture fixture(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    absl::StatusOr<uint32_t> moved;
    state.SetIterationTime(Seconds([&] { moved = fixture.pool->Evict(fixture.pages); }));
    if (!moved.ok() || *moved != kMovePages) state.SkipWithError("evict failed");
    if (!fixture.pool->Promote(fixture.pages).ok()) state.SkipWithError("promote failed");
  }
  state.SetBytesProcessed(state.iterations() * kMoveBytes);
  state.SetLabel(TierName(state.range(0)));
}

void BM_Promote(benchmark::State& state) {
  MoveFixture fixture(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    if (fixture.pool->Evict(fixture.pages).value_or(0) != kMovePages) {
      state.SkipWithError("evict failed");
    }
    absl::Status promoted;
    state.SetIterationTime(Seconds([&] { promoted = fixture.pool->Promote(fixture.pages); }));
    if (!promoted.ok()) state.SkipWithError("promote failed");
  }
  state.SetBytesProcessed(state.iterations() * kMoveBytes);
  state.SetLabel(TierName(state.range(0)));
}

void BM_MemcpyPages(benchmark::State& state) {
  std::vector<std::byte> source(kMoveBytes, std::byte{5});
  std::vector<std::byte> destination(kMoveBytes);
  std::memset(destination.data(), 0, kMoveBytes);
  for (auto _ : state) {
    std::memcpy(destination.data(), source.data(), kMoveBytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * kMoveBytes);
}

BENCHMARK(BM_Evict)->Arg(kTierHost)->Arg(kTierDisk)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Promote)
    ->Arg(kTierHost)
    ->Arg(kTierDisk)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MemcpyPages)->Unit(benchmark::kMillisecond);

// ------------------------------------------------------------- restore latency

CacheSpec ModelSpec(uint32_t layers) {
  CacheSpec spec{.dtype = DType::kFloat16};
  for (uint32_t i = 0; i < layers; ++i) {
    spec.layers.push_back({.num_kv_heads = kHeads, .k_head_dim = kHeadDim, .kind = StandardKind{}});
  }
  return spec;
}

// Appends `tokens` tokens to every layer, each token's bytes derived from
// `seed` and its position (so they can be checked later).
void Fill(Engine& engine, const std::string& cache_id, uint32_t layers, uint64_t first,
          uint64_t tokens, uint64_t seed) {
  constexpr uint64_t kChunk = 512;
  std::vector<std::byte> data(kChunk * kTokenBytes);
  for (uint64_t done = 0; done < tokens; done += kChunk) {
    const uint64_t n = std::min(kChunk, tokens - done);
    // [B=1, H, L, D]: each head's run of n tokens.
    constexpr uint64_t kRowBytes = kHeadDim * 2;
    for (uint32_t h = 0; h < kHeads; ++h) {
      for (uint64_t t = 0; t < n; ++t) {
        std::memset(data.data() + (h * n + t) * kRowBytes,
                    static_cast<int>((seed * 131 + first + done + t) & 0xff), kRowBytes);
      }
    }
    const KvInput kv{.keys = absl::MakeSpan(data.data(), n * kTokenBytes),
                     .values = absl::MakeSpan(data.data(), n * kTokenBytes),
                     .tokens = n};
    for (uint32_t layer = 0; layer < layers; ++layer) {
      if (!engine.Update(cache_id, layer, kv).ok()) std::abort();
    }
  }
}

constexpr uint32_t kRestoreLayers = 4;
constexpr uint64_t kRestoreTokens = 32768;
constexpr uint64_t kRestoreBytes = 2 * kRestoreLayers * kRestoreTokens * kTokenBytes;

void BM_RestoreFrom(benchmark::State& state) {
  const int tier = static_cast<int>(state.range(0));
  // Room for the snapshot and a restored cache's own first page per layer.
  const uint64_t device_bytes = kRestoreBytes + 64 * kPageBytes;
  auto pool = MakePool(device_bytes, kRestoreBytes + 64 * kPageBytes, tier);
  Engine engine(*pool, EngineOptions{.page_tokens = 256});
  const CacheSpec spec = ModelSpec(kRestoreLayers);
  std::string snapshot;
  {
    const std::string cache = engine.CreateCache(spec)->cache_id;
    Fill(engine, cache, kRestoreLayers, 0, kRestoreTokens, 1);
    snapshot = engine.Snapshot(cache, 0)->snapshot_id;
    (void)engine.DeleteCache(cache);
  }
  std::vector<double> samples;
  for (auto _ : state) {
    if (tier != kTierDevice) {
      // A cache that needs the whole device pushes the snapshot down.
      const std::string filler = engine.CreateCache(spec)->cache_id;
      Fill(engine, filler, kRestoreLayers, 0, kRestoreTokens, 2);
      (void)engine.DeleteCache(filler);
    }
    const std::string cache = engine.CreateCache(spec)->cache_id;
    absl::StatusOr<CacheInfo> restored;
    const double seconds =
        Seconds([&] { restored = engine.Restore(cache, snapshot, kRestoreTokens); });
    if (!restored.ok()) state.SkipWithError(std::string(restored.status().message()).c_str());
    state.SetIterationTime(seconds);
    samples.push_back(seconds * 1e3);
    (void)engine.DeleteCache(cache);
  }
  std::sort(samples.begin(), samples.end());
  state.counters["p50_ms"] = samples[samples.size() / 2];
  state.counters["p99_ms"] = samples[std::min(samples.size() - 1, samples.size() * 99 / 100)];
  state.counters["kv_bytes"] = kRestoreBytes;
  state.SetLabel(TierName(tier));
  (void)engine.ReleaseSnapshot(snapshot);
}

BENCHMARK(BM_RestoreFrom)
    ->Arg(kTierDevice)
    ->Arg(kTierHost)
    ->Arg(kTierDisk)
    ->Iterations(12)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// -------------------------------------------------- an oversubscribed fleet

constexpr uint32_t kSessions = 64;
constexpr uint32_t kSessionLayers = 4;
constexpr uint64_t kSessionMaxTokens = 1024;
constexpr uint64_t kTurnTokens = 128;
constexpr uint64_t kSessionBytes = 2 * kSessionLayers * kSessionMaxTokens * kTokenBytes;

struct Session {
  std::string snapshot;
  uint64_t tokens = 0;
};

// One turn: restore, append, snapshot, drop the old; a new conversation once full.
void Turn(Engine& engine, const CacheSpec& spec, Session& session, uint32_t index) {
  const std::string cache = engine.CreateCache(spec)->cache_id;
  if (session.tokens + kTurnTokens > kSessionMaxTokens) {
    session.tokens = 0;
  } else if (!session.snapshot.empty()) {
    if (!engine.Restore(cache, session.snapshot, session.tokens).ok()) std::abort();
  }
  Fill(engine, cache, kSessionLayers, session.tokens, kTurnTokens, index);
  const std::string taken = engine.Snapshot(cache, 0)->snapshot_id;
  if (!session.snapshot.empty()) (void)engine.ReleaseSnapshot(session.snapshot);
  session.snapshot = taken;
  session.tokens += kTurnTokens;
  (void)engine.DeleteCache(cache);
}

// Every token of every session holds the bytes Fill wrote for it.
bool SessionsIntact(Engine& engine, const std::vector<Session>& sessions) {
  std::vector<std::byte> keys(kTokenBytes), values(kTokenBytes);
  for (uint32_t i = 0; i < sessions.size(); ++i) {
    if (sessions[i].snapshot.empty()) continue;
    auto view = engine.Freeze("", sessions[i].snapshot);
    if (!view.ok()) return false;
    for (uint32_t layer = 0; layer < kSessionLayers; ++layer) {
      for (uint64_t t = 0; t < sessions[i].tokens; t += 37) {
        const KvOutput out{.keys = absl::MakeSpan(keys), .values = absl::MakeSpan(values)};
        const absl::Status read = (*view)->Read(layer, {t, t + 1}, out);
        const auto expected = static_cast<std::byte>((i * 131 + t) & 0xff);
        if (!read.ok() || keys[0] != expected || values[kTokenBytes - 1] != expected) {
          std::fprintf(stderr, "session %u layer %u token %llu: %s, key %d value %d, want %d\n", i,
                       layer, (unsigned long long)t, std::string(read.message()).c_str(),
                       int(keys[0]), int(values[kTokenBytes - 1]), int(expected));
          return false;
        }
      }
    }
  }
  return true;
}

void BM_Sessions(benchmark::State& state) {
  const bool fits = state.range(0) == 1;
  const uint64_t working_set = kSessions * kSessionBytes;
  const uint64_t device_bytes = fits ? working_set + (64 << 20) : working_set / 2;
  const gpu::PoolOptions options{.page_bytes = kPageBytes,
                                 .budget_bytes = device_bytes,
                                 .host_bytes = working_set / 4,
                                 .disk_path = DiskPath("sessions"),
                                 .disk_bytes = working_set};
  std::unique_ptr<gpu::PagePool> pool = *gpu::PagePool::Create(SharedDevice(), options);
  Engine engine(*pool, EngineOptions{.page_tokens = 256});
  const CacheSpec spec = ModelSpec(kSessionLayers);
  std::vector<Session> sessions(kSessions);
  constexpr int kThreads = 2;
  constexpr int kTurnsPerThread = 256;
  uint64_t turns = 0;
  for (auto _ : state) {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int turn = 0; turn < kTurnsPerThread; ++turn) {
          // Each thread owns half the sessions, visited round-robin: the
          // least recently used session is always the next one needed.
          const uint32_t index = (turn % (kSessions / kThreads)) * kThreads + t;
          Turn(engine, spec, sessions[index], index);
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    turns += kThreads * kTurnsPerThread;
  }
  if (!SessionsIntact(engine, sessions)) state.SkipWithError("a session's bytes changed");
  const gpu::PoolStats stats = pool->stats();
  state.counters["turns_per_s"] = benchmark::Counter(turns, benchmark::Counter::kIsRate);
  state.counters["update_GBps"] = benchmark::Counter(
      turns * 2.0 * kSessionLayers * kTurnTokens * kTokenBytes / 1e9, benchmark::Counter::kIsRate);
  state.counters["evicted"] = stats.evictions;
  state.counters["to_disk"] = stats.demotions;
  state.counters["promoted"] = stats.promotions_from_host + stats.promotions_from_disk;
  state.SetLabel(fits ? "fits the device" : "2x the device");
  for (Session& session : sessions) {
    if (!session.snapshot.empty()) (void)engine.ReleaseSnapshot(session.snapshot);
  }
}

BENCHMARK(BM_Sessions)->Arg(1)->Arg(0)->Iterations(2)->Unit(benchmark::kSecond)->UseRealTime();

}  // namespace
}  // namespace kvcache::engine

BENCHMARK_MAIN();
