// Engine benchmarks, each beside memcpy of the same bytes:
//   BM_Snapshot / BM_Restore   latency vs context length; goal flat, and at 32k
//                              >= 50x faster than BM_MemcpyContext (same bytes)
//   BM_Update / BM_MemcpyUpdate  update throughput into the pool; goal >= 0.5x
//   BM_RotatingDecode           per-token cost at windows 512..32k; goal flat
//   BM_QuantizedMemory          pool bytes of a 32k quantized layer / the f16 one
//   BM_SpeculativeRound         begin, draft k tokens on every layer,
//                               commit k/2 or k, beside the same updates
//                               without a speculation; goal ratio <= 1.2
//   BM_SnapshotPerToken         k single-token steps with a snapshot
//                               after each, then a restore to the k/2-th or
//                               k-th, beside the k steps alone; goal <= 1.3
// The model shape is 16 layers, 8 KV heads, head dim 128, f16, batch 1.
// KVCACHED_BENCH_STAGING=1 runs the pool through the staging path instead.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "engine/engine.h"
#include "gpu/device.h"
#include "gpu/page_pool.h"

namespace kvcache::engine {
namespace {

constexpr uint32_t kLayers = 16;
constexpr uint32_t kHeads = 8;
constexpr uint32_t kHeadDim = 128;
constexpr uint64_t kTokenBytes = uint64_t{kHeads} * kHeadDim * 2;  // K or V, f16

struct Fixture {
  std::unique_ptr<gpu::Device> device;
  std::unique_ptr<gpu::PagePool> pool;
  std::unique_ptr<Engine> engine;
};

Fixture& Shared() {
  static Fixture* fixture = [] {
    auto* f = new Fixture;
    gpu::DeviceOptions options;
    options.force_staging = std::getenv("KVCACHED_BENCH_STAGING") != nullptr;
    f->device = *gpu::Device::Create(options);
    gpu::PoolOptions pool_options{.page_bytes = 16 * 2 * kTokenBytes,
                                  .budget_bytes = uint64_t{6} << 30};
    f->pool = *gpu::PagePool::Create(*f->device, pool_options);
    f->engine = std::make_unique<Engine>(*f->pool, EngineOptions{.page_tokens = 16});
    return f;
  }();
  return *fixture;
}

CacheSpec ModelSpec(decltype(LayerSpec::kind) kind, uint32_t layers = kLayers) {
  CacheSpec spec{.dtype = DType::kFloat16};
  for (uint32_t i = 0; i < layers; ++i) {
    spec.layers.push_back({.num_kv_heads = kHeads, .k_head_dim = kHeadDim, .kind = kind});
  }
  return spec;
}

// Fills every layer of `cache_id` with `tokens` tokens, `chunk` at a time.
void Fill(Engine& engine, const std::string& cache_id, uint32_t layers, uint64_t tokens,
          uint64_t chunk = 1024) {
  std::vector<std::byte> data(chunk * kTokenBytes, std::byte{7});
  for (uint64_t done = 0; done < tokens; done += chunk) {
    const uint64_t n = std::min(chunk, tokens - done);
    const KvInput kv{.keys = absl::MakeSpan(data.data(), n * kTokenBytes),
                     .values = absl::MakeSpan(data.data(), n * kTokenBytes),
                     .tokens = n};
    for (uint32_t layer = 0; layer < layers; ++layer) {
      if (!engine.Update(cache_id, layer, kv).ok()) std::abort();
    }
  }
}

// Times `body` alone (manual time), so the untimed set-up around it costs nothing.
template <typename Body>
void TimeOnly(benchmark::State& state, Body&& body) {
  const auto start = std::chrono::steady_clock::now();
  body();
  state.SetIterationTime(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

void BM_Snapshot(benchmark::State& state) {
  Engine& engine = *Shared().engine;
  const std::string id = engine.CreateCache(ModelSpec(StandardKind{}))->cache_id;
  Fill(engine, id, kLayers, state.range(0));
  for (auto _ : state) {
    absl::StatusOr<SnapshotInfo> info;
    TimeOnly(state, [&] { info = engine.Snapshot(id, 0); });
    if (!info.ok()) state.SkipWithError("snapshot failed");
    (void)engine.ReleaseSnapshot(info->snapshot_id);
  }
  state.counters["kv_bytes"] = 2.0 * kLayers * state.range(0) * kTokenBytes;
  (void)engine.DeleteCache(id);
}

// Rewind-and-restore, the way a worker uses it: the cache has moved on by a
// few decode tokens past the snapshot and is brought back to it.
void BM_Restore(benchmark::State& state) {
  Engine& engine = *Shared().engine;
  const std::string id = engine.CreateCache(ModelSpec(StandardKind{}))->cache_id;
  const uint64_t tokens = state.range(0);
  Fill(engine, id, kLayers, tokens);
  const std::string snapshot = engine.Snapshot(id, 0)->snapshot_id;
  for (auto _ : state) {
    Fill(engine, id, kLayers, 4, 4);
    absl::StatusOr<CacheInfo> info;
    TimeOnly(state, [&] { info = engine.Restore(id, snapshot, tokens); });
    if (!info.ok()) state.SkipWithError("restore failed");
  }
  state.counters["kv_bytes"] = 2.0 * kLayers * tokens * kTokenBytes;
  (void)engine.ReleaseSnapshot(snapshot);
  (void)engine.DeleteCache(id);
}

// What a copying snapshot costs: every K/V byte of the context, once.
void BM_MemcpyContext(benchmark::State& state) {
  const uint64_t bytes = 2ull * kLayers * state.range(0) * kTokenBytes;
  std::vector<std::byte> source(bytes, std::byte{1});
  std::vector<std::byte> destination(bytes);
  for (auto _ : state) {
    std::memcpy(destination.data(), source.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

constexpr uint64_t kUpdateTokens = 128;  // 1 MiB of K+V per update

void BM_Update(benchmark::State& state) {
  Engine& engine = *Shared().engine;
  const std::string id = engine.CreateCache(ModelSpec(StandardKind{}, 1))->cache_id;
  std::vector<std::byte> data(kUpdateTokens * kTokenBytes, std::byte{3});
  const KvInput kv{.keys = data, .values = data, .tokens = kUpdateTokens};
  uint64_t offset = 0;
  for (auto _ : state) {
    if (!engine.Update(id, 0, kv).ok()) state.SkipWithError("update failed");
    if ((offset += kUpdateTokens) >= 64 * 1024) {
      state.PauseTiming();
      (void)engine.Trim(id, offset);
      offset = 0;
      state.ResumeTiming();
    }
  }
  state.SetBytesProcessed(state.iterations() * 2 * data.size());
  (void)engine.DeleteCache(id);
}

// The same bytes copied into a 512 MiB destination, as the pool's pages are.
void BM_MemcpyUpdate(benchmark::State& state) {
  const uint64_t bytes = 2 * kUpdateTokens * kTokenBytes;
  std::vector<std::byte> source(bytes, std::byte{3});
  std::vector<std::byte> destination(512ull << 20);
  uint64_t at = 0;
  for (auto _ : state) {
    std::memcpy(destination.data() + at, source.data(), bytes);
    benchmark::ClobberMemory();
    at = (at + bytes) % destination.size();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_RotatingDecode(benchmark::State& state) {
  Engine& engine = *Shared().engine;
  const uint32_t window = state.range(0);
  const auto spec = ModelSpec(RotatingKind{.max_size = window, .keep = 4}, 1);
  const std::string id = engine.CreateCache(spec)->cache_id;
  Fill(engine, id, 1, window + 16, 256);
  std::vector<std::byte> token(kTokenBytes, std::byte{5});
  const KvInput kv{.keys = token, .values = token, .tokens = 1};
  for (auto _ : state) {
    if (!engine.Update(id, 0, kv).ok()) state.SkipWithError("update failed");
  }
  state.counters["held_bytes"] = engine.GetCache(id)->size_bytes;
  (void)engine.DeleteCache(id);
}

// The quantized memory bound: a 32k-token quantized layer (group 64, bits 4 or 8)
// holds at most bits/16 + 2/64 of the pool bytes the f16 layer of the same
// shape holds, plus page slack. Its own engine, with the default page_tokens
// (256): pages then fill up to their bytes, not to the 16 tokens of Shared().
void BM_QuantizedMemory(benchmark::State& state) {
  const uint32_t bits = static_cast<uint32_t>(state.range(0));
  Engine engine(*Shared().pool, EngineOptions{});
  constexpr uint64_t kTokens = 32768;
  double bytes[2] = {0, 0};  // f16, quantized
  for (auto _ : state) {
    for (int quantized = 0; quantized < 2; ++quantized) {
      decltype(LayerSpec::kind) kind = StandardKind{};
      if (quantized) kind = QuantizedKind{.group_size = 64, .bits = bits};
      const std::string id = engine.CreateCache(ModelSpec(kind, 1))->cache_id;
      Fill(engine, id, 1, kTokens);
      bytes[quantized] = static_cast<double>(engine.GetCache(id)->size_bytes);
      (void)engine.DeleteCache(id);
    }
  }
  state.counters["f16_bytes"] = bytes[0];
  state.counters["quantized_bytes"] = bytes[1];
  state.counters["ratio"] = bytes[1] / bytes[0];
  state.counters["bound"] = bits / 16.0 + 2.0 / 64;
}

// ---------------------------------------------------------------- speculation

// Layout 0: 16 standard layers. Layout 1: a hybrid of the kinds that speculate
// differently, four times over: a sliding window (512, 4 sinks), a global
// layer, a recurrent layer (conv 3 x 1024, delta 8 x 64 x 64: 70 KiB a state)
// and a chunked layer (1024).
CacheSpec LayoutSpec(int64_t layout) {
  if (layout == 0) return ModelSpec(StandardKind{});
  CacheSpec spec = ModelSpec(StandardKind{});
  for (uint32_t i = 0; i < kLayers; ++i) {
    switch (i % 4) {
      case 0: spec.layers[i].kind = RotatingKind{.max_size = 512, .keep = 4}; break;
      case 2:
        spec.layers[i] = LayerSpec{.kind = RecurrentKind{.conv_tail = 3, .conv_dim = 1024,
                                                         .num_v_heads = 8, .head_v_dim = 64,
                                                         .head_k_dim = 64}};
        break;
      case 3: spec.layers[i].kind = ChunkedKind{.chunk_size = 1024}; break;
      default: break;
    }
  }
  return spec;
}

void Must(const absl::Status& status) {
  if (status.ok()) return;
  std::fprintf(stderr, "bench: %s\n", status.ToString().c_str());
  std::abort();
}
template <typename T>
T Must(absl::StatusOr<T> result) {
  Must(result.status());
  return *std::move(result);
}

// One cache of a layout driven the ways a decoder would, all of them writing
// the same bytes: attention layers take one Update of the step's tokens,
// recurrent layers one state per token (the speculative way needs one per
// drafted token to cut back to; the plain steps send as many, so the two
// differ only in the speculation's own cost).
class Decoder {
 public:
  static constexpr uint64_t kContext = 1029;  // ends mid-page
  static constexpr uint64_t kFillChunk = 256;

  Decoder(Engine& engine, int64_t layout) : engine_(engine), spec_(LayoutSpec(layout)) {
    tokens_.assign(kFillChunk * kTokenBytes, std::byte{3});
    conv_.assign(3 * 1024 * 2, std::byte{5});
    delta_.assign(8 * 64 * 64 * 2, std::byte{7});
    Reset();
  }
  ~Decoder() {
    for (const SnapshotInfo& snapshot : snapshots_) {
      (void)engine_.ReleaseSnapshot(snapshot.snapshot_id);
    }
    (void)engine_.DeleteCache(id_);
  }

  // The k tokens as plain updates.
  void Plain(uint64_t k) {
    Write(k, 1, [&](uint32_t layer, const KvInput& kv) { return engine_.Update(id_, layer, kv); },
          [&](uint32_t layer, const StateInput& state) {
            return engine_.UpdateState(id_, layer, state);
          });
  }
  // Begin, the k tokens drafted, commit `accepted`.
  void SpeculativeRound(uint64_t k, uint64_t accepted) {
    const std::string id = Must(engine_.BeginSpeculation(id_, false)).speculation_id;
    Write(k, 1,
          [&](uint32_t layer, const KvInput& kv) {
            return engine_.UpdateSpeculation(id, id_, layer, kv);
          },
          [&](uint32_t layer, const StateInput& state) {
            return engine_.UpdateSpeculationState(id, id_, layer, state);
          });
    Must(engine_.CommitSpeculation(id, accepted).status());
    offset_ -= k - accepted;
  }
  // k single-token steps, each followed by a snapshot (from 0: a chunked
  // layer restores only from one holding its whole chunk); a restore to the
  // one after `accepted` tokens, the previous round's last snapshot standing
  // for none; every snapshot but the one now current released.
  void SnapshotPerToken(uint64_t k, uint64_t accepted) {
    if (snapshots_.empty()) snapshots_.push_back(Must(engine_.Snapshot(id_, 0)));
    for (uint64_t i = 0; i < k; ++i) {
      Plain(1);
      snapshots_.push_back(Must(engine_.Snapshot(id_, 0)));
    }
    const SnapshotInfo& target = snapshots_[accepted];
    Must(engine_.Restore(id_, target.snapshot_id, target.to_offset).status());
    const SnapshotInfo current = target;
    for (const SnapshotInfo& snapshot : snapshots_) {
      if (snapshot.snapshot_id != current.snapshot_id) {
        Must(engine_.ReleaseSnapshot(snapshot.snapshot_id));
      }
    }
    snapshots_ = {current};
    offset_ -= k - accepted;
  }
  // Starts over (untimed) once the history has grown by 2048 tokens.
  void Bound() {
    if (offset_ > kContext + 2048) Reset();
  }

 private:
  // `k` tokens on every layer: `states_per_step` recurrent states for each
  // token, or one for all of them when 0 (a prefill).
  template <typename Kv, typename State>
  void Write(uint64_t k, uint64_t states_per_token, Kv&& kv_update, State&& state_update) {
    const KvInput kv{.keys = absl::MakeSpan(tokens_.data(), k * kTokenBytes),
                     .values = absl::MakeSpan(tokens_.data(), k * kTokenBytes),
                     .tokens = k};
    const uint64_t states = states_per_token == 0 ? 1 : k * states_per_token;
    const StateInput state{.conv = conv_, .delta = delta_, .advance = k / states};
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      if (!IsRecurrent(spec_.layers[layer])) {
        Must(kv_update(layer, kv).status());
        continue;
      }
      for (uint64_t i = 0; i < states; ++i) Must(state_update(layer, state).status());
    }
    offset_ += k;
  }
  void Reset() {
    for (const SnapshotInfo& snapshot : snapshots_) {
      Must(engine_.ReleaseSnapshot(snapshot.snapshot_id));
    }
    snapshots_.clear();
    if (!id_.empty()) Must(engine_.DeleteCache(id_));
    id_ = Must(engine_.CreateCache(spec_)).cache_id;
    offset_ = 0;
    for (uint64_t done = 0; done < kContext; done += kFillChunk) {
      Write(std::min(kFillChunk, kContext - done), 0,
            [&](uint32_t layer, const KvInput& kv) { return engine_.Update(id_, layer, kv); },
            [&](uint32_t layer, const StateInput& state) {
              return engine_.UpdateState(id_, layer, state);
            });
    }
  }

  Engine& engine_;
  const CacheSpec spec_;
  std::string id_;
  uint64_t offset_ = 0;
  std::vector<std::byte> tokens_, conv_, delta_;
  std::vector<SnapshotInfo> snapshots_;
};

template <typename Body>
double Seconds(Body&& body) {
  const auto start = std::chrono::steady_clock::now();
  body();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Args: k (drafted tokens), layout (0 standard, 1 mixed), accepted (0: k/2,
// 1: all k). Accepting all keeps both caches writing fresh positions alike;
// accepting half makes the speculative way write over positions it wrote a
// round earlier, still in the CPU caches, which flatters it a little.
uint64_t Accepted(const benchmark::State& state) {
  return state.range(2) == 0 ? state.range(0) / 2 : state.range(0);
}

// Each iteration times both ways back to back on two caches (which goes
// first alternates), so the load of this shared machine weighs on both alike;
// the iteration's time is the speculative way's, `plain_us` the plain way's
// mean, `ratio` theirs.
template <typename Plain, typename Way>
void CompareWithPlain(benchmark::State& state, Plain&& plain_way, Way&& way) {
  const uint64_t k = state.range(0);
  Decoder plain(*Shared().engine, state.range(1));
  Decoder other(*Shared().engine, state.range(1));
  double plain_seconds = 0, way_seconds = 0;
  bool plain_first = true;
  for (auto _ : state) {
    if (plain_first) plain_seconds += Seconds([&] { plain_way(plain, k); });
    const double seconds = Seconds([&] { way(other, k); });
    if (!plain_first) plain_seconds += Seconds([&] { plain_way(plain, k); });
    plain_first = !plain_first;
    way_seconds += seconds;
    state.SetIterationTime(seconds);
    plain.Bound();
    other.Bound();
  }
  state.counters["plain_us"] = plain_seconds / state.iterations() * 1e6;
  state.counters["ratio"] = way_seconds / plain_seconds;
}

// Beside the same updates: one of k tokens per attention layer, k states per
// recurrent layer.
void BM_SpeculativeRound(benchmark::State& state) {
  CompareWithPlain(
      state, [](Decoder& d, uint64_t k) { d.Plain(k); },
      [&](Decoder& d, uint64_t k) { d.SpeculativeRound(k, Accepted(state)); });
}

// Beside the same k single-token steps without the snapshots and the restore
// (a snapshot between tokens needs the tokens one step at a time).
void BM_SnapshotPerToken(benchmark::State& state) {
  CompareWithPlain(
      state,
      [](Decoder& d, uint64_t k) {
        for (uint64_t i = 0; i < k; ++i) d.Plain(1);
      },
      [&](Decoder& d, uint64_t k) { d.SnapshotPerToken(k, Accepted(state)); });
}

BENCHMARK(BM_Snapshot)->Arg(1024)->Arg(4096)->Arg(16384)->Arg(32768)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Restore)->Arg(1024)->Arg(4096)->Arg(16384)->Arg(32768)->UseManualTime()->Unit(benchmark::kMicrosecond);
// Real time throughout: on the staging path the copying happens in the driver's
// threads, so the calling thread's CPU time would flatter it.
BENCHMARK(BM_MemcpyContext)->Arg(1024)->Arg(4096)->Arg(16384)->Arg(32768)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Update)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MemcpyUpdate)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_QuantizedMemory)->Arg(4)->Arg(8)->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RotatingDecode)->Arg(512)->Arg(4096)->Arg(32768)->UseRealTime()->Unit(benchmark::kMicrosecond);
// Args: k, layout, accepted (see Accepted).
BENCHMARK(BM_SpeculativeRound)->ArgsProduct({{1, 4, 8}, {0, 1}, {0, 1}})->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SnapshotPerToken)->ArgsProduct({{1, 4, 8}, {0, 1}, {0, 1}})->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvcache::engine

// As kvcached runs (server/main.cc): abseil's deadlock detection off.
int main(int argc, char** argv) {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
