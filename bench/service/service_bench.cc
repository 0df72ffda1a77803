// kvcached over loopback: Update and Fetch throughput per (streams, chunk), and
// Snapshot / Restore latency against context length. Prints one line per
// result (see load_meter.h) for bench/run_service_bench.sh; the server must be
// running already.
//
//   service_bench --address=127.0.0.1:50051 --ops=update,fetch,latency
//
// Each stream has its own Client (its own TCP connection) and its own cache.
// Update rows go through the client library's UpdateStream, writing the same
// tensors over and over with WriteShared (gRPC sends them from where they
// lie; --update_path picks the copying paths instead), acknowledgements
// counted as they arrive. Fetch rows use the generated stub, one FetchResponse
// parsed per chunk (protobuf copies the bytes once, as hiredis copies a GET's
// reply). Snapshot and Restore latency go through kvcache::Client, as an
// application calls them.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "kvcache_client.h"
#include "load_meter.h"
#include "service_workload.h"
#include "tools/connection_flags.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "kvcached address");
ABSL_FLAG(std::string, ops, "update,fetch,latency", "what to measure");
ABSL_FLAG(std::string, streams, "1,4", "concurrent streams, each its own connection and cache");
ABSL_FLAG(std::string, chunks, "65536,262144,1048576", "K+V bytes per Update / Fetch message");
ABSL_FLAG(std::string, update_path, "shared",
          "how Update rows send: shared (UpdateStream::WriteShared, no copy), copy "
          "(UpdateStream::Write, one copy), proto (generated stub, a prebuilt UpdateRequest "
          "serialised per message)");
ABSL_FLAG(std::string, data_lane, "",
          "ClientOptions::data_lane of the Update and Fetch rows: empty (gRPC), auto (the "
          "server's data lane) or host:port");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA file: the server runs TLS (--tls_cert), on gRPC and the lane; empty: plaintext");
ABSL_FLAG(uint64_t, working_set_bytes, 64 << 20,
          "bytes each stream cycles over: the Update rows' rotating window, the Fetch rows' cache");
ABSL_FLAG(double, warmup, 0.5, "seconds before measuring");
ABSL_FLAG(double, seconds, 2.5, "seconds measured per row");
ABSL_FLAG(std::string, contexts, "1024,8192,32768", "context lengths of the latency runs");
ABSL_FLAG(int, latency_iterations, 200, "snapshot / decode / restore rounds per context");

namespace kvcache::bench {
namespace {

using Clock = std::chrono::steady_clock;

// The address, and TLS where --tls_ca names a CA. A CA file that cannot be
// read ends the run (main's first connection finds it, before any worker).
ClientOptions BaseOptions(const std::string& address) {
  absl::StatusOr<ClientOptions> options =
      ClientOptionsFrom({.address = address, .tls_ca_file = absl::GetFlag(FLAGS_tls_ca)});
  if (!options.ok()) {
    std::fprintf(stderr, "%s\n", options.status().ToString().c_str());
    std::exit(1);
  }
  return *std::move(options);
}

std::unique_ptr<Client> ConnectOwn(const std::string& address) {
  ClientOptions options = BaseOptions(address);
  options.deadline = absl::Minutes(10);
  options.max_message_bytes = 256 << 20;
  options.dedicated_connection = true;
  options.data_lane = absl::GetFlag(FLAGS_data_lane);
  return Client::Connect(options);
}

uint32_t WorkingSetTokens() {
  return static_cast<uint32_t>(absl::GetFlag(FLAGS_working_set_bytes) / kTokenBytes);
}

// The generated stub's Update with one prebuilt UpdateRequest, serialised
// anew per message (--update_path=proto); acknowledgements counted by a reader.
void PumpProtoUpdates(Client& client, const std::string& cache_id,
                      const std::vector<std::byte>& payload, WorkerContext& context) {
  const v1::UpdateRequest request = MakeUpdateRequest(cache_id, 0, payload);
  grpc::ClientContext call;
  auto stream = client.stub().Update(&call);
  std::thread reader([&] {
    v1::UpdateResponse ack;
    while (stream->Read(&ack)) context.messages.fetch_add(1, std::memory_order_relaxed);
  });
  while (!context.stop.load(std::memory_order_relaxed) && stream->Write(request)) {
  }
  stream->WritesDone();
  reader.join();
  if (const grpc::Status status = stream->Finish(); !status.ok()) {
    context.error = "Update: " + status.error_message();
  }
}

// Sends `payload` over and over on one UpdateStream until told to stop; the
// acknowledgements are the messages counted.
void PumpUpdates(Client& client, const std::string& cache_id,
                 const std::shared_ptr<const std::vector<std::byte>>& payload,
                 WorkerContext& context) {
  const std::string path = absl::GetFlag(FLAGS_update_path);
  if (path == "proto") return PumpProtoUpdates(client, cache_id, *payload, context);
  const LayerUpdate update = TokensOf(0, *payload);
  auto stream = client.OpenUpdate(cache_id);
  std::thread counter([&] {  // mirrors the stream's acknowledgements into the meter
    while (!context.stop.load(std::memory_order_relaxed)) {
      context.messages.store(stream->acknowledged_count(), std::memory_order_relaxed);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  while (!context.stop.load(std::memory_order_relaxed)) {
    if (!(path == "copy" ? stream->Write(update) : stream->WriteShared(update, payload))) break;
  }
  counter.join();
  if (auto acks = stream->Finish(); !acks.ok()) context.error = acks.status().ToString();
}

// One Update stream at full speed into a rotating cache (memory stays bounded).
void UpdateWorker(const std::string& address, uint64_t chunk_bytes, WorkerContext& context) {
  auto client = ConnectOwn(address);
  auto cache = client->CreateCache(ThroughputSpec(WorkingSetTokens()));
  if (!cache.ok()) {
    context.error = cache.status().ToString();
    return;
  }
  auto payload = std::make_shared<const std::vector<std::byte>>(PatternBytes(chunk_bytes));
  PumpUpdates(*client, cache->cache_id(), payload, context);
  // The numbers count only if the bytes arrived intact, and gRPC let go of them.
  if (absl::Status tail = CheckTail(*client, cache->cache_id(), *payload);
      !tail.ok() && context.error.empty()) {
    context.error = tail.ToString();
  }
  if (payload.use_count() != 1 && context.error.empty()) {
    context.error = "WriteShared: gRPC still holds the tensors after the stream finished";
  }
  (void)client->DeleteCache(cache->cache_id());
}

// FetchWorker's loop on the data lane, through Client::FetchViews: each
// chunk's tensors as views of the bytes received, from which a worker copies
// them into tensors of its own (hiredis, on the Redis rows, copies each value
// into a reply object first).
void FetchOverLane(Client& client, const std::string& cache_id, const v1::FetchRequest& request,
                   uint64_t chunk_bytes, WorkerContext& context) {
  const absl::Status stopped = absl::CancelledError("stopped");
  while (!context.stop.load(std::memory_order_relaxed) && context.error.empty()) {
    const absl::Status status = client.FetchViews(request, [&](const FetchChunkView& chunk) {
      if (chunk.keys.size() + chunk.values.size() != chunk_bytes) {
        context.error = "Fetch: a chunk is not chunk_bytes long";
      }
      context.messages.fetch_add(1, std::memory_order_relaxed);
      return context.stop.load(std::memory_order_relaxed) ? stopped : absl::OkStatus();
    });
    if (!status.ok() && status != stopped) context.error = "Fetch: " + status.ToString();
  }
  (void)client.DeleteCache(cache_id);
}

// Fetches a standard cache of the working set's size again and again, each
// response exactly `chunk_bytes` of K+V.
void FetchWorker(const std::string& address, uint64_t chunk_bytes, WorkerContext& context) {
  auto client = ConnectOwn(address);
  auto cache = client->CreateCache(ThroughputSpec(/*window=*/0));
  if (!cache.ok()) {
    context.error = cache.status().ToString();
    return;
  }
  if (absl::Status filled = Fill(*client, cache->cache_id(), 1, WorkingSetTokens()); !filled.ok()) {
    context.error = filled.ToString();
    return;
  }
  v1::FetchRequest request;
  request.set_cache_id(cache->cache_id());
  request.set_max_chunk_tokens(static_cast<uint32_t>(chunk_bytes / kTokenBytes));
  if (client->uses_data_lane()) return FetchOverLane(*client, cache->cache_id(), request, chunk_bytes, context);
  v1::FetchResponse chunk;
  while (!context.stop.load(std::memory_order_relaxed) && context.error.empty()) {
    grpc::ClientContext call;
    auto reader = client->stub().Fetch(&call, request);
    while (reader->Read(&chunk)) {
      if (chunk.keys().data().size() + chunk.values().data().size() != chunk_bytes) {
        context.error = "Fetch: a chunk is not chunk_bytes long";
      }
      context.messages.fetch_add(1, std::memory_order_relaxed);
      if (context.stop.load(std::memory_order_relaxed)) call.TryCancel();
    }
    const grpc::Status status = reader->Finish();
    if (!status.ok() && status.error_code() != grpc::StatusCode::CANCELLED) {
      context.error = "Fetch: " + status.error_message();
    }
  }
  (void)client->DeleteCache(cache->cache_id());
}

void RunThroughput(const char* op, const std::string& address) {
  const MeterOptions meter{.warmup_seconds = absl::GetFlag(FLAGS_warmup),
                           .measure_seconds = absl::GetFlag(FLAGS_seconds)};
  for (uint64_t streams : ParseList(absl::GetFlag(FLAGS_streams))) {
    for (uint64_t chunk : ParseList(absl::GetFlag(FLAGS_chunks))) {
      std::vector<Worker> workers;
      for (uint64_t s = 0; s < streams; ++s) {
        workers.push_back([&, chunk](WorkerContext& context) {
          if (std::strcmp(op, "update") == 0) UpdateWorker(address, chunk, context);
          else FetchWorker(address, chunk, context);
        });
      }
      PrintRow(absl::GetFlag(FLAGS_data_lane).empty() ? "kvcached" : "kvcached-lane", op, streams, chunk, MeasureRate(workers, meter));
    }
  }
}

double MicrosSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count();
}

// Per context length: Snapshot at the live offset, decode a few tokens past
// it (the first one copies the shared boundary page), Restore the snapshot.
void RunLatency(const std::string& address) {
  auto client = ConnectOwn(address);
  auto cache = client->CreateCache(LatencySpec());
  if (!cache.ok()) {
    std::printf("LAT error: %s\n", cache.status().ToString().c_str());
    return;
  }
  const std::string& id = cache->cache_id();
  uint64_t offset = 0;
  for (uint64_t context : ParseList(absl::GetFlag(FLAGS_contexts))) {
    // Off a page boundary, as a real decode's snapshots usually are.
    const uint64_t target = context + kLatencyOffPage;
    if (absl::Status s = Fill(*client, id, kLatencyLayers, target - offset); !s.ok()) {
      std::printf("LAT error: %s\n", s.ToString().c_str());
      return;
    }
    offset = target;
    std::vector<double> snapshot_us, restore_us;
    for (int i = 0; i < absl::GetFlag(FLAGS_latency_iterations); ++i) {
      const Clock::time_point t0 = Clock::now();
      auto snap = client->Snapshot(id);
      snapshot_us.push_back(MicrosSince(t0));
      absl::Status decoded = snap.ok() ? Decode(*client, id, kLatencyLayers, 3) : snap.status();
      const Clock::time_point t1 = Clock::now();
      auto restored = decoded.ok() ? client->Restore(id, snap->snapshot_id(), offset)
                                   : absl::StatusOr<v1::CacheInfo>(decoded);
      restore_us.push_back(MicrosSince(t1));
      if (!restored.ok() || restored->offset() != offset) {
        std::printf("LAT error: %s\n", restored.status().ToString().c_str());
        return;
      }
      (void)client->ReleaseSnapshot(snap->snapshot_id());
    }
    for (auto [name, samples] : {std::pair{"snapshot", &snapshot_us}, {"restore", &restore_us}}) {
      const double p50 = Percentile(*samples, 50), p99 = Percentile(*samples, 99);
      std::printf("LAT %s %llu %.1f %.1f\n", name, static_cast<unsigned long long>(context), p50,
                  p99);
    }
    std::fflush(stdout);
  }
  (void)client->DeleteCache(id);
}

}  // namespace
}  // namespace kvcache::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  kvcache::bench::KeepMessageBuffersInHeap();
  const std::string address = absl::GetFlag(FLAGS_address);
  if (absl::Status ready = kvcache::Client::Connect(kvcache::bench::BaseOptions(address))
                               ->WaitForReady(absl::Seconds(30));
      !ready.ok()) {
    std::fprintf(stderr, "%s\n", ready.ToString().c_str());
    return 1;
  }
  const std::vector<std::string> ops = absl::StrSplit(absl::GetFlag(FLAGS_ops), ',');
  for (const std::string& op : ops) {
    if (op == "update" || op == "fetch") kvcache::bench::RunThroughput(op.c_str(), address);
    if (op == "latency") kvcache::bench::RunLatency(address);
  }
  return 0;
}
