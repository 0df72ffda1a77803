// kvcache_prefix_worker: one model worker of the prefix-sharing end-to-end
// test, a process of its own. It serves a request of --prompt shared tokens
// followed by --extra tokens of its own (--seed), the way a worker would:
// LookupPrefix, CreateCache, Restore at the matched length, Update the rest,
// Snapshot, PublishPrefix, release its handles. It checks every restored
// byte against the K/V it would have computed itself (tests/support/
// prefix_kv.h) and prints one line of key=value for the test to read:
//   matched=N restore_new_pages=N identical=0|1 shared_tokens=N entry=ID
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "kvcache_client.h"
#include "support/prefix_kv.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "kvcached address");
ABSL_FLAG(uint32_t, prompt, 4096, "tokens of the prompt every worker shares");
ABSL_FLAG(uint32_t, extra, 16, "tokens of this worker's own after the prompt");
ABSL_FLAG(uint32_t, seed, 1, "picks this worker's own tokens");

namespace {

namespace prefix_kv = kvcache::testing::prefix_kv;

constexpr uint32_t kLayers = 2;
constexpr uint32_t kHeads = 2;
constexpr uint32_t kHeadDim = 64;
constexpr uint32_t kRowBytes = kHeadDim * 2;  // float16
constexpr uint64_t kTokensPerUpdate = 256;    // the test server's max_update_tokens

kvcache::v1::CacheSpec Spec() {
  kvcache::v1::CacheSpec spec;
  spec.set_model("prefix-worker-2L");
  spec.set_dtype(kvcache::v1::DTYPE_FLOAT16);
  spec.set_batch_size(1);
  for (uint32_t i = 0; i < kLayers; ++i) {
    auto* layer = spec.add_layers();
    layer->set_num_kv_heads(kHeads);
    layer->set_k_head_dim(kHeadDim);
    layer->mutable_standard();
  }
  return spec;
}

std::vector<uint32_t> RequestTokens() {
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < absl::GetFlag(FLAGS_prompt); ++i) tokens.push_back(1000 + i % 7919);
  uint64_t x = absl::GetFlag(FLAGS_seed);
  for (uint32_t i = 0; i < absl::GetFlag(FLAGS_extra); ++i) {
    tokens.push_back(static_cast<uint32_t>((x = prefix_kv::Mix(x)) % 50000));
  }
  return tokens;
}

int Fail(const char* step, const absl::Status& status) {
  std::fprintf(stderr, "prefix worker: %s: %s\n", step, status.ToString().c_str());
  return 1;
}

absl::StatusOr<uint64_t> PagesUsed(kvcache::Client& client) {
  auto stats = client.GetStats();
  if (!stats.ok()) return stats.status();
  return stats->pages_used();
}

// Positions [begin, end) of every layer, kTokensPerUpdate at a time.
absl::Status Prefill(kvcache::Client& client, const std::string& cache_id,
                     const std::vector<uint64_t>& hashes, uint64_t begin, uint64_t end) {
  for (uint64_t first = begin; first < end; first += kTokensPerUpdate) {
    const uint64_t last = std::min(end, first + kTokensPerUpdate);
    std::vector<std::vector<std::byte>> tensors;
    std::vector<kvcache::LayerUpdate> updates;
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      for (uint32_t side = 0; side < 2; ++side) {
        tensors.push_back(
            prefix_kv::SideTensor(hashes, layer, side, kHeads, kRowBytes, first, last));
      }
    }
    const std::vector<uint64_t> shape = {1, kHeads, last - first, kHeadDim};
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      updates.push_back(kvcache::LayerUpdate{.layer = layer,
                                             .keys_shape = shape,
                                             .keys = tensors[2 * layer],
                                             .values_shape = shape,
                                             .values = tensors[2 * layer + 1]});
    }
    if (auto done = client.Update(cache_id, updates); !done.ok()) return done.status();
  }
  return absl::OkStatus();
}

// Every layer of the cache holds exactly positions [0, end) as computed.
absl::StatusOr<bool> Identical(kvcache::Client& client, const std::string& cache_id,
                               const std::vector<uint64_t>& hashes, uint64_t end) {
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    auto history = client.FetchLayer(cache_id, "", layer);
    if (!history.ok()) return history.status();
    const bool same =
        history->tokens == end &&
        history->keys == prefix_kv::SideTensor(hashes, layer, 0, kHeads, kRowBytes, 0, end) &&
        history->values == prefix_kv::SideTensor(hashes, layer, 1, kHeads, kRowBytes, 0, end);
    if (!same) return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  auto client = kvcache::Client::Connect({.address = absl::GetFlag(FLAGS_server)});
  if (auto ready = client->WaitForReady(absl::Seconds(30)); !ready.ok())
    return Fail("connect", ready);
  const std::vector<uint32_t> tokens = RequestTokens();
  const std::vector<uint64_t> hashes = prefix_kv::PrefixHashes(tokens);

  auto found = client->LookupPrefix(Spec(), tokens, {.ttl_seconds = 60});
  if (!found.ok()) return Fail("LookupPrefix", found.status());
  auto cache = client->CreateCache(Spec());
  if (!cache.ok()) return Fail("CreateCache", cache.status());
  const uint64_t matched = found->matched_tokens();
  int64_t restore_new_pages = 0;
  bool identical = true;
  if (matched > 0) {
    auto before = PagesUsed(*client);
    if (!before.ok()) return Fail("GetStats", before.status());
    auto restored = client->Restore(cache->cache_id(), found->snapshot().snapshot_id(), matched);
    if (!restored.ok()) return Fail("Restore", restored.status());
    auto after = PagesUsed(*client);
    if (!after.ok()) return Fail("GetStats", after.status());
    restore_new_pages = static_cast<int64_t>(*after) - static_cast<int64_t>(*before);
    auto same = Identical(*client, cache->cache_id(), hashes, matched);
    if (!same.ok()) return Fail("Fetch", same.status());
    identical = *same;
    if (auto released = client->ReleaseSnapshot(found->snapshot().snapshot_id()); !released.ok()) {
      return Fail("ReleaseSnapshot", released);
    }
  }
  if (auto filled = Prefill(*client, cache->cache_id(), hashes, matched, tokens.size());
      !filled.ok()) {
    return Fail("Update", filled);
  }
  auto snapshot = client->Snapshot(cache->cache_id());
  if (!snapshot.ok()) return Fail("Snapshot", snapshot.status());
  auto published = client->PublishPrefix(snapshot->snapshot_id(), tokens, {.ttl_seconds = 600});
  if (!published.ok()) return Fail("PublishPrefix", published.status());
  if (auto released = client->ReleaseSnapshot(snapshot->snapshot_id()); !released.ok()) {
    return Fail("ReleaseSnapshot", released);
  }
  if (auto deleted = client->DeleteCache(cache->cache_id()); !deleted.ok()) {
    return Fail("DeleteCache", deleted);
  }
  std::printf("matched=%llu restore_new_pages=%lld identical=%d shared_tokens=%llu entry=%s\n",
              (unsigned long long)matched, (long long)restore_new_pages, identical ? 1 : 0,
              (unsigned long long)published->shared_tokens(),
              published->entry().snapshot_id().c_str());
  return 0;
}
