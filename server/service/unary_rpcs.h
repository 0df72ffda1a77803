// Every unary RPC of kvcache.v1.KvCacheService, once: X(Name, Request,
// Response) per call, each answered by Handlers::Name(const v1::Request&,
// v1::Response*). Handlers declares its handlers and the callback service
// registers, declares and defines its methods from this list, so a new unary
// RPC is one line here plus its handler's definition. Update and Fetch
// stream and are registered raw, ExportSnapshot and ImportSnapshot stream
// files (kv_cache_service.h).
#pragma once

#define KV_FOR_EACH_UNARY_RPC(X)                                         \
  X(CreateCache, CreateCacheRequest, CacheInfo)                          \
  X(GetCache, GetCacheRequest, CacheInfo)                                \
  X(ListCaches, ListCachesRequest, ListCachesResponse)                   \
  X(DeleteCache, DeleteCacheRequest, DeleteCacheResponse)                \
  X(Trim, TrimRequest, TrimResponse)                                     \
  X(Snapshot, SnapshotRequest, SnapshotInfo)                             \
  X(Restore, RestoreRequest, CacheInfo)                                  \
  X(MergeSnapshots, MergeSnapshotsRequest, SnapshotInfo)                 \
  X(SplitSnapshot, SplitSnapshotRequest, SplitSnapshotResponse)          \
  X(ReleaseSnapshot, ReleaseSnapshotRequest, ReleaseSnapshotResponse)    \
  X(ListSnapshots, ListSnapshotsRequest, ListSnapshotsResponse)          \
  X(ExtractRow, ExtractRowRequest, CacheInfo)                            \
  X(FilterRows, FilterRowsRequest, CacheInfo)                            \
  X(MergeCaches, MergeCachesRequest, CacheInfo)                          \
  X(ExtendCache, ExtendCacheRequest, CacheInfo)                          \
  X(BeginSpeculation, BeginSpeculationRequest, BeginSpeculationResponse) \
  X(CommitSpeculation, CommitSpeculationRequest, CacheInfo)              \
  X(AbortSpeculation, AbortSpeculationRequest, CacheInfo)                \
  X(GetStats, GetStatsRequest, Stats)                                    \
  X(RenewLease, RenewLeaseRequest, RenewLeaseResponse)                   \
  X(SetPinned, SetPinnedRequest, SnapshotInfo)                           \
  X(EvictSnapshots, EvictSnapshotsRequest, EvictSnapshotsResponse)       \
  X(SaveSnapshot, SaveSnapshotRequest, SavedFile)                        \
  X(LoadSnapshot, LoadSnapshotRequest, LoadSnapshotResponse)             \
  X(ListSaved, ListSavedRequest, ListSavedResponse)                      \
  X(DeleteSaved, DeleteSavedRequest, DeleteSavedResponse)                \
  X(PublishPrefix, PublishPrefixRequest, PublishPrefixResponse)          \
  X(LookupPrefix, LookupPrefixRequest, LookupPrefixResponse)             \
  X(ListPrefixes, ListPrefixesRequest, ListPrefixesResponse)
