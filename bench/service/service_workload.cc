#include "service_workload.h"

#include <algorithm>

namespace kvcache::bench {
namespace {


void AddLayer(v1::CacheSpec& spec, uint32_t window) {
  v1::LayerSpec* layer = spec.add_layers();
  layer->set_num_kv_heads(kHeads);
  layer->set_k_head_dim(kHeadDim);
  if (window == 0) {
    layer->mutable_standard();
  } else {
    layer->mutable_rotating()->set_max_size(window);
  }
}

}  // namespace

LayerUpdate TokensOf(uint32_t layer, const std::vector<std::byte>& payload) {
  const uint64_t tokens = payload.size() / kTokenBytes;
  const absl::Span<const std::byte> bytes(payload);
  return LayerUpdate{.layer = layer,
                     .dtype = v1::DTYPE_FLOAT16,
                     .keys_shape = {1, kHeads, tokens, kHeadDim},
                     .keys = bytes.subspan(0, payload.size() / 2),
                     .values_shape = {1, kHeads, tokens, kHeadDim},
                     .values = bytes.subspan(payload.size() / 2)};
}

v1::CacheSpec ThroughputSpec(uint32_t window) {
  v1::CacheSpec spec;
  spec.set_dtype(v1::DTYPE_FLOAT16);
  spec.set_model("service_bench");
  AddLayer(spec, window);
  return spec;
}

v1::CacheSpec LatencySpec() {
  v1::CacheSpec spec;
  spec.set_dtype(v1::DTYPE_FLOAT16);
  spec.set_model("service_bench_latency");
  for (uint32_t l = 0; l < kLatencyLayers; ++l) AddLayer(spec, 0);
  return spec;
}

std::vector<std::byte> PatternBytes(uint64_t bytes) {
  std::vector<std::byte> data(bytes);
  for (uint64_t i = 0; i < bytes; ++i) data[i] = static_cast<std::byte>(i * 131 + 7);
  return data;
}

v1::UpdateRequest MakeUpdateRequest(const std::string& cache_id, uint32_t layer,
                                    const std::vector<std::byte>& payload) {
  const LayerUpdate update = TokensOf(layer, payload);
  v1::UpdateRequest request;
  request.set_cache_id(cache_id);
  request.set_layer(layer);
  for (auto [tensor, data] : {std::pair{request.mutable_keys(), update.keys},
                              std::pair{request.mutable_values(), update.values}}) {
    tensor->set_dtype(update.dtype);
    for (uint64_t d : update.keys_shape) tensor->add_shape(d);
    tensor->set_data(reinterpret_cast<const char*>(data.data()), data.size());
  }
  return request;
}

absl::Status Fill(Client& client, const std::string& cache_id, uint32_t layers, uint64_t tokens) {
  constexpr uint64_t kMessageTokens = 1024;
  const std::vector<std::byte> full = PatternBytes(kMessageTokens * kTokenBytes);
  auto stream = client.OpenUpdate(cache_id);
  for (uint64_t done = 0; done < tokens; done += kMessageTokens) {
    const uint64_t count = std::min(kMessageTokens, tokens - done);
    const std::vector<std::byte> part(full.begin(), full.begin() + count * kTokenBytes);
    for (uint32_t layer = 0; layer < layers; ++layer) {
      if (!stream->Write(TokensOf(layer, part))) break;
    }
  }
  return stream->Finish().status();
}

absl::Status CheckTail(Client& client, const std::string& cache_id,
                       const std::vector<std::byte>& payload) {
  auto info = client.GetCache(cache_id);
  if (!info.ok()) return info.status();
  const uint64_t tokens = payload.size() / kTokenBytes;
  v1::FetchRequest request;
  request.set_cache_id(cache_id);
  request.set_start(info->offset() - tokens);
  std::vector<v1::FetchResponse> chunks;
  absl::Status status = client.Fetch(request, [&](const v1::FetchResponse& chunk) {
    chunks.push_back(chunk);
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  auto history = AssembleHistory(chunks);
  if (!history.ok()) return history.status();
  const size_t half = payload.size() / 2;
  if (history->tokens != tokens ||
      !std::equal(history->keys.begin(), history->keys.end(), payload.begin()) ||
      !std::equal(history->values.begin(), history->values.end(), payload.begin() + half)) {
    return absl::DataLossError("the cache's last tokens are not the bytes that were sent");
  }
  return absl::OkStatus();
}

absl::Status Decode(Client& client, const std::string& cache_id, uint32_t layers, int steps) {
  const std::vector<std::byte> token = PatternBytes(kTokenBytes);
  std::vector<LayerUpdate> step;
  for (uint32_t layer = 0; layer < layers; ++layer) step.push_back(TokensOf(layer, token));
  for (int i = 0; i < steps; ++i) {
    if (auto acks = client.Update(cache_id, step); !acks.ok()) return acks.status();
  }
  return absl::OkStatus();
}

}  // namespace kvcache::bench
