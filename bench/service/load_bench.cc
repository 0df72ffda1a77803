// Load: many clients at once, each a worker of its own tenant's (tokens
// round-robin), half on the data lane and half on gRPC, each running a
// random mix of Update, Fetch (every byte checked against the client's own
// mirror), Snapshot, Restore, ReleaseSnapshot and cache replacement, for a
// number of operations or until a time bound. Prints each operation's count
// and p50 / p99 / max latency, what failed or came back wrong (both must be
// 0), and the server's pages in use once every client has cleaned up (must
// be 0). Exit status 1 on any failure, corruption or leaked page.
//
//   load_bench --address=127.0.0.1:50051 --clients=64 --ops=10000
//       --tokens=t1,t2,t3 --admin_token=ops
//   load_bench --peers=r0=127.0.0.1:50051,r1=127.0.0.1:51051 ...   (a fleet)
//
// bench/run_load_bench.sh starts the server with a tokens file and records
// its peak memory beside the budget.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvcache_client.h"
#include "sharded_client.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "kvcached address");
ABSL_FLAG(std::string, peers, "",
          "a fleet instead (client/sharded_client.h ParsePeers): each client's caches are placed "
          "by rendezvous hashing and every call goes to the replica its id names");
ABSL_FLAG(std::string, etcd_endpoints, "",
          "a fleet that etcd lists instead (kvcached --etcd_endpoints): placed likewise");
ABSL_FLAG(int, clients, 64, "concurrent clients, each with its own connection and cache");
ABSL_FLAG(int, ops, 10000, "operations per client");
ABSL_FLAG(double, seconds, 600, "time bound: clients stop early once it has passed");
ABSL_FLAG(std::string, tokens, "", "bearer tokens, one per client round-robin (empty: none)");
ABSL_FLAG(std::string, admin_token, "", "a token of an admin tenant, for the pages in use");
ABSL_FLAG(uint64_t, seed, 1, "random seed");

namespace kvcache::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kLayers = 2;
constexpr uint32_t kHeads = 2;
constexpr uint32_t kDim = 64;
constexpr size_t kRow = kDim * 2;       // one head's fp16 row
constexpr uint64_t kMostTokens = 1024;  // a cache longer is rewound or replaced
constexpr size_t kMostSnapshots = 4;

enum Op { kUpdate, kFetch, kSnapshot, kRestore, kRelease, kReplace, kOpCount };
constexpr const char* kOpNames[] = {"Update",  "Fetch",           "Snapshot",
                                    "Restore", "ReleaseSnapshot", "DeleteCache+CreateCache"};

// A cache as the client knows it: per layer, each token's K and V rows
// (head-major within the token).
struct Mirror {
  std::vector<std::vector<std::string>> keys{kLayers}, values{kLayers};
  uint64_t tokens() const { return keys[0].size(); }
};

struct Tally {
  std::vector<double> micros[kOpCount];
  uint64_t failed = 0, corrupted = 0;
  uint64_t bytes_in = 0, bytes_out = 0;  // K/V bytes sent by Update, received by Fetch
  std::string first_failure;
};

v1::CacheSpec Spec() {
  v1::CacheSpec spec;
  spec.set_dtype(v1::DTYPE_FLOAT16);
  spec.set_model("load-bench");
  for (uint32_t i = 0; i < kLayers; ++i) {
    v1::LayerSpec* layer = spec.add_layers();
    layer->set_num_kv_heads(kHeads);
    layer->set_k_head_dim(kDim);
    layer->mutable_standard();
  }
  return spec;
}

// [1, H, L, D] of tokens [from, end) of one layer's rows.
std::string Tensor(const std::vector<std::string>& tokens, size_t from, size_t end) {
  std::string out;
  out.reserve((end - from) * kHeads * kRow);
  for (uint32_t h = 0; h < kHeads; ++h) {
    for (size_t t = from; t < end; ++t) out.append(tokens[t], h * kRow, kRow);
  }
  return out;
}

std::string RandomBytes(size_t size, std::mt19937_64& rng) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; i += 8) {
    const uint64_t word = rng();
    std::memcpy(bytes.data() + i, &word, std::min<size_t>(8, size - i));
  }
  return bytes;
}

class Worker {
 public:
  Worker(int index, Tally& tally)
      : index_(index), tally_(tally), rng_(absl::GetFlag(FLAGS_seed) * 1000003 + index) {}

  void Run(Clock::time_point deadline) {
    ClientOptions options{.address = absl::GetFlag(FLAGS_address),
                          .deadline = absl::Seconds(60),
                          .dedicated_connection = true,
                          .data_lane = index_ % 2 == 0 ? "auto" : ""};
    const std::vector<std::string> tokens =
        absl::StrSplit(absl::GetFlag(FLAGS_tokens), ',', absl::SkipEmpty());
    if (!tokens.empty()) options.token = tokens[index_ % tokens.size()];
    if (const std::string etcd = absl::GetFlag(FLAGS_etcd_endpoints); !etcd.empty()) {
      absl::StatusOr<std::unique_ptr<ShardedClient>> fleet =
          ShardedClient::Connect({.etcd = {.endpoints = etcd}, .client = options});
      if (!Check(fleet.status(), "fleet")) return;
      fleet_ = *std::move(fleet);
    } else if (const std::string peers = absl::GetFlag(FLAGS_peers); !peers.empty()) {
      absl::StatusOr<std::vector<Replica>> replicas = ParsePeers(peers);
      if (!Check(replicas.status(), "peers")) return;
      absl::StatusOr<std::unique_ptr<ShardedClient>> fleet =
          ShardedClient::Connect({.replicas = *replicas, .client = options});
      if (!Check(fleet.status(), "fleet")) return;
      fleet_ = *std::move(fleet);
    } else {
      client_ = Client::Connect(options);
      // The connection comes up before the first operation, so the tally
      // counts operations, not connects: gRPC 1.51 can report a connect
      // still in progress as failed (connect's errno overwritten before it
      // is read: "ipv4:...: No such file or directory"), and a fail-fast
      // call in that moment fails while the channel's next attempt succeeds.
      if (!Check(client_->WaitForReady(absl::Seconds(30)), "connect")) return;
    }
    if (!Check(Replace(), "CreateCache")) return;
    const int ops = absl::GetFlag(FLAGS_ops);
    for (int i = 0; i < ops && Clock::now() < deadline; ++i) {
      const Op op = Pick();
      const auto start = Clock::now();
      const absl::Status status = Do(op);
      tally_.micros[op].push_back(
          std::chrono::duration<double, std::micro>(Clock::now() - start).count());
      if (!Check(status, kOpNames[op])) return;
    }
    for (const auto& [id, mirror] : snapshots_) Check(For(id).ReleaseSnapshot(id), "release");
    Check(For(cache_id_).DeleteCache(cache_id_), "DeleteCache");
  }

 private:
  Op Pick() {
    if (mirror_.tokens() >= kMostTokens) return snapshots_.empty() ? kReplace : kRestore;
    const int roll = static_cast<int>(rng_() % 100);
    if (roll < 40) return kUpdate;
    if (roll < 70) return kFetch;
    if (roll < 80) {
      if (mirror_.tokens() == 0) return kUpdate;
      return snapshots_.size() < kMostSnapshots ? kSnapshot : kRelease;
    }
    if (roll < 90) return snapshots_.empty() ? kUpdate : kRestore;
    if (roll < 97) return snapshots_.empty() ? kFetch : kRelease;
    return kReplace;
  }

  absl::Status Do(Op op) {
    switch (op) {
      case kUpdate:
        return Update();
      case kFetch:
        return Fetch();
      case kSnapshot: {
        absl::StatusOr<v1::SnapshotInfo> info = For(cache_id_).Snapshot(cache_id_);
        if (!info.ok()) return info.status();
        snapshots_.emplace_back(info->snapshot_id(), mirror_);
        return absl::OkStatus();
      }
      case kRestore: {
        const auto& [id, mirror] = snapshots_[rng_() % snapshots_.size()];
        absl::StatusOr<v1::CacheInfo> info = fleet_
                                                 ? fleet_->Restore(cache_id_, id, mirror.tokens())
                                                 : client_->Restore(cache_id_, id, mirror.tokens());
        if (!info.ok()) return info.status();
        mirror_ = mirror;
        return absl::OkStatus();
      }
      case kRelease: {
        const size_t at = rng_() % snapshots_.size();
        absl::Status status = For(cache_id_).ReleaseSnapshot(snapshots_[at].first);
        snapshots_.erase(snapshots_.begin() + at);
        return status;
      }
      case kReplace: {
        if (absl::Status status = For(cache_id_).DeleteCache(cache_id_); !status.ok())
          return status;
        return Replace();
      }
      default:
        return absl::InternalError("no such op");
    }
  }

  // The client that calls about `id` go to: over a fleet, the replica the id
  // names (looked up for every call, as a fleet's worker does).
  Client& For(const std::string& id) { return fleet_ ? **fleet_->Owner(id) : *client_; }

  absl::Status Replace() {
    absl::StatusOr<v1::CacheInfo> info =
        // A worker's caches go where its key says (as a session's would),
        // so the snapshots it restores from live beside them.
        fleet_ ? fleet_->CreateCache(Spec(), {.placement_key = absl::StrCat("worker-", index_)})
               : client_->CreateCache(Spec());
    if (!info.ok()) return info.status();
    cache_id_ = info->cache_id();
    mirror_ = Mirror();
    return absl::OkStatus();
  }

  absl::Status Update() {
    const size_t from = mirror_.tokens();
    const size_t count = 1 + rng_() % (rng_() % 4 == 0 ? 128 : 8);
    std::vector<std::string> tensors;
    std::vector<LayerUpdate> updates;
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      for (size_t t = 0; t < count; ++t) {
        mirror_.keys[layer].push_back(RandomBytes(kHeads * kRow, rng_));
        mirror_.values[layer].push_back(RandomBytes(kHeads * kRow, rng_));
      }
    }
    tensors.reserve(2 * kLayers);
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      tensors.push_back(Tensor(mirror_.keys[layer], from, from + count));
      tensors.push_back(Tensor(mirror_.values[layer], from, from + count));
      const std::vector<uint64_t> shape = {1, kHeads, count, kDim};
      updates.push_back({.layer = layer,
                         .keys_shape = shape,
                         .keys = absl::MakeConstSpan(
                             reinterpret_cast<const std::byte*>(tensors[2 * layer].data()),
                             tensors[2 * layer].size()),
                         .values_shape = shape,
                         .values = absl::MakeConstSpan(
                             reinterpret_cast<const std::byte*>(tensors[2 * layer + 1].data()),
                             tensors[2 * layer + 1].size())});
    }
    absl::StatusOr<std::vector<v1::UpdateResponse>> acks =
        For(cache_id_).Update(cache_id_, updates);
    if (!acks.ok()) return acks.status();
    tally_.bytes_in += 2 * kLayers * count * kHeads * kRow;
    for (const v1::UpdateResponse& ack : *acks) {
      if (ack.offset() != from + count) return absl::DataLossError("an ack's offset is wrong");
    }
    return absl::OkStatus();
  }

  absl::Status Fetch() {
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      absl::StatusOr<LayerHistory> history = For(cache_id_).FetchLayer(cache_id_, "", layer);
      if (!history.ok()) return history.status();
      tally_.bytes_out += history->keys.size() + history->values.size();
      const std::string keys = Tensor(mirror_.keys[layer], 0, mirror_.tokens());
      const std::string values = Tensor(mirror_.values[layer], 0, mirror_.tokens());
      const auto same = [](const std::vector<std::byte>& got, const std::string& want) {
        return got.size() == want.size() &&
               (want.empty() || std::memcmp(got.data(), want.data(), want.size()) == 0);
      };
      if (history->tokens != mirror_.tokens() || !same(history->keys, keys) ||
          !same(history->values, values)) {
        ++tally_.corrupted;
        return absl::DataLossError("fetched bytes differ from what was sent");
      }
    }
    return absl::OkStatus();
  }

  bool Check(const absl::Status& status, const char* what) {
    if (status.ok()) return true;
    if (!absl::IsDataLoss(status)) ++tally_.failed;
    if (tally_.first_failure.empty()) {
      tally_.first_failure = absl::StrCat("client ", index_, ": ", what, ": ", status.ToString());
    }
    return false;
  }

  const int index_;
  Tally& tally_;
  std::mt19937_64 rng_;
  std::unique_ptr<ShardedClient> fleet_;  // with --peers
  std::unique_ptr<Client> client_;        // without
  std::string cache_id_;
  Mirror mirror_;
  std::vector<std::pair<std::string, Mirror>> snapshots_;
};

double Percentile(std::vector<double>& values, double fraction) {
  if (values.empty()) return 0;
  const size_t at = std::min(values.size() - 1, static_cast<size_t>(fraction * values.size()));
  std::nth_element(values.begin(), values.begin() + at, values.end());
  return values[at];
}

int Run() {
  const int clients = absl::GetFlag(FLAGS_clients);
  std::vector<Tally> tallies(clients);
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(absl::GetFlag(FLAGS_seconds)));
  std::vector<std::thread> threads;
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back([i, &tallies, deadline] { Worker(i, tallies[i]).Run(deadline); });
  }
  for (std::thread& thread : threads) thread.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();

  Tally all;
  for (Tally& tally : tallies) {
    for (int op = 0; op < kOpCount; ++op) {
      all.micros[op].insert(all.micros[op].end(), tally.micros[op].begin(), tally.micros[op].end());
    }
    all.failed += tally.failed;
    all.bytes_in += tally.bytes_in;
    all.bytes_out += tally.bytes_out;
    all.corrupted += tally.corrupted;
    if (all.first_failure.empty()) all.first_failure = tally.first_failure;
  }
  uint64_t total = 0;
  std::printf("| operation | count | p50 ms | p99 ms | max ms |\n|---|---:|---:|---:|---:|\n");
  for (int op = 0; op < kOpCount; ++op) {
    std::vector<double>& micros = all.micros[op];
    total += micros.size();
    const double max = micros.empty() ? 0 : *std::max_element(micros.begin(), micros.end());
    std::printf("| %s | %zu | %.2f | %.2f | %.2f |\n", kOpNames[op], micros.size(),
                Percentile(micros, 0.5) / 1e3, Percentile(micros, 0.99) / 1e3, max / 1e3);
  }
  // Pages in use after, summed over the fleet's replicas.
  std::vector<std::string> addresses = {absl::GetFlag(FLAGS_address)};
  if (const std::string peers = absl::GetFlag(FLAGS_peers); !peers.empty()) {
    addresses.clear();
    // Held here: a range-for over a temporary's value() would read it after it went.
    const std::vector<Replica> listed = ParsePeers(peers).value();
    for (const Replica& replica : listed) addresses.push_back(replica.address);
  }
  if (const std::string etcd = absl::GetFlag(FLAGS_etcd_endpoints); !etcd.empty()) {
    addresses.clear();
    std::unique_ptr<ShardedClient> fleet =
        ShardedClient::Connect({.etcd = {.endpoints = etcd}}).value();
    for (size_t i = 0; i < fleet->size(); ++i) addresses.push_back(fleet->replica(i).address);
  }
  absl::StatusOr<v1::Stats> stats;
  int64_t pages_used = 0;
  for (const std::string& address : addresses) {
    ClientOptions admin{.address = address, .token = absl::GetFlag(FLAGS_admin_token)};
    stats = Client::Connect(admin)->GetStats();
    if (!stats.ok()) break;
    pages_used += static_cast<int64_t>(stats->pages_used());
  }
  if (!stats.ok()) pages_used = -1;
  std::printf(
      "\n%d clients, %llu operations in %.1f s (%.0f / s); failed %llu, corrupted %llu; "
      "pages in use after: %lld\n",
      clients, static_cast<unsigned long long>(total), seconds, total / seconds,
      static_cast<unsigned long long>(all.failed), static_cast<unsigned long long>(all.corrupted),
      static_cast<long long>(pages_used));
  std::printf("K/V bytes: %.1f MB/s in (Update), %.1f MB/s out (Fetch)\n",
              all.bytes_in / seconds / 1e6, all.bytes_out / seconds / 1e6);
  if (stats.ok()) {
    std::printf("metadata budget: %llu MiB (held after: %llu bytes)\n",
                static_cast<unsigned long long>(stats->max_metadata_bytes() >> 20),
                static_cast<unsigned long long>(stats->metadata_bytes()));
  }
  if (!all.first_failure.empty()) std::printf("first failure: %s\n", all.first_failure.c_str());
  return all.failed == 0 && all.corrupted == 0 && pages_used == 0 ? 0 : 1;
}

}  // namespace
}  // namespace kvcache::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvcache::bench::Run();
}
