// kvcache_demo: what a model worker does with kvcached, on a toy model.
// Streams a few hundred tokens of K/V for several layers (standard and
// sliding-window), snapshots, branches, rewinds, restores, fetches everything
// back and checks every byte against the toy model.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/random/random.h"
#include "absl/strings/str_format.h"
#include "kvcache_client.h"
#include "tools/connection_flags.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "kvcached address");
ABSL_FLAG(std::string, data_lane, "auto",
          "where Update and Fetch go: auto (the server's data lane, else gRPC), empty (gRPC) or "
          "host:port");
ABSL_FLAG(std::string, token, "",
          "bearer token of the demo's tenant (kvcached --tokens_file); default: "
          "$KVCACHE_TOKEN");
ABSL_FLAG(std::string, tls_ca, "",
          "TLS to kvcached (kvcached --tls_cert), trusting this PEM CA; default: $KVCACHE_TLS_CA");
ABSL_FLAG(std::string, other_token, "",
          "a second tenant's token: the demo then shows that tenant sees none of its caches; "
          "default: $KVCACHE_OTHER_TOKEN");

namespace {

using kvcache::v1::CacheSpec;

// The demo's tenant at --server, with TLS where --tls_ca (or
// $KVCACHE_TLS_CA) names the CA that signed kvcached's certificate: gRPC and
// the data lane both run TLS then.
absl::StatusOr<kvcache::ClientOptions> DemoOptions() {
  return kvcache::ClientOptionsFrom(
      {.address = absl::GetFlag(FLAGS_server),
       .token = kvcache::OrEnvironment(absl::GetFlag(FLAGS_token), "KVCACHE_TOKEN"),
       .tls_ca_file = kvcache::OrEnvironment(absl::GetFlag(FLAGS_tls_ca), "KVCACHE_TLS_CA")});
}

constexpr uint32_t kLayers = 4;      // layers 0-2 standard, layer 3 a 128-token window
constexpr uint32_t kHeads = 4;
constexpr uint32_t kHeadDim = 64;
constexpr uint32_t kWindow = 128;
constexpr uint32_t kSinks = 4;

// The toy model's K or V element for (layer, position, head, dim): any fixed
// function will do, since kvcached never interprets the bits.
uint16_t ToyElement(uint32_t layer, bool value, uint64_t position, uint32_t head, uint32_t dim) {
  uint64_t x = (position * 1315423911u) ^ (layer << 24) ^ (head << 16) ^ (dim << 1) ^ value;
  x ^= x >> 13;
  x *= 0x9E3779B97F4A7C15ull;
  return static_cast<uint16_t>(x >> 48) & 0x7BFF;  // a finite f16
}

std::vector<std::byte> ToyTensor(uint32_t layer, bool value, uint64_t first, uint64_t tokens) {
  std::vector<uint16_t> elements;
  for (uint32_t h = 0; h < kHeads; ++h) {
    for (uint64_t t = first; t < first + tokens; ++t) {
      for (uint32_t d = 0; d < kHeadDim; ++d) elements.push_back(ToyElement(layer, value, t, h, d));
    }
  }
  std::vector<std::byte> bytes(elements.size() * 2);
  std::memcpy(bytes.data(), elements.data(), bytes.size());
  return bytes;
}

CacheSpec ToySpec() {
  CacheSpec spec;
  spec.set_dtype(kvcache::v1::DTYPE_FLOAT16);
  spec.set_batch_size(1);
  spec.set_model("toy-4L");
  for (uint32_t i = 0; i < kLayers; ++i) {
    auto* layer = spec.add_layers();
    layer->set_num_kv_heads(kHeads);
    layer->set_k_head_dim(kHeadDim);
    if (i + 1 == kLayers) {
      layer->mutable_rotating()->set_max_size(kWindow);
      layer->mutable_rotating()->set_keep(kSinks);
    } else {
      layer->mutable_standard();
    }
  }
  return spec;
}

// One forward step of the toy model: `tokens` new tokens on every layer.
absl::Status Step(kvcache::Client& client, const std::string& cache_id, uint64_t first,
                  uint64_t tokens) {
  std::vector<std::vector<std::byte>> buffers;
  std::vector<kvcache::LayerUpdate> updates;
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    buffers.push_back(ToyTensor(layer, false, first, tokens));
    buffers.push_back(ToyTensor(layer, true, first, tokens));
  }
  const std::vector<uint64_t> shape = {1, kHeads, tokens, kHeadDim};
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    updates.push_back({.layer = layer, .keys_shape = shape, .keys = buffers[2 * layer],
                       .values_shape = shape, .values = buffers[2 * layer + 1],
                       .expected_offset = first});
  }
  return client.Update(cache_id, updates).status();
}

absl::Status Generate(kvcache::Client& client, const std::string& id, uint64_t& offset,
                      uint64_t prefill, uint64_t decode) {
  if (prefill > 0) {
    if (auto s = Step(client, id, offset, prefill); !s.ok()) return s;
    offset += prefill;
  }
  for (uint64_t i = 0; i < decode; ++i, ++offset) {
    if (auto s = Step(client, id, offset, 1); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// Fetches every layer and compares it with what the toy model wrote; the last
// layer is ToySpec's window unless `last_is_window` is false (ChatSpec).
absl::Status Verify(kvcache::Client& client, const std::string& id, uint64_t offset,
                    bool last_is_window = true) {
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    auto history = client.FetchLayer(id, "", layer);
    if (!history.ok()) return history.status();
    std::vector<std::byte> want_k, want_v;
    std::string ranges;
    for (const auto& [begin, end] : history->ranges) {
      absl::StrAppendFormat(&ranges, " [%d, %d)", begin, end);
    }
    // Expected: per head, the held positions in temporal order.
    std::vector<std::byte> k, v;
    for (uint32_t h = 0; h < kHeads; ++h) {
      for (const auto& [begin, end] : history->ranges) {
        for (uint64_t t = begin; t < end; ++t) {
          for (uint32_t d = 0; d < kHeadDim; ++d) {
            const uint16_t ek = ToyElement(layer, false, t, h, d);
            const uint16_t ev = ToyElement(layer, true, t, h, d);
            k.insert(k.end(), reinterpret_cast<const std::byte*>(&ek), reinterpret_cast<const std::byte*>(&ek) + 2);
            v.insert(v.end(), reinterpret_cast<const std::byte*>(&ev), reinterpret_cast<const std::byte*>(&ev) + 2);
          }
        }
      }
    }
    const bool rotating = last_is_window && layer + 1 == kLayers;
    const uint64_t expect_tokens = rotating ? std::min<uint64_t>(offset, kWindow) : offset;
    if (history->keys != k || history->values != v || history->tokens != expect_tokens) {
      return absl::DataLossError(absl::StrFormat("layer %d: fetched bytes differ", layer));
    }
    absl::PrintF("  layer %d (%s): %3d tokens%s, every byte matches\n", layer,
                rotating ? "window" : "standard", history->tokens, ranges);
  }
  return absl::OkStatus();
}

int Check(const absl::Status& status, const char* what) {
  if (status.ok()) return 0;
  std::fprintf(stderr, "demo: %s failed: %s\n", what, status.ToString().c_str());
  return 1;
}

// A Snapshot sent twice with one request_id, as the client's retry after a
// lost answer sends it: the server answers the second from its request log,
// so there is one snapshot, not two.
absl::Status ShowRetries(kvcache::Client& client, const std::string& cache_id) {
  kvcache::v1::SnapshotRequest request;
  request.set_cache_id(cache_id);
  absl::BitGen random;  // a new id each run: one id names one request
  request.set_request_id(absl::StrFormat("demo-%016x", absl::Uniform<uint64_t>(random)));
  kvcache::v1::SnapshotInfo first, second;
  for (kvcache::v1::SnapshotInfo* answer : {&first, &second}) {
    grpc::ClientContext context;
    const grpc::Status status = client.stub().Snapshot(&context, request, answer);
    if (!status.ok()) return absl::InternalError(status.error_message());
  }
  if (second.snapshot_id() != first.snapshot_id()) {
    return absl::InternalError("a retried Snapshot made a second snapshot");
  }
  auto stats = client.GetStats();
  if (!stats.ok()) return stats.status();
  absl::PrintF(
      "a Snapshot sent twice with one request_id (a retry after a lost answer) made one "
      "snapshot: %s both times (%d request(s) answered from the request log)\n",
      first.snapshot_id(), stats->requests_replayed());
  return client.ReleaseSnapshot(first.snapshot_id());
}

// A snapshot leased for one second that no one names again runs out and is
// released by the server; a pinned one would not.
absl::Status ShowLeases(kvcache::Client& client, const std::string& cache_id) {
  auto scratch = client.Snapshot(cache_id, {.ttl_seconds = 1});
  if (!scratch.ok()) return scratch.status();
  auto pinned = client.SetPinned(scratch->snapshot_id(), true);
  if (!pinned.ok()) return pinned.status();
  auto unpinned = client.SetPinned(scratch->snapshot_id(), false);
  if (!unpinned.ok()) return unpinned.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::Status gone;
  while ((gone = client.RenewLease({}, {scratch->snapshot_id()}).status()).ok() &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1200));  // longer than its lease: the renewal comes late
  }
  if (gone.code() != absl::StatusCode::kNotFound) {
    return absl::InternalError(absl::StrCat("a 1 s lease did not run out: ", gone.ToString()));
  }
  auto stats = client.GetStats();
  if (!stats.ok()) return stats.status();
  absl::PrintF(
      "a second snapshot, pinned then unpinned with a 1 s lease, ran out unrenewed: "
      "now NOT_FOUND (%d snapshot(s) expired so far)\n",
      stats->snapshots_expired());
  return absl::OkStatus();
}

// The snapshot as an mlx-lm prompt-cache file in the server's data dir, then
// loaded back into a new snapshot that a fresh cache restores from: what a
// restarted server or an mlx-lm user would do with the file.
absl::Status ShowPromptCacheFile(kvcache::Client& client, const std::string& snapshot_id,
                                 uint64_t offset) {
  auto saved = client.SaveSnapshot(snapshot_id, "demo-chat", {{"model", "toy"}});
  if (!saved.ok()) return saved.status();
  auto loaded = client.LoadSnapshot(saved->name());
  if (!loaded.ok()) return loaded.status();
  absl::PrintF(
      "saved it as demo-chat.safetensors (%d bytes, mlx-lm's save_prompt_cache layout) and "
      "loaded it back: snapshot %s, model \"%s\", checksum %s\n",
      saved->size_bytes(), loaded->snapshot().snapshot_id().c_str(), loaded->spec().model().c_str(),
      loaded->checksum_verified() ? "verified" : "absent");
  auto copy = client.CreateCache(loaded->spec());
  if (!copy.ok()) return copy.status();
  auto restored = client.Restore(copy->cache_id(), loaded->snapshot().snapshot_id(), offset);
  if (!restored.ok()) return restored.status();
  absl::PrintF("a new cache restored from the loaded file holds the same K/V:\n");
  if (absl::Status verified = Verify(client, copy->cache_id(), offset); !verified.ok()) {
    return verified;
  }
  if (absl::Status deleted = client.DeleteCache(copy->cache_id()); !deleted.ok()) return deleted;
  return client.ReleaseSnapshot(loaded->snapshot().snapshot_id());
}

// A layout of standard layers only: a prefix of it restores at any length
// (a window's state exists only where its snapshot ends).
CacheSpec ChatSpec() {
  CacheSpec spec = ToySpec();
  spec.set_model("toy-4L-full");
  spec.mutable_layers(kLayers - 1)->mutable_standard();
  return spec;
}

// One worker's request: the shared system prompt, then its own question.
std::vector<uint32_t> Request(uint32_t system_tokens, uint32_t question_tokens, uint32_t seed) {
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < system_tokens; ++i) tokens.push_back(10000 + i);
  for (uint32_t i = 0; i < question_tokens; ++i) tokens.push_back(seed * 1000 + i);
  return tokens;
}

// A worker's whole flow: LookupPrefix, CreateCache, Restore what is cached,
// Update the rest, Snapshot, PublishPrefix, release its handles. Returns the
// tokens it found cached; `restore_pages` gets the pages the restore took.
absl::StatusOr<uint64_t> ServeRequest(kvcache::Client& worker, const std::vector<uint32_t>& tokens,
                                      int64_t& restore_pages) {
  auto found = worker.LookupPrefix(ChatSpec(), tokens, {.ttl_seconds = 60});
  if (!found.ok()) return found.status();
  auto cache = worker.CreateCache(ChatSpec());
  if (!cache.ok()) return cache.status();
  const uint64_t cached = found->matched_tokens();
  restore_pages = 0;
  if (cached > 0) {
    auto before = worker.GetStats();
    if (!before.ok()) return before.status();
    auto restored = worker.Restore(cache->cache_id(), found->snapshot().snapshot_id(), cached);
    if (!restored.ok()) return restored.status();
    auto after = worker.GetStats();
    if (!after.ok()) return after.status();
    restore_pages = int64_t(after->pages_used()) - int64_t(before->pages_used());
    if (auto s = worker.ReleaseSnapshot(found->snapshot().snapshot_id()); !s.ok()) return s;
  }
  uint64_t offset = cached;
  if (auto s = Generate(worker, cache->cache_id(), offset, tokens.size() - cached, 0); !s.ok()) {
    return s;
  }
  if (auto s = Verify(worker, cache->cache_id(), offset, /*last_is_window=*/false); !s.ok()) {
    return s;
  }
  auto snapshot = worker.Snapshot(cache->cache_id());
  if (!snapshot.ok()) return snapshot.status();
  auto published = worker.PublishPrefix(snapshot->snapshot_id(), tokens, {.ttl_seconds = 600});
  if (!published.ok()) return published.status();
  if (auto s = worker.ReleaseSnapshot(snapshot->snapshot_id()); !s.ok()) return s;
  if (auto s = worker.DeleteCache(cache->cache_id()); !s.ok()) return s;
  return cached;
}

// Two workers (two connections) answer questions after the same 512-token
// system prompt: the second finds the first's K/V of it and streams only its
// own tokens.
absl::Status ShowPrefixSharing(const kvcache::ClientOptions& demo, const std::string& data_lane) {
  constexpr uint32_t kSystem = 512, kQuestion = 32;
  int64_t restore_pages = 0;
  for (uint32_t worker_index = 1; worker_index <= 2; ++worker_index) {
    kvcache::ClientOptions own = demo;
    own.dedicated_connection = true;
    own.data_lane = data_lane;
    auto worker = kvcache::Client::Connect(own);
    const std::vector<uint32_t> tokens = Request(kSystem, kQuestion, worker_index);
    absl::PrintF("worker %d: a request of %d tokens (%d of system prompt, %d of its own)\n",
                 worker_index, tokens.size(), kSystem, kQuestion);
    auto cached = ServeRequest(*worker, tokens, restore_pages);
    if (!cached.ok()) return cached.status();
    if (*cached == 0) {
      absl::PrintF(
          "worker %d: LookupPrefix found nothing cached; streamed all %d tokens, checked "
          "every byte, published them\n",
          worker_index, tokens.size());
    } else {
      absl::PrintF(
          "worker %d: LookupPrefix found %d tokens cached; restored them taking %d new pages, "
          "streamed only %d tokens, checked every byte, published all %d\n",
          worker_index, *cached, restore_pages, tokens.size() - *cached, tokens.size());
    }
  }
  auto entries = kvcache::Client::Connect(demo)->ListPrefixes();
  if (!entries.ok()) return entries.status();
  for (const auto& entry : *entries) {
    absl::PrintF("  prefix entry %s: %d tokens, %d KiB, %d hit(s)\n",
                 entry.snapshot().snapshot_id().c_str(), entry.tokens(),
                 entry.snapshot().size_bytes() >> 10, entry.hits());
  }
  return absl::OkStatus();
}

}  // namespace

// A fleet's sessions on a device too small for all of them (the demo starts
// kvcached with --pool_bytes=32MiB --host_bytes=64MiB): the pages of idle
// sessions' snapshots move to host memory when new work needs the device, and
// come back when a session resumes.
absl::Status ShowTiers(kvcache::Client& client) {
  constexpr int kSessions = 8;
  constexpr uint64_t kSessionTokens = 2048;
  std::vector<std::string> snapshots;
  for (int i = 0; i < kSessions; ++i) {
    auto cache = client.CreateCache(ToySpec());
    if (!cache.ok()) return cache.status();
    // A prefill, then a few decode steps: the window layer is back to its
    // 128 tokens after a prompt longer than it (mlx-lm keeps the whole prompt
    // until the next step).
    uint64_t offset = 0;
    if (auto s = Generate(client, cache->cache_id(), offset, kSessionTokens - 8, 8); !s.ok()) {
      return s;
    }
    auto snapshot = client.Snapshot(cache->cache_id());
    if (!snapshot.ok()) return snapshot.status();
    snapshots.push_back(snapshot->snapshot_id());
    if (auto s = client.DeleteCache(cache->cache_id()); !s.ok()) return s;
  }
  auto stats = client.GetStats();
  if (!stats.ok()) return stats.status();
  absl::PrintF(
      "%d idle sessions of %d tokens on a %d MiB device: %d pages evicted, %d of %d host-memory "
      "pages in use, %d on disk\n",
      kSessions, kSessionTokens, stats->pool_bytes_total() >> 20, stats->evictions(),
      stats->host_pages_used(), stats->host_pages_total(), stats->disk_pages_used());
  auto listed = client.ListSnapshots();
  if (!listed.ok()) return listed.status();
  for (const auto& info : *listed) {
    if (info.snapshot_id() != snapshots[0]) continue;
    absl::PrintF(
        "session 0's snapshot: %d KiB on the device, %d KiB in host memory, %d KiB on disk\n",
        info.device_bytes() >> 10, info.host_bytes() >> 10, info.disk_bytes() >> 10);
  }
  auto cache = client.CreateCache(ToySpec());
  if (!cache.ok()) return cache.status();
  if (auto s = client.Restore(cache->cache_id(), snapshots[0], kSessionTokens).status(); !s.ok()) {
    return s;
  }
  auto after = client.GetStats();
  if (!after.ok()) return after.status();
  absl::PrintF("session 0 resumed (%d pages brought back from host memory):\n",
               after->promotions_from_host() - stats->promotions_from_host());
  if (auto s = Verify(client, cache->cache_id(), kSessionTokens); !s.ok()) return s;
  for (const std::string& snapshot : snapshots) {
    if (auto s = client.ReleaseSnapshot(snapshot); !s.ok()) return s;
  }
  return client.DeleteCache(cache->cache_id());
}

// What a second tenant sees of the demo's cache: nothing. Its lists are
// empty and the demo's id is NOT_FOUND, as an id nobody holds would be; a
// call without a token is UNAUTHENTICATED.
absl::Status ShowTenants(const kvcache::ClientOptions& demo, const std::string& cache_id) {
  kvcache::ClientOptions others = demo;
  others.token = kvcache::OrEnvironment(absl::GetFlag(FLAGS_other_token), "KVCACHE_OTHER_TOKEN");
  if (others.token.empty()) return absl::OkStatus();
  auto other = kvcache::Client::Connect(others);
  auto stats = other->GetStats();
  if (!stats.ok()) return stats.status();
  auto caches = other->ListCaches();
  if (!caches.ok()) return caches.status();
  const absl::Status theirs = other->GetCache(cache_id).status();
  absl::PrintF("tenant %s (another token) lists %d caches; GetCache of the demo's cache: %s\n",
               stats->tenant(), caches->size(), theirs.ToString());
  if (!absl::IsNotFound(theirs) || !caches->empty()) {
    return absl::InternalError("another tenant reached the demo's cache");
  }
  kvcache::ClientOptions tokenless = demo;
  tokenless.token.clear();
  const absl::Status anonymous = kvcache::Client::Connect(tokenless)->ListCaches().status();
  absl::PrintF("a call without a token: %s\n", anonymous.ToString());
  if (!absl::IsUnauthenticated(anonymous)) {
    return absl::InternalError("a call without a token was not refused");
  }
  return absl::OkStatus();
}

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::StatusOr<kvcache::ClientOptions> demo = DemoOptions();
  if (Check(demo.status(), "options")) return 1;
  kvcache::ClientOptions options = *demo;
  options.data_lane = absl::GetFlag(FLAGS_data_lane);
  auto client = kvcache::Client::Connect(options);
  if (Check(client->WaitForReady(absl::Seconds(30)), "connect")) return 1;
  absl::PrintF("connected to %s; Update and Fetch go over %s\n", absl::GetFlag(FLAGS_server),
               !client->uses_data_lane() ? "gRPC"
               : !options.tls            ? "the data lane (plain TCP)"
                                         : "the data lane (TLS 1.3, as gRPC)");
  auto cache = client->CreateCache(ToySpec());
  if (Check(cache.status(), "CreateCache")) return 1;
  const std::string id = cache->cache_id();
  absl::PrintF("created cache %s: %d layers (3 standard, 1 window of %d with %d sinks), "
              "%d KV heads x %d, f16\n", id.c_str(), kLayers, kWindow, kSinks, kHeads, kHeadDim);

  uint64_t offset = 0;
  if (Check(Generate(*client, id, offset, 200, 56), "prefill/decode")) return 1;
  absl::PrintF("streamed a 200-token prefill and 56 decode steps: offset %d\n", offset);
  auto snapshot = client->Snapshot(id, {.ttl_seconds = 600});
  if (Check(snapshot.status(), "Snapshot")) return 1;
  absl::PrintF(
      "snapshot %s covers [0, %d), %d bytes of shared pages (no copy), leased for "
      "%ds (each call that names it renews it)\n",
      snapshot->snapshot_id().c_str(), snapshot->to_offset(), snapshot->size_bytes(),
      snapshot->ttl_seconds());
  if (Check(ShowLeases(*client, id), "leases")) return 1;
  if (Check(ShowRetries(*client, id), "retries")) return 1;

  if (Check(Generate(*client, id, offset, 0, 40), "branch")) return 1;
  absl::PrintF("decoded a 40-token branch: offset %d\n", offset);
  auto rewind = client->Restore(id, "", 256);
  absl::PrintF("live rewind to 256: %s\n", rewind.ok() ? "ok" : rewind.status().ToString().c_str());
  auto restored = client->Restore(id, snapshot->snapshot_id(), 256);
  if (Check(restored.status(), "Restore")) return 1;
  offset = restored->offset();
  absl::PrintF("restored the snapshot instead: offset %d\n", offset);

  absl::PrintF("fetching every layer and checking it against the toy model:\n");
  if (Check(Verify(*client, id, offset), "verify")) return 1;
  if (Check(ShowPromptCacheFile(*client, snapshot->snapshot_id(), offset), "prompt-cache file")) {
    return 1;
  }

  if (Check(ShowTiers(*client), "tiers")) return 1;
  if (Check(ShowTenants(*demo, id), "tenants")) return 1;
  if (Check(ShowPrefixSharing(*demo, absl::GetFlag(FLAGS_data_lane)), "prefix sharing")) {
    return 1;
  }

  auto stats = client->GetStats();
  if (Check(stats.status(), "GetStats")) return 1;
  absl::PrintF(
      "stats: device %s (%s), %d of %d pages in use, %d cache(s), %d snapshot(s), %d of %d "
      "bytes of metadata budget\n",
      stats->device().c_str(), stats->transfer_path().c_str(), stats->pages_used(),
      stats->pages_total(), stats->caches(), stats->snapshots(), stats->metadata_bytes(),
      stats->max_metadata_bytes());
  if (Check(client->ReleaseSnapshot(snapshot->snapshot_id()), "ReleaseSnapshot")) return 1;
  if (Check(client->DeleteCache(id), "DeleteCache")) return 1;
  absl::PrintF(
      "released the snapshot and deleted the cache (the prefix entries stay, leased for 10 "
      "minutes): demo passed\n");
  return 0;
}
