// Steady-state throughput of N concurrent workers, shared by the kvcached and
// Redis load generators so their numbers compare: every worker bumps its own
// counter once per completed message (an acknowledged Update, a received Fetch
// chunk, a Redis reply); the meter samples all counters after a warm-up and
// again after the measuring window, so connection set-up, pipeline fill and
// drain are never counted.
#pragma once

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace kvcache::bench {

struct MeterOptions {
  double warmup_seconds = 0.5;
  double measure_seconds = 2.5;
};

// What a worker sees: its counter and the stop flag it must poll.
struct WorkerContext {
  std::atomic<uint64_t> messages{0};
  std::atomic<bool> stop{false};
  std::string error;  // set by the worker when it fails; the row is then void
};

using Worker = std::function<void(WorkerContext&)>;

struct MeterResult {
  double messages_per_second = 0;
  std::string error;  // the first worker's failure, if any
};

// Runs `workers` concurrently, each on its own thread, and returns the summed
// rate of completed messages inside the measuring window.
inline MeterResult MeasureRate(const std::vector<Worker>& workers, const MeterOptions& options) {
  using Clock = std::chrono::steady_clock;
  std::vector<std::unique_ptr<WorkerContext>> contexts;
  std::vector<std::thread> threads;
  for (const Worker& worker : workers) {
    contexts.push_back(std::make_unique<WorkerContext>());
    threads.emplace_back([&worker, context = contexts.back().get()] { worker(*context); });
  }
  auto total = [&] {
    uint64_t sum = 0;
    for (const auto& context : contexts) sum += context->messages.load();
    return sum;
  };
  std::this_thread::sleep_for(std::chrono::duration<double>(options.warmup_seconds));
  const uint64_t first = total();
  const Clock::time_point start = Clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(options.measure_seconds));
  const uint64_t last = total();
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  for (auto& context : contexts) context->stop = true;
  for (std::thread& thread : threads) thread.join();
  MeterResult result{.messages_per_second = (last - first) / elapsed};
  for (const auto& context : contexts) {
    if (!context->error.empty() && result.error.empty()) result.error = context->error;
  }
  return result;
}

// Both load generators run with kvcached's malloc settings (server/main.cc):
// gRPC's MiB-sized message buffers stay in the heap instead of being mapped
// and unmapped per message. Redis uses jemalloc; hiredis is unaffected.
inline void KeepMessageBuffersInHeap() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
}

// Comma-separated integers ("65536,262144") as a list.
inline std::vector<uint64_t> ParseList(const std::string& text) {
  std::vector<uint64_t> values;
  size_t at = 0;
  while (at < text.size()) {
    size_t comma = text.find(',', at);
    if (comma == std::string::npos) comma = text.size();
    values.push_back(std::stoull(text.substr(at, comma - at)));
    at = comma + 1;
  }
  return values;
}

// One row of the table, as the run script parses it:
//   ROW <system> <op> <streams> <chunk_bytes> <GB/s> [error]
inline void PrintRow(const char* system, const char* op, uint64_t streams, uint64_t chunk_bytes,
                     const MeterResult& result) {
  const double gbps = result.messages_per_second * chunk_bytes / 1e9;
  std::printf("ROW %s %s %llu %llu %.3f%s%s\n", system, op,
              static_cast<unsigned long long>(streams),
              static_cast<unsigned long long>(chunk_bytes), result.error.empty() ? gbps : 0.0,
              result.error.empty() ? "" : " error: ", result.error.c_str());
  std::fflush(stdout);
}

// p-th percentile (0..100) of `samples`, which it sorts.
inline double Percentile(std::vector<double>& samples, double p) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const size_t index = std::min(samples.size() - 1, static_cast<size_t>(p / 100 * samples.size()));
  return samples[index];
}

}  // namespace kvcache::bench
