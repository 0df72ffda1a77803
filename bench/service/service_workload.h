// The caches and tensors service_bench sends: one geometry for every
// throughput row (8 KV heads x head dim 128, f16: 4 KiB of K+V per token, so a
// chunk of C bytes is C / 4096 tokens), and the latency runs' model-sized
// cache (16 such layers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kvcache_client.h"

namespace kvcache::bench {

constexpr uint32_t kHeads = 8;
constexpr uint32_t kHeadDim = 128;
constexpr uint64_t kTokenBytes = 2ull * kHeads * kHeadDim * 2;  // K + V, f16
constexpr uint32_t kLatencyLayers = 16;
// Latency contexts end this far past a page boundary.
constexpr uint64_t kLatencyOffPage = 5;

// One standard layer (window 0) or one rotating layer of `window` tokens.
v1::CacheSpec ThroughputSpec(uint32_t window);
// kLatencyLayers standard layers.
v1::CacheSpec LatencySpec();
// `bytes` of a non-zero pattern (so nothing can skip zero pages).
std::vector<std::byte> PatternBytes(uint64_t bytes);
// `payload` (keys then values, half each) as one layer's update.
LayerUpdate TokensOf(uint32_t layer, const std::vector<std::byte>& payload);
// An Update of `payload` (keys then values, half each) to `layer`.
v1::UpdateRequest MakeUpdateRequest(const std::string& cache_id, uint32_t layer,
                                    const std::vector<std::byte>& payload);
// Appends `tokens` tokens to each of the first `layers` layers, in 4 MiB messages.
absl::Status Fill(Client& client, const std::string& cache_id, uint32_t layers, uint64_t tokens);
// DATA_LOSS unless the last tokens of layer 0 are `payload`'s (keys, values).
absl::Status CheckTail(Client& client, const std::string& cache_id,
                       const std::vector<std::byte>& payload);
// `steps` decode steps: one token into each of `layers` layers per step.
absl::Status Decode(Client& client, const std::string& cache_id, uint32_t layers, int steps);

}  // namespace kvcache::bench
