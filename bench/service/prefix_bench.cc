// Prefix sharing over loopback; the server must be running already.
//
//   prefix_bench --address=127.0.0.1:50051 --ops=lookup,ttft
//
// lookup: LookupPrefix latency with --prefixes published prefixes of
//   --prefix_tokens tokens each (1M tokens in 10k prefixes by default), the
//   query a published prefix plus a few tokens of its own, beside the RPC's
//   floor: the same query in a layout with nothing published (a miss after
//   the same validation). The two alternate in rounds so both see the same
//   load. Prints p50 / p99 in microseconds and the ratio to the floor.
// ttft: time to a cache ready for the next token, for a worker whose
//   --ttft_tokens-token prompt (--ttft_layers layers) is cached: LookupPrefix
//   + CreateCache + Restore, beside streaming the same K/V with Update over
//   the data lane (--data_lane) into a new cache, as a worker without the
//   cache would after its prefill. Prints medians in milliseconds and the ratio.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "kvcache_client.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "kvcached address");
ABSL_FLAG(std::string, ops, "lookup,ttft", "what to measure");
ABSL_FLAG(uint32_t, prefixes, 10000, "lookup: published prefixes");
ABSL_FLAG(uint32_t, prefix_tokens, 100, "lookup: tokens of each");
ABSL_FLAG(uint32_t, lookups, 20000, "lookup: timed lookups of each kind");
ABSL_FLAG(uint32_t, ttft_tokens, 16384, "ttft: the cached prompt's tokens");
ABSL_FLAG(uint32_t, ttft_layers, 32, "ttft: layers (4 KV heads of 128 dims, float16)");
ABSL_FLAG(uint32_t, ttft_rounds, 5, "ttft: rounds of each kind");
ABSL_FLAG(std::string, data_lane, "auto", "ttft: ClientOptions::data_lane of the Update rows");

namespace kvcache::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double Percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  return values[std::min(values.size() - 1, static_cast<size_t>(p * values.size()))];
}

void Check(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "prefix_bench: %s: %s\n", what, status.ToString().c_str());
  std::exit(1);
}

v1::CacheSpec Spec(const std::string& model, uint32_t layers, uint32_t heads, uint32_t dim) {
  v1::CacheSpec spec;
  spec.set_model(model);
  spec.set_dtype(v1::DTYPE_FLOAT16);
  spec.set_batch_size(1);
  for (uint32_t i = 0; i < layers; ++i) {
    auto* layer = spec.add_layers();
    layer->set_num_kv_heads(heads);
    layer->set_k_head_dim(dim);
    layer->mutable_standard();
  }
  return spec;
}

// Appends `tokens` tokens of K/V (any bytes) to every layer, `per_message`
// tokens a message per layer.
void Stream(Client& client, const std::string& cache_id, const v1::CacheSpec& spec, uint64_t tokens,
            uint64_t per_message) {
  const uint32_t heads = spec.layers(0).num_kv_heads();
  const uint32_t dim = spec.layers(0).k_head_dim();
  std::vector<std::byte> tensor(uint64_t{heads} * per_message * dim * 2, std::byte{0x3c});
  for (uint64_t done = 0; done < tokens; done += per_message) {
    const uint64_t n = std::min(per_message, tokens - done);
    const std::vector<uint64_t> shape = {1, heads, n, dim};
    const auto bytes = absl::MakeConstSpan(tensor).subspan(0, heads * n * dim * 2);
    std::vector<LayerUpdate> updates;
    for (int layer = 0; layer < spec.layers_size(); ++layer) {
      updates.push_back(LayerUpdate{.layer = static_cast<uint32_t>(layer),
                                    .keys_shape = shape,
                                    .keys = bytes,
                                    .values_shape = shape,
                                    .values = bytes});
    }
    Check(client.Update(cache_id, updates).status(), "Update");
  }
}

void Lookup(Client& client) {
  const uint32_t prefixes = absl::GetFlag(FLAGS_prefixes);
  const uint32_t length = absl::GetFlag(FLAGS_prefix_tokens);
  const v1::CacheSpec spec = Spec("bench-lookup", 1, 1, 8);
  const v1::CacheSpec empty = Spec("bench-nothing-published", 1, 1, 8);
  // One snapshot of `length` tokens holds the K/V of every prefix: the index
  // is what is measured, not the pool.
  auto cache = client.CreateCache(spec);
  Check(cache.status(), "CreateCache");
  Stream(client, cache->cache_id(), spec, length, length);
  auto snapshot = client.Snapshot(cache->cache_id());
  Check(snapshot.status(), "Snapshot");
  std::mt19937_64 rng(42);
  std::vector<std::vector<uint32_t>> published(prefixes);
  const Clock::time_point publish_start = Clock::now();
  for (auto& tokens : published) {
    tokens.resize(length);
    for (uint32_t& token : tokens) token = rng() % 128000;
    Check(client.PublishPrefix(snapshot->snapshot_id(), tokens, {.ttl_seconds = 3600}).status(),
          "PublishPrefix");
  }
  const double publish_us = Micros(Clock::now() - publish_start) / prefixes;
  auto stats = client.GetStats();
  Check(stats.status(), "GetStats");
  std::printf("lookup index: %llu entries, %llu tokens; publish %.1f us each\n",
              (unsigned long long)stats->prefix_entries(),
              (unsigned long long)stats->prefix_tokens(), publish_us);

  std::vector<double> hit_us, floor_us;
  std::vector<std::string> handles;
  const uint32_t lookups = absl::GetFlag(FLAGS_lookups);
  constexpr uint32_t kRound = 500;
  for (uint32_t done = 0; done < lookups; done += kRound) {
    for (int kind = 0; kind < 2; ++kind) {
      for (uint32_t i = 0; i < kRound; ++i) {
        std::vector<uint32_t> query = published[rng() % prefixes];
        for (int extra = 0; extra < 20; ++extra) query.push_back(rng() % 128000);
        const Clock::time_point start = Clock::now();
        auto found = client.LookupPrefix(kind == 0 ? spec : empty, query, {.ttl_seconds = 30});
        const double us = Micros(Clock::now() - start);
        Check(found.status(), "LookupPrefix");
        if (kind == 0) {
          if (found->matched_tokens() != length) Check(absl::InternalError("missed"), "lookup");
          hit_us.push_back(us);
          handles.push_back(found->snapshot().snapshot_id());
        } else {
          floor_us.push_back(us);
        }
      }
    }
    for (const std::string& id : handles) Check(client.ReleaseSnapshot(id), "ReleaseSnapshot");
    handles.clear();
  }
  const double hit50 = Percentile(hit_us, 0.5), hit99 = Percentile(hit_us, 0.99);
  const double floor50 = Percentile(floor_us, 0.5), floor99 = Percentile(floor_us, 0.99);
  std::printf("lookup hit   p50 %.1f us  p99 %.1f us  (%zu lookups)\n", hit50, hit99,
              hit_us.size());
  std::printf("lookup floor p50 %.1f us  p99 %.1f us  (nothing published in that layout)\n",
              floor50, floor99);
  std::printf("lookup ratio p50 %.2fx  p99 %.2fx\n", hit50 / floor50, hit99 / floor99);
  Check(client.ReleaseSnapshot(snapshot->snapshot_id()), "ReleaseSnapshot");
  Check(client.DeleteCache(cache->cache_id()), "DeleteCache");
  auto entries = client.ListPrefixes();
  Check(entries.status(), "ListPrefixes");
  for (const v1::PrefixEntry& entry : *entries) {
    Check(client.ReleaseSnapshot(entry.snapshot().snapshot_id()), "ReleaseSnapshot");
  }
}

void TimeToFirstCache(const std::string& address) {
  auto client = Client::Connect({.address = address,
                                 .deadline = absl::Minutes(10),
                                 .max_message_bytes = 256 << 20,
                                 .dedicated_connection = true,
                                 .data_lane = absl::GetFlag(FLAGS_data_lane)});
  Check(client->WaitForReady(absl::Seconds(30)), "connect");
  const uint32_t tokens = absl::GetFlag(FLAGS_ttft_tokens);
  const v1::CacheSpec spec = Spec("bench-ttft", absl::GetFlag(FLAGS_ttft_layers), 4, 128);
  constexpr uint64_t kPerMessage = 1024;
  std::vector<uint32_t> prompt(tokens);
  for (uint32_t i = 0; i < tokens; ++i) prompt[i] = i * 7 + 3;

  // The first worker: prefill streamed in, snapshot, publish.
  auto first = client->CreateCache(spec);
  Check(first.status(), "CreateCache");
  Stream(*client, first->cache_id(), spec, tokens, kPerMessage);
  auto snapshot = client->Snapshot(first->cache_id());
  Check(snapshot.status(), "Snapshot");
  auto entry = client->PublishPrefix(snapshot->snapshot_id(), prompt, {.ttl_seconds = 3600});
  Check(entry.status(), "PublishPrefix");
  Check(client->ReleaseSnapshot(snapshot->snapshot_id()), "ReleaseSnapshot");
  Check(client->DeleteCache(first->cache_id()), "DeleteCache");
  const double kv_bytes = double(snapshot->size_bytes());

  std::vector<double> cached_ms, streamed_ms;
  for (uint32_t round = 0; round < absl::GetFlag(FLAGS_ttft_rounds); ++round) {
    Clock::time_point start = Clock::now();
    auto found = client->LookupPrefix(spec, prompt, {.ttl_seconds = 60});
    Check(found.status(), "LookupPrefix");
    auto cache = client->CreateCache(spec);
    Check(cache.status(), "CreateCache");
    Check(
        client->Restore(cache->cache_id(), found->snapshot().snapshot_id(), found->matched_tokens())
            .status(),
        "Restore");
    cached_ms.push_back(Micros(Clock::now() - start) / 1000);
    if (found->matched_tokens() != tokens) Check(absl::InternalError("missed"), "ttft lookup");
    Check(client->ReleaseSnapshot(found->snapshot().snapshot_id()), "ReleaseSnapshot");
    Check(client->DeleteCache(cache->cache_id()), "DeleteCache");

    start = Clock::now();
    auto streamed = client->CreateCache(spec);
    Check(streamed.status(), "CreateCache");
    Stream(*client, streamed->cache_id(), spec, tokens, kPerMessage);
    streamed_ms.push_back(Micros(Clock::now() - start) / 1000);
    Check(client->DeleteCache(streamed->cache_id()), "DeleteCache");
  }
  const double cached = Percentile(cached_ms, 0.5), streamed = Percentile(streamed_ms, 0.5);
  std::printf("ttft %u tokens x %u layers (%.0f MiB of K/V)\n", tokens, spec.layers_size(),
              kv_bytes / (1 << 20));
  std::printf("ttft cached   (Lookup + CreateCache + Restore) median %.2f ms\n", cached);
  std::printf("ttft streamed (CreateCache + Update over %s) median %.1f ms (%.2f GB/s)\n",
              absl::GetFlag(FLAGS_data_lane).empty() ? "gRPC" : "the data lane", streamed,
              kv_bytes / (streamed / 1000) / 1e9);
  std::printf("ttft ratio %.0fx\n", streamed / cached);
  Check(client->ReleaseSnapshot(entry->entry().snapshot_id()), "ReleaseSnapshot");
}

}  // namespace
}  // namespace kvcache::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string address = absl::GetFlag(FLAGS_address);
  auto client = kvcache::Client::Connect({.address = address, .dedicated_connection = true});
  kvcache::bench::Check(client->WaitForReady(absl::Seconds(30)), "connect");
  auto stats = client->GetStats();
  kvcache::bench::Check(stats.status(), "GetStats");
  std::printf("device: %s (%s transfers)\n", stats->device().c_str(),
              stats->transfer_path().c_str());
  for (absl::string_view op : absl::StrSplit(absl::GetFlag(FLAGS_ops), ',')) {
    if (op == "lookup") kvcache::bench::Lookup(*client);
    if (op == "ttft") kvcache::bench::TimeToFirstCache(address);
  }
  return 0;
}
