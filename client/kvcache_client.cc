#include "kvcache_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <cstring>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "call_metadata.h"
#include "fetch_transport.h"
#include "fetch_view.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "lane_client.h"
#include "retry_policy.h"
#include "update_encoding.h"
#include "update_transport.h"

namespace kvcache {
namespace {

// The lane's TLS: as the gRPC channel's (ClientOptions::tls), with the same
// certificates and trust; null for plaintext.
absl::StatusOr<std::shared_ptr<const lane::TlsContext>> LaneTls(const ClientOptions& options) {
  if (!options.tls) return nullptr;
  return lane::TlsContext::ForClient({.cert_chain_pem = options.tls_client_cert_pem,
                                      .private_key_pem = options.tls_client_key_pem,
                                      .trusted_ca_pem = options.tls_root_certs_pem});
}

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// A fresh id for a request that creates, changes or consumes something, so
// that a retry of it (retry_policy.h) is answered once by the server.
// 128 random bits: unique without any coordination between clients.
std::string NewRequestId() {
  thread_local absl::BitGen random;
  return absl::StrFormat("%016x%016x", absl::Uniform<uint64_t>(random),
                         absl::Uniform<uint64_t>(random));
}

// `request` as sent: with a new request_id where its type has one and the
// caller set none.
template <typename Request>
Request WithRequestId(Request request) {
  if constexpr (requires { request.request_id(); }) {
    if (request.request_id().empty()) request.set_request_id(NewRequestId());
  }
  return request;
}

// HTTP/2 pings every keepalive_time, on idle channels too and without end
// (gRPC's client stops after two pings without data unless told otherwise).
void SetKeepalive(const ClientOptions& options, grpc::ChannelArguments& args) {
  if (options.keepalive_time <= absl::ZeroDuration()) return;
  const auto ms = [](absl::Duration d) {
    return static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 1, INT32_MAX));
  };
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ms(options.keepalive_time));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms(options.keepalive_timeout));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
}

// The lane's TCP keepalive, as the channel's; none where pings are off.
std::optional<lane::Keepalive> LaneKeepalive(const ClientOptions& options) {
  if (options.keepalive_time <= absl::ZeroDuration()) return std::nullopt;
  return lane::Keepalive{.time = options.keepalive_time, .timeout = options.keepalive_timeout};
}

template <typename Response, typename Call>
absl::StatusOr<Response> Unary(const Client& client, Call&& call) {
  client.AwaitFirstConnect();
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + client.options().deadline));
  Response response;
  grpc::Status status = call(&context, &response);
  if (!status.ok()) return FromGrpc(status);
  return response;
}

}  // namespace

absl::StatusOr<LayerHistory> AssembleHistory(absl::Span<const v1::FetchResponse> chunks) {
  LayerHistory history;
  if (chunks.empty()) return history;
  // States and packed chunks have no [B, H, L, D] tensors to join (reading
  // their shapes here would index past the end): they have calls of their own.
  for (const v1::FetchResponse& chunk : chunks) {
    if (chunk.keys().shape_size() != 4 || chunk.values().shape_size() != 4 ||
        chunk.values().shape(2) != chunk.keys().shape(2)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a chunk of layer ", chunk.layer(), " at ", chunk.start(),
          " holds no [B, H, L, D] keys and values (recurrent states: FetchState; packed "
          "quantized chunks: FetchPacked)"));
    }
  }
  for (const v1::FetchResponse& chunk : chunks) {
    const uint64_t begin = chunk.start();
    const uint64_t end = begin + chunk.keys().shape(2);
    if (!history.ranges.empty() && history.ranges.back().second == begin) {
      history.ranges.back().second = end;
    } else {
      history.ranges.emplace_back(begin, end);
    }
    history.tokens += end - begin;
  }
  const v1::Tensor& first = chunks[0].keys();
  const uint64_t row_heads = first.shape(0) * first.shape(1);
  for (auto [out, values] : {std::pair{&history.keys, false}, std::pair{&history.values, true}}) {
    const v1::Tensor& shape_of = values ? chunks[0].values() : first;
    const uint64_t token_bytes = shape_of.data().size() / (row_heads * shape_of.shape(2));
    out->resize(row_heads * history.tokens * token_bytes);
    uint64_t at = 0;  // tokens placed so far
    for (const v1::FetchResponse& chunk : chunks) {
      const std::string& data = values ? chunk.values().data() : chunk.keys().data();
      const uint64_t length = chunk.keys().shape(2);
      if (data.size() != row_heads * length * token_bytes) {
        return absl::DataLossError("a fetch chunk's size does not match its shape");
      }
      for (uint64_t rh = 0; rh < row_heads; ++rh) {
        std::memcpy(out->data() + (rh * history.tokens + at) * token_bytes,
                    data.data() + rh * length * token_bytes, length * token_bytes);
      }
      at += length;
    }
  }
  return history;
}

std::unique_ptr<Client> Client::Connect(const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetServiceConfigJSON(internal::RetryServiceConfig());
  if (options.dedicated_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  SetKeepalive(options, args);
  if (options.max_reconnect_backoff > absl::ZeroDuration()) {
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(options.max_reconnect_backoff));
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, ms);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, std::min(ms, 1000));
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, std::min(ms, 1000));
  }
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!options.token.empty()) {
    interceptors.push_back(internal::BearerTokenInterceptors(options.token));
  }
  if (!options.replica.empty()) {
    interceptors.push_back(
        internal::FixedMetadataInterceptors(internal::kReplicaHeader, options.replica));
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (options.tls) {
    credentials = grpc::SslCredentials({.pem_root_certs = options.tls_root_certs_pem,
                                        .pem_private_key = options.tls_client_key_pem,
                                        .pem_cert_chain = options.tls_client_cert_pem});
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
  }
  auto channel = grpc::experimental::CreateCustomChannelWithInterceptors(
      options.address, credentials, args, std::move(interceptors));
  return std::unique_ptr<Client>(new Client(options, std::move(channel)));
}

Client::Client(const ClientOptions& options, std::shared_ptr<grpc::Channel> channel)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::KvCacheService::NewStub(channel_)),
      raw_update_("/kvcache.v1.KvCacheService/Update", grpc::internal::RpcMethod::BIDI_STREAMING,
                  channel_),
      lanes_(std::make_unique<internal::LanePool>(
          options.data_lane, options.address, options.deadline, options.max_message_bytes,
          options.token,
          [this]() -> absl::StatusOr<std::string> {
            absl::StatusOr<v1::Stats> stats = GetStats();
            if (!stats.ok()) return stats.status();
            return stats->data_lane_address();
          },
          LaneTls(options), options.tls_server_name, LaneKeepalive(options))),
      grpc_fetch_(internal::GrpcFetchTransport(*stub_, options.deadline)),
      lane_fetch_(internal::LaneFetchTransport(*lanes_)) {}

Client::~Client() = default;

bool Client::uses_data_lane() { return lanes_->enabled(); }

void Client::AwaitFirstConnect() const {
  if (connected_once_.load(std::memory_order_acquire)) return;
  const absl::Duration wait = std::min(options_.first_connect_wait, options_.deadline);
  const bool ready = channel_->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_READY ||
                     (wait > absl::ZeroDuration() &&
                      channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + wait)));
  if (ready) connected_once_.store(true, std::memory_order_release);
}

absl::Status Client::WaitForReady(absl::Duration timeout) {
  if (channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat("no kvcached answers at ", options_.address));
}

// The call of one unary RPC; the request is stamped once, so every attempt
// gRPC makes of it carries the same request_id.
#define KV_UNARY(Method, request)                                                  \
  [&, sent = WithRequestId(request)](grpc::ClientContext* context, auto* response) { \
    return stub_->Method(context, sent, response);                                 \
  }

absl::StatusOr<v1::CacheInfo> Client::CreateCache(const v1::CacheSpec& spec,
                                                  const CreateCacheOptions& options) {
  v1::CreateCacheRequest request;
  *request.mutable_spec() = spec;
  request.set_ttl_seconds(options.ttl_seconds);
  return Unary<v1::CacheInfo>(*this, KV_UNARY(CreateCache, request));
}

absl::StatusOr<v1::CacheInfo> Client::GetCache(const std::string& cache_id) {
  v1::GetCacheRequest request;
  request.set_cache_id(cache_id);
  return Unary<v1::CacheInfo>(*this, KV_UNARY(GetCache, request));
}

absl::StatusOr<std::vector<v1::CacheInfo>> Client::ListCaches(const ListCachesOptions& options) {
  v1::ListCachesRequest request;
  request.set_tenant(options.tenant);
  auto response = Unary<v1::ListCachesResponse>(*this, KV_UNARY(ListCaches, request));
  if (!response.ok()) return response.status();
  return std::vector<v1::CacheInfo>(response->caches().begin(), response->caches().end());
}

absl::Status Client::DeleteCache(const std::string& cache_id) {
  v1::DeleteCacheRequest request;
  request.set_cache_id(cache_id);
  return Unary<v1::DeleteCacheResponse>(*this, KV_UNARY(DeleteCache, request)).status();
}

absl::StatusOr<v1::TrimResponse> Client::Trim(const std::string& cache_id, uint64_t n) {
  v1::TrimRequest request;
  request.set_cache_id(cache_id);
  request.set_n(n);
  return Unary<v1::TrimResponse>(*this, KV_UNARY(Trim, request));
}

absl::StatusOr<v1::SnapshotInfo> Client::Snapshot(const std::string& cache_id,
                                                  const SnapshotOptions& options) {
  v1::SnapshotRequest request;
  request.set_cache_id(cache_id);
  request.set_from_offset(options.from_offset);
  request.set_pinned(options.pinned);
  request.set_ttl_seconds(options.ttl_seconds);
  return Unary<v1::SnapshotInfo>(*this, KV_UNARY(Snapshot, request));
}

absl::StatusOr<v1::CacheInfo> Client::Restore(const std::string& cache_id,
                                              const std::string& snapshot_id,
                                              uint64_t target_offset) {
  v1::RestoreRequest request;
  request.set_cache_id(cache_id);
  request.set_snapshot_id(snapshot_id);
  request.set_target_offset(target_offset);
  return Unary<v1::CacheInfo>(*this, KV_UNARY(Restore, request));
}

absl::StatusOr<v1::SnapshotInfo> Client::MergeSnapshots(const std::string& parent_id,
                                                        const std::string& child_id) {
  v1::MergeSnapshotsRequest request;
  request.set_parent_id(parent_id);
  request.set_child_id(child_id);
  return Unary<v1::SnapshotInfo>(*this, KV_UNARY(MergeSnapshots, request));
}

absl::StatusOr<v1::SplitSnapshotResponse> Client::SplitSnapshot(const std::string& snapshot_id,
                                                                uint64_t at) {
  v1::SplitSnapshotRequest request;
  request.set_snapshot_id(snapshot_id);
  request.set_at(at);
  return Unary<v1::SplitSnapshotResponse>(*this, KV_UNARY(SplitSnapshot, request));
}

absl::Status Client::ReleaseSnapshot(const std::string& snapshot_id) {
  v1::ReleaseSnapshotRequest request;
  request.set_snapshot_id(snapshot_id);
  return Unary<v1::ReleaseSnapshotResponse>(*this, KV_UNARY(ReleaseSnapshot, request)).status();
}

absl::StatusOr<std::vector<v1::SnapshotInfo>> Client::ListSnapshots(
    const ListSnapshotsOptions& options) {
  v1::ListSnapshotsRequest request;
  request.set_cache_id(options.cache_id);
  request.set_tenant(options.tenant);
  auto response = Unary<v1::ListSnapshotsResponse>(*this, KV_UNARY(ListSnapshots, request));
  if (!response.ok()) return response.status();
  return std::vector<v1::SnapshotInfo>(response->snapshots().begin(), response->snapshots().end());
}

absl::StatusOr<v1::Stats> Client::GetStats() {
  return Unary<v1::Stats>(*this, KV_UNARY(GetStats, v1::GetStatsRequest()));
}

absl::StatusOr<bool> Client::Serving(const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  const auto stub = grpc::health::v1::Health::NewStub(channel_);
  auto response = Unary<grpc::health::v1::HealthCheckResponse>(
      *this, [&](grpc::ClientContext* context, auto* response) {
        return stub->Check(context, request, response);
      });
  if (!response.ok()) return response.status();
  return response->status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

absl::StatusOr<v1::RenewLeaseResponse> Client::RenewLease(
    absl::Span<const std::string> cache_ids, absl::Span<const std::string> snapshot_ids) {
  v1::RenewLeaseRequest request;
  for (const std::string& id : cache_ids) request.add_cache_ids(id);
  for (const std::string& id : snapshot_ids) request.add_snapshot_ids(id);
  return Unary<v1::RenewLeaseResponse>(*this, KV_UNARY(RenewLease, request));
}

absl::StatusOr<v1::SnapshotInfo> Client::SetPinned(const std::string& snapshot_id, bool pinned) {
  v1::SetPinnedRequest request;
  request.set_snapshot_id(snapshot_id);
  request.set_pinned(pinned);
  return Unary<v1::SnapshotInfo>(*this, KV_UNARY(SetPinned, request));
}

absl::StatusOr<v1::EvictSnapshotsResponse> Client::EvictSnapshots(
    const EvictSnapshotsOptions& options) {
  v1::EvictSnapshotsRequest request;
  request.set_bytes(options.bytes);
  request.set_tenant(options.tenant);
  return Unary<v1::EvictSnapshotsResponse>(*this, KV_UNARY(EvictSnapshots, request));
}

absl::StatusOr<v1::PublishPrefixResponse> Client::PublishPrefix(
    const std::string& snapshot_id, absl::Span<const uint32_t> tokens,
    const PublishPrefixOptions& options) {
  v1::PublishPrefixRequest request;
  request.set_snapshot_id(snapshot_id);
  request.mutable_tokens()->Add(tokens.begin(), tokens.end());
  request.set_ttl_seconds(options.ttl_seconds);
  return Unary<v1::PublishPrefixResponse>(*this, KV_UNARY(PublishPrefix, request));
}

absl::StatusOr<v1::LookupPrefixResponse> Client::LookupPrefix(const v1::CacheSpec& spec,
                                                              absl::Span<const uint32_t> tokens,
                                                              const LookupPrefixOptions& options) {
  v1::LookupPrefixRequest request;
  *request.mutable_spec() = spec;
  request.mutable_tokens()->Add(tokens.begin(), tokens.end());
  request.set_ttl_seconds(options.ttl_seconds);
  return Unary<v1::LookupPrefixResponse>(*this, KV_UNARY(LookupPrefix, request));
}

absl::StatusOr<v1::LookupPrefixResponse> Client::LookupPrefixCache(
    const std::string& cache_id, absl::Span<const uint32_t> tokens,
    const LookupPrefixOptions& options) {
  v1::LookupPrefixRequest request;
  request.set_cache_id(cache_id);
  request.mutable_tokens()->Add(tokens.begin(), tokens.end());
  request.set_ttl_seconds(options.ttl_seconds);
  return Unary<v1::LookupPrefixResponse>(*this, KV_UNARY(LookupPrefix, request));
}

absl::StatusOr<std::vector<v1::PrefixEntry>> Client::ListPrefixes() {
  auto response =
      Unary<v1::ListPrefixesResponse>(*this, KV_UNARY(ListPrefixes, v1::ListPrefixesRequest()));
  if (!response.ok()) return response.status();
  return std::vector<v1::PrefixEntry>(response->entries().begin(), response->entries().end());
}

absl::StatusOr<v1::SavedFile> Client::SaveSnapshot(
    const std::string& snapshot_id, const std::string& name,
    const std::map<std::string, std::string>& metadata) {
  v1::SaveSnapshotRequest request;
  request.set_snapshot_id(snapshot_id);
  request.set_name(name);
  request.mutable_metadata()->insert(metadata.begin(), metadata.end());
  return Unary<v1::SavedFile>(*this, KV_UNARY(SaveSnapshot, request));
}

absl::StatusOr<v1::LoadSnapshotResponse> Client::LoadSnapshot(const std::string& name,
                                                              const NewSnapshotOptions& options) {
  v1::LoadSnapshotRequest request;
  request.set_name(name);
  request.set_pinned(options.pinned);
  request.set_ttl_seconds(options.ttl_seconds);
  return Unary<v1::LoadSnapshotResponse>(*this, KV_UNARY(LoadSnapshot, request));
}

absl::StatusOr<v1::LoadSnapshotResponse> Client::PullSnapshot(const std::string& snapshot_id,
                                                              const NewSnapshotOptions& options) {
  v1::PullSnapshotRequest request;
  request.set_snapshot_id(snapshot_id);
  request.set_pinned(options.pinned);
  request.set_ttl_seconds(options.ttl_seconds);
  return Unary<v1::LoadSnapshotResponse>(*this, KV_UNARY(PullSnapshot, request));
}

absl::StatusOr<std::vector<v1::SavedFile>> Client::ListSaved() {
  auto response = Unary<v1::ListSavedResponse>(*this, KV_UNARY(ListSaved, v1::ListSavedRequest()));
  if (!response.ok()) return response.status();
  return std::vector<v1::SavedFile>(response->files().begin(), response->files().end());
}

absl::Status Client::DeleteSaved(const std::string& name) {
  v1::DeleteSavedRequest request;
  request.set_name(name);
  return Unary<v1::DeleteSavedResponse>(*this, KV_UNARY(DeleteSaved, request)).status();
}

absl::StatusOr<std::string> Client::ExportSnapshot(const v1::ExportSnapshotRequest& request) {
  AwaitFirstConnect();
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.deadline));
  std::unique_ptr<grpc::ClientReader<v1::FileChunk>> reader =
      stub_->ExportSnapshot(&context, request);
  std::string file;
  v1::FileChunk chunk;
  while (reader->Read(&chunk)) file.append(chunk.data());
  if (grpc::Status status = reader->Finish(); !status.ok()) return FromGrpc(status);
  return file;
}

// Chunks below gRPC's default 4 MiB message cap. gRPC keeps too little of a
// client stream to retry one, so the file is sent again from here, with the
// same request_id, which the server answers once.
absl::StatusOr<v1::LoadSnapshotResponse> Client::ImportSnapshot(
    absl::string_view file, const v1::ImportSnapshotRequest& options) {
  AwaitFirstConnect();
  const absl::Time deadline = absl::Now() + options_.deadline;
  const v1::ImportSnapshotRequest first = WithRequestId(options);
  v1::LoadSnapshotResponse answer;
  const grpc::Status status = internal::RetryUnavailable(deadline, [&] {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    v1::LoadSnapshotResponse response;  // a failed attempt's leaves nothing behind
    grpc::Status sent = SendImport(context, file, first, &response);
    if (sent.ok()) answer = std::move(response);
    return sent;
  });
  if (!status.ok()) return FromGrpc(status);
  return answer;
}

grpc::Status Client::SendImport(grpc::ClientContext& context, absl::string_view file,
                                const v1::ImportSnapshotRequest& first,
                                v1::LoadSnapshotResponse* response) {
  constexpr size_t kChunkBytes = 1 << 20;
  std::unique_ptr<grpc::ClientWriter<v1::ImportSnapshotRequest>> writer =
      stub_->ImportSnapshot(&context, response);
  v1::ImportSnapshotRequest request = first;
  size_t sent = 0;
  do {  // at least one message, so that the options arrive with an empty file
    const size_t size = std::min(kChunkBytes, file.size() - sent);
    request.set_data(file.data() + sent, size);
    sent += size;
    if (!writer->Write(request)) break;  // the server ended the call: Finish says why
    request.Clear();
  } while (sent < file.size());
  writer->WritesDone();
  return writer->Finish();
}

namespace {

// One attempt of CopySnapshot: the export read through and written into the
// import as it arrives. The status is the side's that failed first.
grpc::Status CopyOnce(Client& from, const v1::ExportSnapshotRequest& request,
                      absl::Time export_deadline, Client& to,
                      const v1::ImportSnapshotRequest& first, absl::Time import_deadline,
                      v1::LoadSnapshotResponse* response) {
  grpc::ClientContext export_context;
  export_context.set_deadline(absl::ToChronoTime(export_deadline));
  std::unique_ptr<grpc::ClientReader<v1::FileChunk>> reader =
      from.stub().ExportSnapshot(&export_context, request);
  grpc::ClientContext import_context;
  import_context.set_deadline(absl::ToChronoTime(import_deadline));
  std::unique_ptr<grpc::ClientWriter<v1::ImportSnapshotRequest>> writer =
      to.stub().ImportSnapshot(&import_context, response);
  v1::ImportSnapshotRequest piece = first;
  v1::FileChunk chunk;
  bool import_open = true;
  while (import_open && reader->Read(&chunk)) {
    piece.set_allocated_data(chunk.release_data());
    import_open = writer->Write(piece);  // false: the importer ended the call
    piece.Clear();
  }
  if (!import_open) export_context.TryCancel();
  const grpc::Status exported = reader->Finish();
  if (!exported.ok() && import_open) {
    import_context.TryCancel();  // a half-sent file must not be imported
    writer->Finish();
    return exported;
  }
  writer->WritesDone();
  return writer->Finish();
}

}  // namespace

// A copy that loses either connection runs again from the start, as
// ImportSnapshot does: the export is a read, and every attempt's import
// carries the same request_id, which the importer answers once.
absl::StatusOr<v1::LoadSnapshotResponse> CopySnapshot(Client& from,
                                                      const v1::ExportSnapshotRequest& request,
                                                      Client& to,
                                                      const v1::ImportSnapshotRequest& to_options) {
  from.AwaitFirstConnect();
  to.AwaitFirstConnect();
  const absl::Time start = absl::Now();
  const absl::Time export_deadline = start + from.options().deadline;
  const absl::Time import_deadline = start + to.options().deadline;
  const v1::ImportSnapshotRequest first = WithRequestId(to_options);
  v1::LoadSnapshotResponse answer;
  const grpc::Status status =
      internal::RetryUnavailable(std::min(export_deadline, import_deadline), [&] {
        v1::LoadSnapshotResponse response;
        grpc::Status copied =
            CopyOnce(from, request, export_deadline, to, first, import_deadline, &response);
        if (copied.ok()) answer = std::move(response);
        return copied;
      });
  if (!status.ok()) return FromGrpc(status);
  return answer;
}

absl::StatusOr<v1::CacheInfo> Client::ExtractRow(const std::string& cache_id, uint32_t row) {
  v1::ExtractRowRequest request;
  request.set_cache_id(cache_id);
  request.set_row(row);
  return Unary<v1::CacheInfo>(*this, KV_UNARY(ExtractRow, request));
}

absl::StatusOr<v1::CacheInfo> Client::FilterRows(const std::string& cache_id,
                                                 absl::Span<const uint32_t> keep_rows) {
  v1::FilterRowsRequest request;
  request.set_cache_id(cache_id);
  for (uint32_t row : keep_rows) request.add_keep_rows(row);
  return Unary<v1::CacheInfo>(*this, KV_UNARY(FilterRows, request));
}

absl::StatusOr<v1::CacheInfo> Client::MergeCaches(absl::Span<const std::string> cache_ids) {
  v1::MergeCachesRequest request;
  for (const std::string& id : cache_ids) request.add_cache_ids(id);
  return Unary<v1::CacheInfo>(*this, KV_UNARY(MergeCaches, request));
}

absl::StatusOr<v1::CacheInfo> Client::ExtendCache(const std::string& cache_id,
                                                  const std::string& other_id) {
  v1::ExtendCacheRequest request;
  request.set_cache_id(cache_id);
  request.set_other_id(other_id);
  return Unary<v1::CacheInfo>(*this, KV_UNARY(ExtendCache, request));
}

absl::StatusOr<v1::BeginSpeculationResponse> Client::BeginSpeculation(
    const std::string& cache_id, const SpeculationOptions& options) {
  v1::BeginSpeculationRequest request;
  request.set_cache_id(cache_id);
  request.set_isolated(options.isolated);
  return Unary<v1::BeginSpeculationResponse>(*this, KV_UNARY(BeginSpeculation, request));
}

absl::StatusOr<v1::CacheInfo> Client::CommitSpeculation(const std::string& speculation_id,
                                                        uint64_t accepted) {
  v1::CommitSpeculationRequest request;
  request.set_speculation_id(speculation_id);
  request.set_accepted(accepted);
  return Unary<v1::CacheInfo>(*this, KV_UNARY(CommitSpeculation, request));
}

absl::StatusOr<v1::CacheInfo> Client::AbortSpeculation(const std::string& speculation_id) {
  v1::AbortSpeculationRequest request;
  request.set_speculation_id(speculation_id);
  return Unary<v1::CacheInfo>(*this, KV_UNARY(AbortSpeculation, request));
}

#undef KV_UNARY

internal::FetchTransport& Client::fetch_transport() {
  if (uses_data_lane()) return *lane_fetch_;
  AwaitFirstConnect();
  return *grpc_fetch_;
}

absl::Status Client::Fetch(const v1::FetchRequest& request,
                           const std::function<absl::Status(const v1::FetchResponse&)>& on_chunk) {
  v1::FetchResponse chunk;
  return fetch_transport().Fetch(request, [&](internal::ReceivedChunk& received) {
    if (absl::Status taken = received.Take(chunk); !taken.ok()) return taken;
    return on_chunk(chunk);
  });
}

absl::Status Client::FetchViews(const v1::FetchRequest& request,
                               const std::function<absl::Status(const FetchChunkView&)>& on_chunk) {
  v1::FetchResponse header;
  FetchChunkView view;
  return fetch_transport().Fetch(request, [&](internal::ReceivedChunk& received) {
    if (absl::Status viewed = received.View(header, view); !viewed.ok()) return viewed;
    return on_chunk(view);
  });
}

absl::StatusOr<std::vector<v1::FetchResponse>> Client::FetchAll(const v1::FetchRequest& request) {
  // Taken straight into the list (not through Fetch's callback, which would
  // copy every chunk once more).
  std::vector<v1::FetchResponse> chunks;
  const absl::Status status =
      fetch_transport().Fetch(request, [&](internal::ReceivedChunk& received) {
        return received.Take(chunks.emplace_back());
      });
  if (!status.ok()) return status;
  return chunks;
}

namespace {

v1::FetchRequest LayerRequest(const std::string& cache_id, const std::string& snapshot_id,
                              uint32_t layer) {
  v1::FetchRequest request;
  request.set_cache_id(cache_id);
  request.set_snapshot_id(snapshot_id);
  request.add_layers(layer);
  return request;
}

}  // namespace

absl::StatusOr<LayerHistory> Client::FetchLayer(const std::string& cache_id,
                                                const std::string& snapshot_id, uint32_t layer) {
  auto chunks = FetchAll(LayerRequest(cache_id, snapshot_id, layer));
  if (!chunks.ok()) return chunks.status();
  return AssembleHistory(*chunks);
}

absl::StatusOr<LayerHistory> Client::FetchSpeculation(const std::string& speculation_id,
                                                      uint32_t layer) {
  v1::FetchRequest request;
  request.set_speculation_id(speculation_id);
  request.add_layers(layer);
  auto chunks = FetchAll(request);
  if (!chunks.ok()) return chunks.status();
  return AssembleHistory(*chunks);
}

absl::StatusOr<v1::RecurrentState> Client::FetchState(const std::string& cache_id,
                                                      const std::string& snapshot_id,
                                                      uint32_t layer) {
  auto chunks = FetchAll(LayerRequest(cache_id, snapshot_id, layer));
  if (!chunks.ok()) return chunks.status();
  if (chunks->size() != 1 || !(*chunks)[0].has_state()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", layer, " returned no recurrent state (is it recurrent, and set?)"));
  }
  return std::move(*(*chunks)[0].mutable_state());
}

absl::StatusOr<std::vector<v1::FetchResponse>> Client::FetchPacked(const std::string& cache_id,
                                                                   const std::string& snapshot_id,
                                                                   uint32_t layer) {
  v1::FetchRequest request = LayerRequest(cache_id, snapshot_id, layer);
  request.set_packed(true);
  return FetchAll(request);
}

std::unique_ptr<UpdateStream> Client::OpenUpdate(const std::string& cache_id) {
  return std::make_unique<UpdateStream>(*this, cache_id);
}

absl::StatusOr<std::vector<v1::UpdateResponse>> Client::Update(
    const std::string& cache_id, absl::Span<const LayerUpdate> updates) {
  UpdateStream stream(*this, cache_id);
  for (const LayerUpdate& update : updates) {
    if (!stream.Write(update)) break;
  }
  return stream.Finish();
}

UpdateStream::UpdateStream(Client& client, std::string cache_id)
    : transport_([&]() -> std::unique_ptr<internal::UpdateTransport> {
        if (client.uses_data_lane()) {
          return internal::OpenLaneUpdate(*client.lanes_, std::move(cache_id));
        }
        client.AwaitFirstConnect();
        return internal::OpenGrpcUpdate(*client.channel_, client.raw_update_, std::move(cache_id),
                                        client.options().deadline);
      }()) {}

UpdateStream::~UpdateStream() {
  if (!finished_) {
    transport_->Cancel();
    (void)Finish();
  }
}

bool UpdateStream::Write(const LayerUpdate& update) { return transport_->Write(update, nullptr); }

bool UpdateStream::WriteShared(const LayerUpdate& update, std::shared_ptr<const void> owner) {
  return transport_->Write(update, &owner);
}

uint64_t UpdateStream::acknowledged_count() const {
  transport_->CollectAcks();
  return transport_->ack_count();
}

const std::vector<v1::UpdateResponse>& UpdateStream::acknowledged() const {
  return transport_->acks();
}

absl::StatusOr<std::vector<v1::UpdateResponse>> UpdateStream::Finish() {
  finished_ = true;
  if (absl::Status status = transport_->Finish(); !status.ok()) return status;
  return transport_->acks();
}

}  // namespace kvcache
