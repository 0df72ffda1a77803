// kvcache::Client: a typed C++ API over the kvcache.v1 stub. Every call has a
// deadline; only idempotent reads are retried (by gRPC's retry policy, on
// UNAVAILABLE), since a retried CreateCache, Update or Snapshot could apply twice.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "fetch_view.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvcache {

struct ClientOptions {
  std::string address = "127.0.0.1:50051";
  // Deadline of each unary call, and of each whole Update or Fetch stream.
  absl::Duration deadline = absl::Seconds(60);
  uint64_t max_message_bytes = 64 << 20;
  // A TCP connection of this Client's own. By default gRPC shares one
  // connection between Clients of the same address and options, which then
  // multiplex their streams over it.
  bool dedicated_connection = false;
  // Where Update and Fetch go. "" : gRPC. "auto": the server's data lane (a
  // plain TCP connection carrying the same messages with less per-message
  // work, kvcached --data_lane_listen) if it has one that answers, else gRPC.
  // host:port: that lane, with no fallback. Every other call is gRPC.
  std::string data_lane;
  // A bearer token (kvcached --tokens_file): sent as `authorization: Bearer
  // <token>` with every gRPC call and in each data-lane connection's AUTH
  // frame. Empty: none (a server without tokens takes every call).
  std::string token;
  // The replica this client's calls are for, sent as `x-kvcache-replica`
  // metadata with each: a proxy in front of a fleet (docker/haproxy.cfg)
  // sends the call to the server of that name. ShardedClient sets it to each
  // replica's name. Empty: none.
  std::string replica;
  // TLS to the gRPC port (kvcached --tls_cert), with grpc++'s own
  // credentials, and to the data lane with OpenSSL's (TLS 1.3; the kernel's
  // TLS where it has it). The PEM texts, not paths: an empty root bundle
  // trusts the system's CAs; a client certificate and key are for mutual TLS
  // (kvcached --tls_client_ca). tls_server_name overrides the name checked
  // against the server's certificate (default: the address's host).
  bool tls = false;
  std::string tls_root_certs_pem;
  std::string tls_client_cert_pem;
  std::string tls_client_key_pem;
  std::string tls_server_name;
  // The longest gRPC waits between attempts to reconnect to a server that
  // went away; zero: gRPC's default (two minutes). A fleet's clients set it
  // low, so a replica that restarts is used again within seconds.
  absl::Duration max_reconnect_backoff;
  // Until the channel has connected once, each call first waits up to this
  // (at most its deadline, which starts after the wait) for the
  // connection: a worker started beside its
  // server gets its first call through once the server listens, and gRPC
  // 1.51, which can report a connect still under way as failed, does not
  // fail it. No call is retried for it: it waits before it is sent. Zero:
  // calls fail fast from the start. ShardedClient sets zero (a replica that
  // is down must fail fast so creates go to the next).
  absl::Duration first_connect_wait = absl::Seconds(3);
  // A connection silent this long is pinged (HTTP/2 PING on gRPC, even while
  // no call runs; TCP keepalive on the data lane), and dropped when no answer
  // comes within keepalive_timeout: a worker whose server's host went away
  // (no reset ever comes) notices in about time + timeout rather than at
  // each call's deadline, and its calls fail fast and are retried, or go to
  // another replica. kvcached accepts pings as often as every 10 s (less
  // where its own --keepalive_time is shorter); more often it answers with
  // GOAWAY. Zero: no pings.
  absl::Duration keepalive_time = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(20);
};

// A recurrent layer's new state (UpdateRequest.state, ollama RecurrentCache):
// conv [B, conv_tail, conv_dim] and delta [B, num_v_heads, head_v_dim,
// head_k_dim], in the LayerUpdate's dtype. The layer's offset moves up by
// `advance` (0 replaces the state in place).
struct RecurrentStateUpdate {
  std::vector<uint64_t> conv_shape;
  absl::Span<const std::byte> conv;
  std::vector<uint64_t> delta_shape;
  absl::Span<const std::byte> delta;
  uint64_t advance = 0;
};

// One layer's step: new tokens for an attention layer, keys [B, H, L, Dk] and
// values [B, H, L, Dv]; or, for a recurrent layer, a new `state`. With a state,
// keys and values are sent only if given (a shape or bytes), so the server
// sees exactly what was meant (K/V for a recurrent layer is refused).
struct LayerUpdate {
  uint32_t layer = 0;
  v1::DType dtype = v1::DTYPE_FLOAT16;
  std::vector<uint64_t> keys_shape;
  absl::Span<const std::byte> keys;
  std::vector<uint64_t> values_shape;
  absl::Span<const std::byte> values;
  std::optional<RecurrentStateUpdate> state;
  std::optional<uint64_t> expected_offset;
  // Set: drafts the update in this open speculation (BeginSpeculation). The
  // stream's cache_id may then be empty (the speculation's cache is meant);
  // if set, it must be that cache.
  std::string speculation_id;
};

// A layer's history as Fetch returns it: the position ranges in temporal order
// and the tokens of all of them concatenated, [B, H, L, D] each.
struct LayerHistory {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // [begin, end)
  uint64_t tokens = 0;
  std::vector<std::byte> keys;
  std::vector<std::byte> values;
};

// Concatenates one layer's Fetch chunks (in order) into a LayerHistory.
absl::StatusOr<LayerHistory> AssembleHistory(absl::Span<const v1::FetchResponse> chunks);

// The options of Client calls beyond the handles they name, so that a call
// site names what it sets (`client.Snapshot(id, {.pinned = true})`). Each
// default is the request's own: 0, false or "" leaves it to the server.

struct CreateCacheOptions {
  // The cache's lease: deleted once no call names it for that long; 0 takes
  // the server's default.
  uint32_t ttl_seconds = 0;
};

struct SnapshotOptions {
  // The first position taken: the snapshot holds [from_offset, offset).
  uint64_t from_offset = 0;
  // Never evicted, never expires (within the server's max_pinned_bytes).
  bool pinned = false;
  // The snapshot's lease; 0 takes the server's default.
  uint32_t ttl_seconds = 0;
};

// The pin and lease of a snapshot made from a file or from another replica's
// snapshot (LoadSnapshot, PullSnapshot, ShardedClient::CopySnapshotTo), as
// SnapshotOptions' are.
struct NewSnapshotOptions {
  bool pinned = false;
  uint32_t ttl_seconds = 0;
};

struct ListCachesOptions {
  // Whose caches: empty, the caller's tenant; an admin token may name
  // another tenant (as the tokens file names it).
  std::string tenant;
};

struct ListSnapshotsOptions {
  // The snapshots of this cache; empty: all.
  std::string cache_id;
  // As ListCachesOptions'.
  std::string tenant;
};

struct EvictSnapshotsOptions {
  // Up to this many bytes of idle snapshots' device pages move to host
  // memory or disk; 0: all that can move.
  uint64_t bytes = 0;
  // As ListCachesOptions'.
  std::string tenant;
};

struct PublishPrefixOptions {
  // The entry's lease (every lookup that finds it renews it); 0 takes the
  // server's default.
  uint32_t ttl_seconds = 0;
};

struct LookupPrefixOptions {
  // The lease of the handle a hit returns; 0 takes the server's default.
  uint32_t ttl_seconds = 0;
};

struct SpeculationOptions {
  // A commit never changes the live cache (ollama BeginIsolatedSpeculation),
  // e.g. to check a draft without keeping it.
  bool isolated = false;
};

class UpdateStream;
namespace internal {
class FetchTransport;
class LanePool;
class UpdateTransport;
}  // namespace internal

// A unary call that gets UNAVAILABLE is sent again, up to four attempts in
// all (gRPC's retry policy). Each call whose repeat would do more work
// carries a fresh random request_id, the same in every attempt, so where
// only the answer was lost the server answers the retry from its request log
// rather than doing the work twice (kvcache.proto, "Retries").
// ImportSnapshot is sent again the same way, its whole file from the start,
// and so is CopySnapshot (below), its export and import both.
// Update and EvictSnapshots are never sent twice.
class Client {
 public:
  static std::unique_ptr<Client> Connect(const ClientOptions& options);
  // Waits until the server answers (for start-up scripts and tests). Calls
  // fail fast with UNAVAILABLE while it is unreachable, and keep failing for
  // a while after it is back: grpc's sync API only notices a finished
  // reconnect while some call waits (else its 5 s backup poller does), so a
  // caller that expects a restarted server waits here.
  absl::Status WaitForReady(absl::Duration timeout);

  absl::StatusOr<v1::CacheInfo> CreateCache(const v1::CacheSpec& spec,
                                            const CreateCacheOptions& options = {});
  absl::StatusOr<v1::CacheInfo> GetCache(const std::string& cache_id);
  // Every cache of a tenant (ListCachesOptions::tenant).
  absl::StatusOr<std::vector<v1::CacheInfo>> ListCaches(const ListCachesOptions& options = {});
  absl::Status DeleteCache(const std::string& cache_id);

  // Opens an Update stream for one cache (see UpdateStream).
  std::unique_ptr<UpdateStream> OpenUpdate(const std::string& cache_id);
  // One step: every update in one stream; returns the acknowledged offsets.
  absl::StatusOr<std::vector<v1::UpdateResponse>> Update(const std::string& cache_id,
                                                         absl::Span<const LayerUpdate> updates);

  // Streams the chunks of `request` to `on_chunk`, in order; stops at its first error.
  absl::Status Fetch(const v1::FetchRequest& request,
                     const std::function<absl::Status(const v1::FetchResponse&)>& on_chunk);
  // Fetch for callers that copy the tensors into buffers of their own: on the
  // data lane the keys and values are views of the bytes as received, not
  // copied into a FetchResponse first (fetch_view.h).
  absl::Status FetchViews(const v1::FetchRequest& request,
                          const std::function<absl::Status(const FetchChunkView&)>& on_chunk);
  // One layer's whole history (of the live cache, or of snapshot_id if set).
  absl::StatusOr<LayerHistory> FetchLayer(const std::string& cache_id,
                                          const std::string& snapshot_id, uint32_t layer);
  // One layer's speculative view: committed + drafted history.
  absl::StatusOr<LayerHistory> FetchSpeculation(const std::string& speculation_id,
                                                uint32_t layer);
  // Every chunk of `request`, in order.
  absl::StatusOr<std::vector<v1::FetchResponse>> FetchAll(const v1::FetchRequest& request);

  absl::StatusOr<v1::TrimResponse> Trim(const std::string& cache_id, uint64_t n);
  absl::StatusOr<v1::SnapshotInfo> Snapshot(const std::string& cache_id,
                                            const SnapshotOptions& options = {});
  // An empty snapshot_id rewinds the live cache.
  absl::StatusOr<v1::CacheInfo> Restore(const std::string& cache_id,
                                        const std::string& snapshot_id, uint64_t target_offset);
  absl::StatusOr<v1::SnapshotInfo> MergeSnapshots(const std::string& parent_id,
                                                  const std::string& child_id);
  absl::StatusOr<v1::SplitSnapshotResponse> SplitSnapshot(const std::string& snapshot_id,
                                                          uint64_t at);
  absl::Status ReleaseSnapshot(const std::string& snapshot_id);
  absl::StatusOr<std::vector<v1::SnapshotInfo>> ListSnapshots(
      const ListSnapshotsOptions& options = {});
  absl::StatusOr<v1::Stats> GetStats();
  // The standard gRPC health check (grpc.health.v1) of `service`: true when
  // it is SERVING, false when NOT_SERVING (kvcached draining); "" asks about
  // the server as a whole. An unknown service is NOT_FOUND.
  absl::StatusOr<bool> Serving(const std::string& service = "kvcache.v1.KvCacheService");
  // Renews the leases of these caches and snapshots (all, or none when an id
  // is unknown); every other call that names a handle renews it too.
  absl::StatusOr<v1::RenewLeaseResponse> RenewLease(absl::Span<const std::string> cache_ids,
                                                    absl::Span<const std::string> snapshot_ids);
  // Pinned: never evicted, never expires (within the server's max_pinned_bytes).
  absl::StatusOr<v1::SnapshotInfo> SetPinned(const std::string& snapshot_id, bool pinned);
  // Moves idle snapshots' device pages to host memory or disk now (by
  // default all that can move, of the caller's tenant).
  absl::StatusOr<v1::EvictSnapshotsResponse> EvictSnapshots(
      const EvictSnapshotsOptions& options = {});

  // Prompt-cache files, in mlx-lm's save_prompt_cache layout. In the server's
  // data dir: save a snapshot (it must start at 0) as `name`, load one back
  // into a new snapshot, list, delete.
  absl::StatusOr<v1::SavedFile> SaveSnapshot(const std::string& snapshot_id,
                                             const std::string& name,
                                             const std::map<std::string, std::string>& metadata = {});
  absl::StatusOr<v1::LoadSnapshotResponse> LoadSnapshot(const std::string& name,
                                                        const NewSnapshotOptions& options = {});
  absl::StatusOr<std::vector<v1::SavedFile>> ListSaved();
  absl::Status DeleteSaved(const std::string& name);
  // Between this machine and the server: a file's bytes (request.name: a
  // saved file; request.snapshot_id: a snapshot encoded on the fly), and a
  // file's bytes in (options.name set: saved there too).
  absl::StatusOr<std::string> ExportSnapshot(const v1::ExportSnapshotRequest& request);
  absl::StatusOr<v1::LoadSnapshotResponse> ImportSnapshot(
      absl::string_view file, const v1::ImportSnapshotRequest& options = {});
  // A snapshot of another replica of the fleet, copied to this server by the
  // server itself (from the replica the id names, found in its own peer
  // list) with this client's token: the bytes never pass through here.
  absl::StatusOr<v1::LoadSnapshotResponse> PullSnapshot(const std::string& snapshot_id,
                                                        const NewSnapshotOptions& options = {});

  // Prefix sharing. Publishes the first tokens.size() positions of a
  // snapshot (from 0, batch 1) as the K/V of `tokens`.
  absl::StatusOr<v1::PublishPrefixResponse> PublishPrefix(const std::string& snapshot_id,
                                                          absl::Span<const uint32_t> tokens,
                                                          const PublishPrefixOptions& options = {});
  // The longest cached prefix of `tokens` for caches laid out as `spec`
  // (or as cache `cache_id`, with LookupPrefixCache): a handle to Restore at
  // matched_tokens, or matched_tokens 0.
  absl::StatusOr<v1::LookupPrefixResponse> LookupPrefix(const v1::CacheSpec& spec,
                                                        absl::Span<const uint32_t> tokens,
                                                        const LookupPrefixOptions& options = {});
  absl::StatusOr<v1::LookupPrefixResponse> LookupPrefixCache(
      const std::string& cache_id, absl::Span<const uint32_t> tokens,
      const LookupPrefixOptions& options = {});
  absl::StatusOr<std::vector<v1::PrefixEntry>> ListPrefixes();

  // A recurrent layer's state (of the live cache, or of snapshot_id if set).
  absl::StatusOr<v1::RecurrentState> FetchState(const std::string& cache_id,
                                                const std::string& snapshot_id, uint32_t layer);
  // A quantized layer's chunks as stored (packed_keys / packed_values set).
  absl::StatusOr<std::vector<v1::FetchResponse>> FetchPacked(const std::string& cache_id,
                                                             const std::string& snapshot_id,
                                                             uint32_t layer);

  // Batches (mlx-lm BatchKVCache). ExtractRow and MergeCaches create caches;
  // FilterRows and ExtendCache change `cache_id` in place.
  absl::StatusOr<v1::CacheInfo> ExtractRow(const std::string& cache_id, uint32_t row);
  absl::StatusOr<v1::CacheInfo> FilterRows(const std::string& cache_id,
                                           absl::Span<const uint32_t> keep_rows);
  absl::StatusOr<v1::CacheInfo> MergeCaches(absl::Span<const std::string> cache_ids);
  absl::StatusOr<v1::CacheInfo> ExtendCache(const std::string& cache_id,
                                            const std::string& other_id);

  // Speculative decoding: drafted updates carry LayerUpdate::speculation_id.
  absl::StatusOr<v1::BeginSpeculationResponse> BeginSpeculation(
      const std::string& cache_id, const SpeculationOptions& options = {});
  absl::StatusOr<v1::CacheInfo> CommitSpeculation(const std::string& speculation_id,
                                                  uint64_t accepted);
  absl::StatusOr<v1::CacheInfo> AbortSpeculation(const std::string& speculation_id);

  v1::KvCacheService::Stub& stub() { return *stub_; }
  // The gRPC channel, e.g. to watch its connectivity state.
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  // Waits for the channel's first connection (ClientOptions::first_connect_wait);
  // every call of this class does so itself, a caller of stub() may.
  void AwaitFirstConnect() const;
  const ClientOptions& options() const { return options_; }
  // Whether Update and Fetch go over the data lane (ClientOptions::data_lane).
  bool uses_data_lane();

  ~Client();

 private:
  friend class UpdateStream;
  Client(const ClientOptions& options, std::shared_ptr<grpc::Channel> channel);
  // Where this call's Fetch goes (ClientOptions::data_lane).
  internal::FetchTransport& fetch_transport();
  // One attempt of ImportSnapshot: the whole file as one stream.
  grpc::Status SendImport(grpc::ClientContext& context, absl::string_view file,
                          const v1::ImportSnapshotRequest& first,
                          v1::LoadSnapshotResponse* response);

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  mutable std::atomic<bool> connected_once_{false};
  std::unique_ptr<v1::KvCacheService::Stub> stub_;
  // Update with requests the client encodes itself (update_encoding.h).
  grpc::internal::RpcMethod raw_update_;
  std::unique_ptr<internal::LanePool> lanes_;
  std::unique_ptr<internal::FetchTransport> grpc_fetch_;
  std::unique_ptr<internal::FetchTransport> lane_fetch_;
};

// Streams a snapshot (or saved file) out of one server and into another, a
// chunk at a time: the bytes pass through this process but are never all
// held here. `to_options` as for ImportSnapshot (name, pinned, ttl). Where
// either side answers UNAVAILABLE the copy runs again from the start, its
// import under the same request_id, so a lost answer never imports twice.
absl::StatusOr<v1::LoadSnapshotResponse> CopySnapshot(Client& from,
                                                      const v1::ExportSnapshotRequest& request,
                                                      Client& to,
                                                      const v1::ImportSnapshotRequest& to_options);

// A long-lived Update stream: Write() sends one layer's tokens without waiting
// for their acknowledgement. Over gRPC a reader thread collects the
// acknowledgements; on the data lane every eighth Write and each
// acknowledged_count take those that have arrived (and Finish the rest), so
// a Write may return true a few messages after the server refused one.
// Finish() closes the stream and returns every acknowledgement, or the
// status of the first failed request (those before it were applied and
// acknowledged).
class UpdateStream {
 public:
  // Over the data lane when the client uses one (Client::uses_data_lane).
  UpdateStream(Client& client, std::string cache_id);
  ~UpdateStream();
  // False once the stream has broken (Finish tells why). The tensors are
  // copied once, straight into the outgoing message (on the data lane: by
  // the kernel, into the socket, before this returns).
  bool Write(const LayerUpdate& update);
  // Write without copying the tensors: gRPC sends them from where they lie
  // and holds a copy of `owner` until it is done with them, which can be after
  // this returns (once the bytes are in the kernel's socket buffer, at the
  // latest when the stream ends). Whatever `owner` keeps alive must hold
  // update.keys and update.values (and the state's conv and delta), unchanged,
  // until gRPC drops it: typically a shared_ptr to the buffers themselves.
  bool WriteShared(const LayerUpdate& update, std::shared_ptr<const void> owner);
  // Acknowledgements received so far; safe to call while writing.
  uint64_t acknowledged_count() const;
  absl::StatusOr<std::vector<v1::UpdateResponse>> Finish();
  // Every acknowledgement, also when Finish failed (the requests that were
  // applied). Call only after Finish: it fills until then
  // (acknowledged_count() is the live count).
  const std::vector<v1::UpdateResponse>& acknowledged() const;

 private:
  std::unique_ptr<internal::UpdateTransport> transport_;
  bool finished_ = false;
};

}  // namespace kvcache
