#include "service/kv_cache_service.h"

#include "core/log.h"
#include "service/file_reactors.h"
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

KV_FOR_EACH_UNARY_RPC(KV_UNARY_RPC)

#undef KV_UNARY_RPC

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KvCacheService::Update(
    grpc::CallbackServerContext* context) {
  return new UpdateReactor(handlers_);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvCacheService::Fetch(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return new FetchReactor(handlers_, *request);
}

grpc::ServerWriteReactor<v1::FileChunk>* KvCacheService::ExportSnapshot(
    grpc::CallbackServerContext* context, const v1::ExportSnapshotRequest* request) {
  return new ExportReactor(handlers_, *request);
}

// A file larger than the pool could never load, so no more is buffered.
grpc::ServerReadReactor<v1::ImportSnapshotRequest>* KvCacheService::ImportSnapshot(
    grpc::CallbackServerContext* context, v1::LoadSnapshotResponse* response) {
  return new ImportReactor(handlers_, context, response, handlers_.MaxImportBytes());
}

}  // namespace kvcache::service
