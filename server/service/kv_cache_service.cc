#include "service/kv_cache_service.h"

#include "core/log.h"
#include "service/stream_reactors.h"
#include "service/status_mapping.h"

namespace kvcache::service {
namespace {

// Unary calls are metadata operations that finish in microseconds, so they run
// inline on the callback thread and finish at once.
grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context,
                                      const absl::Status& status, const char* rpc) {
  if (!status.ok() && status.code() == absl::StatusCode::kInternal) {
    LogError("%s failed: %s", rpc, status.ToString());
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

#define KV_UNARY_RPC(Name, Request, Response)                                               \
  grpc::ServerUnaryReactor* KvCacheService::Name(grpc::CallbackServerContext* context,     \
                                                 const v1::Request* request,               \
                                                 v1::Response* response) {                 \
    return FinishUnary(context, handlers_.Name(*request, response), #Name);                \
  }

KV_UNARY_RPC(CreateCache, CreateCacheRequest, CacheInfo)
KV_UNARY_RPC(GetCache, GetCacheRequest, CacheInfo)
KV_UNARY_RPC(ListCaches, ListCachesRequest, ListCachesResponse)
KV_UNARY_RPC(DeleteCache, DeleteCacheRequest, DeleteCacheResponse)
KV_UNARY_RPC(Trim, TrimRequest, TrimResponse)
KV_UNARY_RPC(Snapshot, SnapshotRequest, SnapshotInfo)
KV_UNARY_RPC(Restore, RestoreRequest, CacheInfo)
KV_UNARY_RPC(MergeSnapshots, MergeSnapshotsRequest, SnapshotInfo)
KV_UNARY_RPC(SplitSnapshot, SplitSnapshotRequest, SplitSnapshotResponse)
KV_UNARY_RPC(ReleaseSnapshot, ReleaseSnapshotRequest, ReleaseSnapshotResponse)
KV_UNARY_RPC(ListSnapshots, ListSnapshotsRequest, ListSnapshotsResponse)
KV_UNARY_RPC(ExtractRow, ExtractRowRequest, CacheInfo)
KV_UNARY_RPC(FilterRows, FilterRowsRequest, CacheInfo)
KV_UNARY_RPC(MergeCaches, MergeCachesRequest, CacheInfo)
KV_UNARY_RPC(ExtendCache, ExtendCacheRequest, CacheInfo)
KV_UNARY_RPC(BeginSpeculation, BeginSpeculationRequest, BeginSpeculationResponse)
KV_UNARY_RPC(CommitSpeculation, CommitSpeculationRequest, CacheInfo)
KV_UNARY_RPC(AbortSpeculation, AbortSpeculationRequest, CacheInfo)
KV_UNARY_RPC(GetStats, GetStatsRequest, Stats)

#undef KV_UNARY_RPC

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KvCacheService::Update(
    grpc::CallbackServerContext* context) {
  return new UpdateReactor(handlers_);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvCacheService::Fetch(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return new FetchReactor(handlers_, *request);
}

}  // namespace kvcache::service
