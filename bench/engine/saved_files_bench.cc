// Saved prompt-cache files, each beside what dd does with the same bytes:
//   BM_Save / BM_DdWriteFsync   SavedFileStore::Save (encode, checksum, temp file,
//                               fsync, rename, directory fsync) vs
//                               `dd bs=1M conv=fsync` of the encoded file; goal >= 0.8x
//   BM_Load / BM_DdRead         SavedFileStore::Load (map, verify; tensors borrow
//                               the mapping) vs `dd bs=1M of=/dev/null`; goal >= 0.8x
//   BM_LoadSnapshot             Engine::LoadSnapshot: Load, then every tensor into
//                               pool pages and a registered snapshot (the RPC's work)
//   BM_MemcpyPeer               memcpy of the file's bytes from one resident buffer
//                               into another on 1 or 2 threads: what landing them in
//                               memory costs before any file is read (LoadSnapshot's
//                               floor where dd's 1 MiB buffer stays in cache)
// The file is a prompt cache of 16 layers, K and V [1, 8, tokens, 128] f16.
// Reads run warm (the file in the page cache, as just after a save) and cold
// (dropped from it before each read, so both read the disk).
// KVCACHED_BENCH_DIR picks the directory (default /tmp).
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/files/saved_files.h"
#include "gpu/device.h"
#include "gpu/page_pool.h"

namespace kvcache::engine {
namespace {

constexpr size_t kDdBlockBytes = 1 << 20;

std::string BenchDir() {
  const char* dir = std::getenv("KVCACHED_BENCH_DIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/kvcached_saved_files_bench_", getpid());
}

PromptCacheFile ModelFile(uint64_t tokens) {
  PromptCacheFile file;
  for (int layer = 0; layer < 16; ++layer) {
    for (int part = 0; part < 2; ++part) {
      FileTensor& tensor = file.tensors[absl::StrCat(layer, ".", part)];
      tensor.dtype = FileDType::kF16;
      tensor.shape = {1, 8, tokens, 128};
      tensor.data.resize(8 * tokens * 128 * 2);
      for (size_t i = 0; i < tensor.data.size(); i += 4096) tensor.data[i] = std::byte(i >> 12);
    }
    file.metadata[absl::StrCat("0.", layer)] = "";
    file.metadata[absl::StrCat("2.", layer)] = "KVCache";
  }
  return file;
}

struct Fixture {
  std::string dir = BenchDir();
  std::unique_ptr<SavedFileStore> store = *SavedFileStore::Open(dir, 0);
  ~Fixture() { std::filesystem::remove_all(dir); }
};

void DdWriteFsync(const std::string& path, const std::string& bytes) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  for (size_t at = 0; at < bytes.size(); at += kDdBlockBytes) {
    if (write(fd, bytes.data() + at, std::min(kDdBlockBytes, bytes.size() - at)) < 0) abort();
  }
  fsync(fd);
  close(fd);
}

// Drops a written (so clean) file from the page cache, so its next read hits the disk.
void DropFromPageCache(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0 || posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) abort();
  close(fd);
}

void DropIfCold(benchmark::State& state, const std::string& path) {
  if (state.range(1) == 0) return;
  state.PauseTiming();
  DropFromPageCache(path);
  state.ResumeTiming();
}

void DdRead(const std::string& path) {
  std::vector<char> block(kDdBlockBytes);
  int fd = open(path.c_str(), O_RDONLY);
  while (read(fd, block.data(), block.size()) > 0) benchmark::ClobberMemory();
  close(fd);
}

void BM_Save(benchmark::State& state) {
  Fixture fixture;
  const PromptCacheFile file = ModelFile(state.range(0));
  uint64_t bytes = 0;
  for (auto _ : state) {
    absl::StatusOr<SavedFileInfo> saved = fixture.store->Save("bench", file);
    if (!saved.ok()) state.SkipWithError(saved.status().ToString().c_str());
    bytes = saved->size_bytes;
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_DdWriteFsync(benchmark::State& state) {
  Fixture fixture;
  const std::string bytes = *EncodeSafetensorsBytes(ModelFile(state.range(0)));
  for (auto _ : state) DdWriteFsync(fixture.dir + "/dd.bin", bytes);
  state.SetBytesProcessed(state.iterations() * bytes.size());
}

void BM_Load(benchmark::State& state) {
  Fixture fixture;
  const uint64_t bytes = fixture.store->Save("bench", ModelFile(state.range(0)))->size_bytes;
  for (auto _ : state) {
    DropIfCold(state, fixture.dir + "/bench.safetensors");
    absl::StatusOr<DecodedSafetensors> loaded = fixture.store->Load("bench");
    if (!loaded.ok()) state.SkipWithError(loaded.status().ToString().c_str());
    benchmark::DoNotOptimize(loaded);
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

gpu::Device& SharedDevice() {
  static gpu::Device* device = gpu::Device::Create({})->release();
  return *device;
}

void BM_LoadSnapshot(benchmark::State& state) {
  Fixture fixture;
  const uint64_t bytes = fixture.store->Save("bench", ModelFile(state.range(0)))->size_bytes;
  auto pool =
      *gpu::PagePool::Create(SharedDevice(), {.page_bytes = 64 << 10, .budget_bytes = 3 * bytes});
  Engine engine(*pool, EngineOptions{.saved_files = fixture.store.get()});
  // Two loads first touch the pool pages the timed ones reuse: a fresh page's
  // first fault is the pool's one-time cost, not the load's.
  for (int warm = 0; warm < 2; ++warm) {
    std::vector<std::string> held;
    for (int i = 0; i < 2; ++i)
      held.push_back(engine.LoadSnapshot("bench", false, {})->snapshot.snapshot_id);
    for (const std::string& id : held) engine.ReleaseSnapshot(id).IgnoreError();
  }
  for (auto _ : state) {
    DropIfCold(state, fixture.dir + "/bench.safetensors");
    absl::StatusOr<LoadedSnapshot> loaded = engine.LoadSnapshot("bench", false, {});
    if (!loaded.ok()) state.SkipWithError(loaded.status().ToString().c_str());
    state.PauseTiming();
    if (!engine.ReleaseSnapshot(loaded->snapshot.snapshot_id).ok()) abort();
    state.ResumeTiming();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_DdRead(benchmark::State& state) {
  Fixture fixture;
  const std::string bytes = *EncodeSafetensorsBytes(ModelFile(state.range(0)));
  DdWriteFsync(fixture.dir + "/dd.bin", bytes);
  for (auto _ : state) {
    DropIfCold(state, fixture.dir + "/dd.bin");
    DdRead(fixture.dir + "/dd.bin");
  }
  state.SetBytesProcessed(state.iterations() * bytes.size());
}

void BM_MemcpyPeer(benchmark::State& state) {
  const size_t bytes = EncodeSafetensorsBytes(ModelFile(state.range(0)))->size();
  const int threads = static_cast<int>(state.range(1));
  std::vector<std::byte> from(bytes, std::byte{1});
  std::vector<std::byte> into(bytes, std::byte{2});  // written once: resident, as pool pages are
  for (auto _ : state) {
    std::vector<std::thread> helpers;
    const size_t share = bytes / threads;
    for (int t = 1; t < threads; ++t) {
      helpers.emplace_back([&, t] {
        const size_t end = t + 1 == threads ? bytes : share * (t + 1);
        std::memcpy(into.data() + share * t, from.data() + share * t, end - share * t);
      });
    }
    std::memcpy(into.data(), from.data(), share);
    for (std::thread& helper : helpers) helper.join();
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

// tokens 1024: 64 MiB; 4096: 256 MiB.
BENCHMARK(BM_Save)->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DdWriteFsync)->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond)->UseRealTime();
// Reads: {tokens, cold}.
void ReadArgs(benchmark::internal::Benchmark* bench) {
  bench->ArgNames({"tokens", "cold"})->Unit(benchmark::kMillisecond)->UseRealTime();
  for (int64_t cold : {0, 1}) {
    for (int64_t tokens : {1024, 4096}) bench->Args({tokens, cold});
  }
}
BENCHMARK(BM_Load)->Apply(ReadArgs);
BENCHMARK(BM_LoadSnapshot)->Apply(ReadArgs);
BENCHMARK(BM_DdRead)->Apply(ReadArgs);
BENCHMARK(BM_MemcpyPeer)
    ->ArgNames({"tokens", "threads"})
    ->ArgsProduct({{1024, 4096}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace kvcache::engine

BENCHMARK_MAIN();
