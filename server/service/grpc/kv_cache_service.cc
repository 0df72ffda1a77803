#include "service/grpc/kv_cache_service.h"

#include "service/grpc/file_reactors.h"
#include "service/grpc/pull_reactor.h"
#include "service/grpc/status_mapping.h"
#include "service/grpc/stream_reactors.h"

namespace kvcache::service {
namespace {

// Unary calls are metadata operations that finish in microseconds, so they run
// inline on the callback thread and finish at once. (An INTERNAL status is
// logged with the call's request id by the server's RpcObserver.)
grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context,
                                      const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// An admitted unary call's answer. It holds the call's Admitted until gRPC
// is done sending it, so the call counts as alive (Tenants::calls_alive)
// until then and a shutdown never cuts its answer off.
class AnsweredUnary final : public grpc::ServerUnaryReactor {
 public:
  AnsweredUnary(Admitted call, const absl::Status& status) : call_(std::move(call)) {
    Finish(ToGrpcStatus(status));
  }
  void OnDone() override { delete this; }

 private:
  Admitted call_;
};

// A streaming call refused before it starts (no tenant, or past a quota).
template <typename Reactor>
class Refused final : public Reactor {
 public:
  explicit Refused(const absl::Status& status) { this->Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

absl::StatusOr<Admitted> KvCacheService::Admit(const grpc::CallbackServerContext& context) {
  const auto& metadata = context.client_metadata();
  const auto found = metadata.find("authorization");
  const absl::string_view authorization =
      found == metadata.end() ? absl::string_view()
                              : absl::string_view(found->second.data(), found->second.size());
  return tenants_.AdmitCall(authorization);
}

#define KV_UNARY_RPC(Name, Request, Response)                                                     \
  grpc::ServerUnaryReactor* KvCacheService::Name(                                                 \
      grpc::CallbackServerContext* context, const v1::Request* request, v1::Response* response) { \
    absl::StatusOr<Admitted> call = Admit(*context);                                              \
    if (!call.ok()) return FinishUnary(context, call.status());                                   \
    const absl::StatusOr<Handlers*> handlers = HandlersFor(*call, *request);                      \
    const absl::Status status =                                                                   \
        handlers.ok() ? (*handlers)->Answer(&Handlers::Name, #Name, *request, response)          \
                      : handlers.status();                                                        \
    if (status.ok()) Scope(*call, response);                                                      \
    call->Answering();                                                                            \
    return new AnsweredUnary(*std::move(call), status);                                           \
  }

KV_FOR_EACH_UNARY_RPC(KV_UNARY_RPC)

#undef KV_UNARY_RPC

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KvCacheService::Update(
    grpc::CallbackServerContext* context) {
  absl::StatusOr<Admitted> call = Admit(*context);
  if (!call.ok()) {
    return new Refused<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>>(call.status());
  }
  return new UpdateReactor(*std::move(call));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvCacheService::Fetch(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  absl::StatusOr<Admitted> call = Admit(*context);
  if (!call.ok()) return new Refused<grpc::ServerWriteReactor<grpc::ByteBuffer>>(call.status());
  return new FetchReactor(*std::move(call), *request);
}

grpc::ServerWriteReactor<v1::FileChunk>* KvCacheService::ExportSnapshot(
    grpc::CallbackServerContext* context, const v1::ExportSnapshotRequest* request) {
  absl::StatusOr<Admitted> call = Admit(*context);
  if (!call.ok()) return new Refused<grpc::ServerWriteReactor<v1::FileChunk>>(call.status());
  return new ExportReactor(*std::move(call), *request);
}

grpc::ServerReadReactor<v1::ImportSnapshotRequest>* KvCacheService::ImportSnapshot(
    grpc::CallbackServerContext* context, v1::LoadSnapshotResponse* response) {
  absl::StatusOr<Admitted> call = Admit(*context);
  if (!call.ok()) {
    return new Refused<grpc::ServerReadReactor<v1::ImportSnapshotRequest>>(call.status());
  }
  return new ImportReactor(*std::move(call), context, response);
}

grpc::ServerUnaryReactor* KvCacheService::PullSnapshot(grpc::CallbackServerContext* context,
                                                       const v1::PullSnapshotRequest* request,
                                                       v1::LoadSnapshotResponse* response) {
  absl::StatusOr<Admitted> call = Admit(*context);
  if (!call.ok()) return FinishUnary(context, call.status());
  return new PullReactor(*std::move(call), context, *request, response, peers_, replica_name_);
}

}  // namespace kvcache::service
