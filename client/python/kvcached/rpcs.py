"""The unary RPCs of kvcache.v1.KvCacheService as Client methods.

Each returns the response message (kvcache.v1's CacheInfo, SnapshotInfo...)
and raises KvCacheError on failure. Requests that have a request_id get a
fresh random one unless the caller gives one, so gRPC's retry of a call
whose answer was lost is answered once by the server (kvcache.proto,
"Retries"). Options are keyword-only, named as the request fields are.
"""

from typing import Iterable, List, Mapping, Optional, Sequence

from .proto import pb


class UnaryCalls:
    """Mixed into Client, which provides _unary(method name, request)."""

    def _unary(self, method: str, request):  # pragma: no cover - Client's
        raise NotImplementedError

    # Caches.

    def create_cache(self, spec: pb.CacheSpec, *, ttl_seconds: int = 0,
                     request_id: str = "") -> pb.CacheInfo:
        """Creates an empty cache of `spec` (leased for ttl_seconds; 0: the server's default)."""
        return self._unary("CreateCache", pb.CreateCacheRequest(
            spec=spec, ttl_seconds=ttl_seconds, request_id=request_id))

    def get_cache(self, cache_id: str) -> pb.CacheInfo:
        """Describes one cache."""
        return self._unary("GetCache", pb.GetCacheRequest(cache_id=cache_id))

    def list_caches(self, *, tenant: str = "") -> List[pb.CacheInfo]:
        """Every cache of the caller's tenant (an admin token may name another)."""
        return list(self._unary("ListCaches", pb.ListCachesRequest(tenant=tenant)).caches)

    def delete_cache(self, cache_id: str, *, request_id: str = "") -> None:
        """Frees a cache's pages; its snapshots stay valid."""
        self._unary("DeleteCache", pb.DeleteCacheRequest(cache_id=cache_id,
                                                          request_id=request_id))

    def trim(self, cache_id: str, n: int, *, request_id: str = "") -> pb.TrimResponse:
        """Drops the last n tokens of every layer (mlx-lm trim_prompt_cache)."""
        return self._unary("Trim", pb.TrimRequest(cache_id=cache_id, n=n, request_id=request_id))

    # Snapshots.

    def snapshot(self, cache_id: str, *, from_offset: int = 0, pinned: bool = False,
                 ttl_seconds: int = 0, request_id: str = "") -> pb.SnapshotInfo:
        """Captures [from_offset, offset) of every layer by page reference (no copy)."""
        return self._unary("Snapshot", pb.SnapshotRequest(
            cache_id=cache_id, from_offset=from_offset, pinned=pinned, ttl_seconds=ttl_seconds,
            request_id=request_id))

    def restore(self, cache_id: str, target_offset: int, snapshot_id: str = "") -> pb.CacheInfo:
        """Brings every layer to target_offset from a snapshot; without one,
        rewinds the live cache. All layers or none."""
        return self._unary("Restore", pb.RestoreRequest(
            cache_id=cache_id, snapshot_id=snapshot_id, target_offset=target_offset))

    def merge_snapshots(self, parent_id: str, child_id: str, *,
                        request_id: str = "") -> pb.SnapshotInfo:
        """Joins adjacent snapshots [a, b) and [b, c) into [a, c); consumes both."""
        return self._unary("MergeSnapshots", pb.MergeSnapshotsRequest(
            parent_id=parent_id, child_id=child_id, request_id=request_id))

    def split_snapshot(self, snapshot_id: str, at: int, *,
                       request_id: str = "") -> pb.SplitSnapshotResponse:
        """Cuts [a, c) at `at` into parent [a, at) and child [at, c); consumes the input."""
        return self._unary("SplitSnapshot", pb.SplitSnapshotRequest(
            snapshot_id=snapshot_id, at=at, request_id=request_id))

    def release_snapshot(self, snapshot_id: str, *, request_id: str = "") -> None:
        """Drops a snapshot handle (its pages are freed when nothing else holds them)."""
        self._unary("ReleaseSnapshot", pb.ReleaseSnapshotRequest(snapshot_id=snapshot_id,
                                                                  request_id=request_id))

    def list_snapshots(self, *, cache_id: str = "", tenant: str = "") -> List[pb.SnapshotInfo]:
        """Snapshot handles (of one cache, where cache_id is set)."""
        return list(self._unary("ListSnapshots", pb.ListSnapshotsRequest(
            cache_id=cache_id, tenant=tenant)).snapshots)

    # Leases and pins.

    def renew_lease(self, cache_ids: Iterable[str] = (),
                    snapshot_ids: Iterable[str] = ()) -> pb.RenewLeaseResponse:
        """Renews these handles' leases (all, or none when an id is unknown)."""
        return self._unary("RenewLease", pb.RenewLeaseRequest(
            cache_ids=list(cache_ids), snapshot_ids=list(snapshot_ids)))

    def set_pinned(self, snapshot_id: str, pinned: bool) -> pb.SnapshotInfo:
        """Pinned: never evicted, never expires (within --max_pinned_bytes)."""
        return self._unary("SetPinned", pb.SetPinnedRequest(snapshot_id=snapshot_id,
                                                             pinned=pinned))

    def evict_snapshots(self, *, bytes: int = 0, tenant: str = "") -> pb.EvictSnapshotsResponse:
        """Moves idle snapshots' device pages to host memory or disk now (0: all)."""
        return self._unary("EvictSnapshots", pb.EvictSnapshotsRequest(bytes=bytes, tenant=tenant))

    # Speculative decoding.

    def begin_speculation(self, cache_id: str, *, isolated: bool = False,
                          request_id: str = "") -> pb.BeginSpeculationResponse:
        """Opens a speculation on a cache: updates and fetches that name its id
        draft on top of the committed history."""
        return self._unary("BeginSpeculation", pb.BeginSpeculationRequest(
            cache_id=cache_id, isolated=isolated, request_id=request_id))

    def commit_speculation(self, speculation_id: str, accepted: int, *,
                           request_id: str = "") -> pb.CacheInfo:
        """Keeps the first `accepted` drafted tokens of every layer and ends it."""
        return self._unary("CommitSpeculation", pb.CommitSpeculationRequest(
            speculation_id=speculation_id, accepted=accepted, request_id=request_id))

    def abort_speculation(self, speculation_id: str, *, request_id: str = "") -> pb.CacheInfo:
        """Drops every drafted token and ends the speculation."""
        return self._unary("AbortSpeculation", pb.AbortSpeculationRequest(
            speculation_id=speculation_id, request_id=request_id))

    # Batches (mlx-lm BatchKVCache).

    def extract_row(self, cache_id: str, row: int, *, request_id: str = "") -> pb.CacheInfo:
        """A new one-row cache holding one row of a batch, its padding stripped."""
        return self._unary("ExtractRow", pb.ExtractRowRequest(cache_id=cache_id, row=row,
                                                               request_id=request_id))

    def filter_rows(self, cache_id: str, keep_rows: Sequence[int], *,
                    request_id: str = "") -> pb.CacheInfo:
        """Keeps only these rows, in this order (in place)."""
        return self._unary("FilterRows", pb.FilterRowsRequest(
            cache_id=cache_id, keep_rows=list(keep_rows), request_id=request_id))

    def merge_caches(self, cache_ids: Sequence[str], *, request_id: str = "") -> pb.CacheInfo:
        """A new batch of these caches' rows, right-aligned and left-padded."""
        return self._unary("MergeCaches", pb.MergeCachesRequest(cache_ids=list(cache_ids),
                                                                 request_id=request_id))

    def extend_cache(self, cache_id: str, other_id: str, *,
                     request_id: str = "") -> pb.CacheInfo:
        """Appends other's rows to cache_id (in place)."""
        return self._unary("ExtendCache", pb.ExtendCacheRequest(
            cache_id=cache_id, other_id=other_id, request_id=request_id))

    # Prefix sharing.

    def publish_prefix(self, snapshot_id: str, tokens: Sequence[int], *, ttl_seconds: int = 0,
                       request_id: str = "") -> pb.PublishPrefixResponse:
        """Publishes a snapshot's first len(tokens) positions as the K/V of `tokens`."""
        return self._unary("PublishPrefix", pb.PublishPrefixRequest(
            snapshot_id=snapshot_id, tokens=list(tokens), ttl_seconds=ttl_seconds,
            request_id=request_id))

    def lookup_prefix(self, tokens: Sequence[int], *, spec: Optional[pb.CacheSpec] = None,
                      cache_id: str = "", ttl_seconds: int = 0,
                      request_id: str = "") -> pb.LookupPrefixResponse:
        """The longest cached prefix of `tokens` for caches laid out as `spec`
        (or as cache `cache_id`): a snapshot handle to restore at
        matched_tokens, or matched_tokens 0."""
        return self._unary("LookupPrefix", pb.LookupPrefixRequest(
            spec=spec, cache_id=cache_id, tokens=list(tokens), ttl_seconds=ttl_seconds,
            request_id=request_id))

    def list_prefixes(self) -> List[pb.PrefixEntry]:
        """Every published prefix entry."""
        return list(self._unary("ListPrefixes", pb.ListPrefixesRequest()).entries)

    # Prompt-cache files in the server's data dir.

    def save_snapshot(self, snapshot_id: str, name: str,
                      metadata: Optional[Mapping[str, str]] = None) -> pb.SavedFile:
        """Writes a snapshot (from offset 0) as `name` in the data dir (mlx-lm's layout)."""
        return self._unary("SaveSnapshot", pb.SaveSnapshotRequest(
            snapshot_id=snapshot_id, name=name, metadata=dict(metadata or {})))

    def load_snapshot(self, name: str, *, pinned: bool = False, ttl_seconds: int = 0,
                      request_id: str = "") -> pb.LoadSnapshotResponse:
        """Reads a file of the data dir into a new snapshot."""
        return self._unary("LoadSnapshot", pb.LoadSnapshotRequest(
            name=name, pinned=pinned, ttl_seconds=ttl_seconds, request_id=request_id))

    def list_saved(self) -> List[pb.SavedFile]:
        """The data dir's files."""
        return list(self._unary("ListSaved", pb.ListSavedRequest()).files)

    def delete_saved(self, name: str, *, request_id: str = "") -> None:
        """Deletes a file of the data dir."""
        self._unary("DeleteSaved", pb.DeleteSavedRequest(name=name, request_id=request_id))

    def pull_snapshot(self, snapshot_id: str, *, pinned: bool = False, ttl_seconds: int = 0,
                      request_id: str = "") -> pb.LoadSnapshotResponse:
        """Copies another replica's snapshot to this server (the server fetches it)."""
        return self._unary("PullSnapshot", pb.PullSnapshotRequest(
            snapshot_id=snapshot_id, pinned=pinned, ttl_seconds=ttl_seconds,
            request_id=request_id))

    # The server.

    def get_stats(self) -> pb.Stats:
        """Device, pool and object counts."""
        return self._unary("GetStats", pb.GetStatsRequest())
