// The gRPC face of kvcached: a thin callback service that hands each call to
// Handlers and maps the returned absl::Status to a grpc::Status, code for code.
#pragma once

#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service/handlers.h"

namespace kvcache::service {

// v1::KvCacheService::CallbackService with Update and Fetch registered raw
// (grpc::ByteBuffer), so their tensors skip protobuf's copies (wire_format.h).
// A new RPC must be added here too, or the synchronous base answers it with an
// "unimplemented" status; e2e_validation_test calls every RPC of the proto to
// catch that.
using KvCacheServiceBase = v1::KvCacheService::WithCallbackMethod_CreateCache<
    v1::KvCacheService::WithCallbackMethod_GetCache<
    v1::KvCacheService::WithCallbackMethod_ListCaches<
    v1::KvCacheService::WithCallbackMethod_DeleteCache<
    v1::KvCacheService::WithRawCallbackMethod_Update<
    v1::KvCacheService::WithRawCallbackMethod_Fetch<
    v1::KvCacheService::WithCallbackMethod_Trim<
    v1::KvCacheService::WithCallbackMethod_Snapshot<
    v1::KvCacheService::WithCallbackMethod_Restore<
    v1::KvCacheService::WithCallbackMethod_MergeSnapshots<
    v1::KvCacheService::WithCallbackMethod_SplitSnapshot<
    v1::KvCacheService::WithCallbackMethod_ReleaseSnapshot<
    v1::KvCacheService::WithCallbackMethod_ListSnapshots<
    v1::KvCacheService::WithCallbackMethod_ExtractRow<
    v1::KvCacheService::WithCallbackMethod_FilterRows<
    v1::KvCacheService::WithCallbackMethod_MergeCaches<
    v1::KvCacheService::WithCallbackMethod_ExtendCache<
    v1::KvCacheService::WithCallbackMethod_BeginSpeculation<
    v1::KvCacheService::WithCallbackMethod_CommitSpeculation<
    v1::KvCacheService::WithCallbackMethod_AbortSpeculation<
    v1::KvCacheService::WithCallbackMethod_GetStats<
    v1::KvCacheService::Service>>>>>>>>>>>>>>>>>>>>>;

class KvCacheService final : public KvCacheServiceBase {
 public:
  explicit KvCacheService(Handlers& handlers) : handlers_(handlers) {}

  grpc::ServerUnaryReactor* CreateCache(grpc::CallbackServerContext* context,
                                        const v1::CreateCacheRequest* request,
                                        v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* GetCache(grpc::CallbackServerContext* context,
                                     const v1::GetCacheRequest* request,
                                     v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* ListCaches(grpc::CallbackServerContext* context,
                                       const v1::ListCachesRequest* request,
                                       v1::ListCachesResponse* response) override;
  grpc::ServerUnaryReactor* DeleteCache(grpc::CallbackServerContext* context,
                                        const v1::DeleteCacheRequest* request,
                                        v1::DeleteCacheResponse* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Update(
      grpc::CallbackServerContext* context) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Fetch(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* Trim(grpc::CallbackServerContext* context,
                                 const v1::TrimRequest* request,
                                 v1::TrimResponse* response) override;
  grpc::ServerUnaryReactor* Snapshot(grpc::CallbackServerContext* context,
                                     const v1::SnapshotRequest* request,
                                     v1::SnapshotInfo* response) override;
  grpc::ServerUnaryReactor* Restore(grpc::CallbackServerContext* context,
                                    const v1::RestoreRequest* request,
                                    v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* MergeSnapshots(grpc::CallbackServerContext* context,
                                           const v1::MergeSnapshotsRequest* request,
                                           v1::SnapshotInfo* response) override;
  grpc::ServerUnaryReactor* SplitSnapshot(grpc::CallbackServerContext* context,
                                          const v1::SplitSnapshotRequest* request,
                                          v1::SplitSnapshotResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseSnapshot(grpc::CallbackServerContext* context,
                                            const v1::ReleaseSnapshotRequest* request,
                                            v1::ReleaseSnapshotResponse* response) override;
  grpc::ServerUnaryReactor* ListSnapshots(grpc::CallbackServerContext* context,
                                          const v1::ListSnapshotsRequest* request,
                                          v1::ListSnapshotsResponse* response) override;
  grpc::ServerUnaryReactor* ExtractRow(grpc::CallbackServerContext* context,
                                       const v1::ExtractRowRequest* request,
                                       v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* FilterRows(grpc::CallbackServerContext* context,
                                       const v1::FilterRowsRequest* request,
                                       v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* MergeCaches(grpc::CallbackServerContext* context,
                                        const v1::MergeCachesRequest* request,
                                        v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* ExtendCache(grpc::CallbackServerContext* context,
                                        const v1::ExtendCacheRequest* request,
                                        v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* BeginSpeculation(grpc::CallbackServerContext* context,
                                             const v1::BeginSpeculationRequest* request,
                                             v1::BeginSpeculationResponse* response) override;
  grpc::ServerUnaryReactor* CommitSpeculation(grpc::CallbackServerContext* context,
                                              const v1::CommitSpeculationRequest* request,
                                              v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* AbortSpeculation(grpc::CallbackServerContext* context,
                                             const v1::AbortSpeculationRequest* request,
                                             v1::CacheInfo* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const v1::GetStatsRequest* request,
                                     v1::Stats* response) override;

 private:
  Handlers& handlers_;
};

}  // namespace kvcache::service
