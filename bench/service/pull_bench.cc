// A snapshot moving between two replicas that are already running (one
// listing the other in its --peers): PullSnapshot, where the puller reads
// the owner's ExportSnapshot stream itself, beside the copy a client makes
// by streaming ExportSnapshot into ImportSnapshot through itself (what
// ShardedClient did before PullSnapshot), beside memcpy of the same bytes.
// The kinds alternate, round by round, so the machine's noise falls on all.
//
//   pull_bench --owner=127.0.0.1:50061 --puller=127.0.0.1:50062 --mib=64 --rounds=5
//
// Prints each kind's median MiB/s (of the snapshot's K/V) and the ratios.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "kvcache_client.h"

ABSL_FLAG(std::string, owner, "127.0.0.1:50061", "the replica that makes the snapshot");
ABSL_FLAG(std::string, puller, "127.0.0.1:50062", "the replica that copies it (lists the owner)");
ABSL_FLAG(uint32_t, mib, 64, "the snapshot's K/V in MiB (8 layers, 8 heads of 128, float16)");
ABSL_FLAG(uint32_t, rounds, 5, "timed copies of each kind");

namespace kvcache::bench {
namespace {

using Clock = std::chrono::steady_clock;

void Check(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "pull_bench: %s: %s\n", what, status.ToString().c_str());
  std::exit(1);
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

constexpr uint32_t kLayers = 8, kHeads = 8, kDim = 128;

v1::CacheSpec Spec() {
  v1::CacheSpec spec;
  spec.set_model("bench-pull");
  spec.set_dtype(v1::DTYPE_FLOAT16);
  spec.set_batch_size(1);
  for (uint32_t i = 0; i < kLayers; ++i) {
    auto* layer = spec.add_layers();
    layer->set_num_kv_heads(kHeads);
    layer->set_k_head_dim(kDim);
    layer->mutable_standard();
  }
  return spec;
}

// A snapshot of `tokens` tokens of K/V on `client`'s server.
std::string Filled(Client& client, uint64_t tokens) {
  const v1::CacheSpec spec = Spec();
  absl::StatusOr<v1::CacheInfo> cache = client.CreateCache(spec);
  Check(cache.status(), "CreateCache");
  constexpr uint64_t kPerMessage = 256;
  std::vector<std::byte> tensor(kHeads * kPerMessage * kDim * 2);
  for (size_t i = 0; i < tensor.size(); ++i) tensor[i] = static_cast<std::byte>(i * 131 % 251);
  for (uint64_t done = 0; done < tokens; done += kPerMessage) {
    const uint64_t n = std::min(kPerMessage, tokens - done);
    const std::vector<uint64_t> shape = {1, kHeads, n, kDim};
    const auto bytes = absl::MakeConstSpan(tensor).subspan(0, kHeads * n * kDim * 2);
    std::vector<LayerUpdate> updates;
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      updates.push_back(LayerUpdate{
          .layer = layer, .keys_shape = shape, .keys = bytes, .values_shape = shape, .values = bytes});
    }
    Check(client.Update(cache->cache_id(), updates).status(), "Update");
  }
  absl::StatusOr<v1::SnapshotInfo> snapshot = client.Snapshot(cache->cache_id());
  Check(snapshot.status(), "Snapshot");
  Check(client.DeleteCache(cache->cache_id()), "DeleteCache");
  return snapshot->snapshot_id();
}

int Run() {
  const auto connect = [](const std::string& address) {
    return Client::Connect(ClientOptions{.address = address, .deadline = absl::Seconds(120)});
  };
  std::unique_ptr<Client> owner = connect(absl::GetFlag(FLAGS_owner));
  std::unique_ptr<Client> puller = connect(absl::GetFlag(FLAGS_puller));
  const uint64_t bytes = uint64_t{absl::GetFlag(FLAGS_mib)} << 20;
  const uint64_t tokens = bytes / (kLayers * kHeads * kDim * 2 * 2);
  const std::string snapshot = Filled(*owner, tokens);
  const double mib = static_cast<double>(tokens * kLayers * kHeads * kDim * 2 * 2) / (1 << 20);

  std::vector<double> pulled, streamed, copied;
  std::vector<char> from(static_cast<size_t>(mib * (1 << 20)), 1), to(from.size());
  const auto timed = [&](std::vector<double>& into, const auto& copy) {
    const Clock::time_point start = Clock::now();
    copy();
    into.push_back(mib / std::chrono::duration<double>(Clock::now() - start).count());
  };
  for (uint32_t round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    timed(pulled, [&] {
      absl::StatusOr<v1::LoadSnapshotResponse> made = puller->PullSnapshot(snapshot);
      Check(made.status(), "PullSnapshot");
      Check(puller->ReleaseSnapshot(made->snapshot().snapshot_id()), "ReleaseSnapshot");
    });
    timed(streamed, [&] {
      v1::ExportSnapshotRequest request;
      request.set_snapshot_id(snapshot);
      absl::StatusOr<v1::LoadSnapshotResponse> made = CopySnapshot(*owner, request, *puller, {});
      Check(made.status(), "CopySnapshot");
      Check(puller->ReleaseSnapshot(made->snapshot().snapshot_id()), "ReleaseSnapshot");
    });
    timed(copied, [&] {
      std::memcpy(to.data(), from.data(), from.size());
      from[round % from.size()] ^= to[(round * 7919) % to.size()];  // kept, not optimized out
    });
  }
  Check(owner->ReleaseSnapshot(snapshot), "ReleaseSnapshot");
  const double pull = Median(pulled), stream = Median(streamed), memcpy_rate = Median(copied);
  std::printf("snapshot %.0f MiB, %u rounds (medians)\n", mib, absl::GetFlag(FLAGS_rounds));
  std::printf("PullSnapshot (replica to replica)        %8.1f MiB/s\n", pull);
  std::printf("CopySnapshot (through the client)        %8.1f MiB/s\n", stream);
  std::printf("memcpy                                   %8.1f MiB/s\n", memcpy_rate);
  std::printf("pull / client copy %.2fx, pull / memcpy %.3fx\n", pull / stream, pull / memcpy_rate);
  return 0;
}

}  // namespace
}  // namespace kvcache::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvcache::bench::Run();
}
