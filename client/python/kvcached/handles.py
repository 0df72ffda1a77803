"""Handles that release what they name when a `with` block ends, on error too.

    with client.new_cache(spec) as cache:            # DeleteCache at the end
        with client.new_snapshot(cache.id) as snap:  # ReleaseSnapshot at the end
            ...
        with client.speculation(cache.id) as spec:   # AbortSpeculation at the end,
            client.update(cache.id, 0, k, v, speculation_id=spec.id)
            spec.commit(2)                           # unless committed inside

Releasing something already gone (NOT_FOUND: consumed by a merge, expired,
deleted by hand) is not an error on the way out.
"""

from typing import TYPE_CHECKING, Any, Optional

import grpc

from .errors import KvCacheError
from .proto import pb

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client


def _release_quietly(release, *args: Any) -> None:
    """Runs a release call, taking NOT_FOUND as done already."""
    try:
        release(*args)
    except KvCacheError as error:
        if error.code != grpc.StatusCode.NOT_FOUND:
            raise


class _Handle:
    """Released once, by release() or at the end of a `with` block."""

    def __init__(self) -> None:
        self.released = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self.released:
            return
        try:
            self.release()
        except KvCacheError:
            if exc is None:
                raise  # never hide the error that is already on its way out

    def release(self) -> None:  # pragma: no cover - each handle's own
        raise NotImplementedError


class Cache(_Handle):
    """A cache, deleted on release. `info` is its CacheInfo when created."""

    def __init__(self, client: "Client", info: pb.CacheInfo) -> None:
        super().__init__()
        self.client = client
        self.info = info
        self.id: str = info.cache_id

    def refresh(self) -> pb.CacheInfo:
        """Reads the cache's info again (GetCache) and keeps it in `info`."""
        self.info = self.client.get_cache(self.id)
        return self.info

    def release(self) -> None:
        """Deletes the cache (its snapshots survive)."""
        self.released = True
        _release_quietly(self.client.delete_cache, self.id)


class Snapshot(_Handle):
    """A snapshot handle, released on release. `info` is its SnapshotInfo."""

    def __init__(self, client: "Client", info: pb.SnapshotInfo) -> None:
        super().__init__()
        self.client = client
        self.info = info
        self.id: str = info.snapshot_id

    def release(self) -> None:
        """Releases the handle (its pages go when nothing else holds them)."""
        self.released = True
        _release_quietly(self.client.release_snapshot, self.id)


class Speculation(_Handle):
    """An open speculation on a cache; aborted on release unless ended."""

    def __init__(self, client: "Client", cache_id: str,
                 begun: pb.BeginSpeculationResponse) -> None:
        super().__init__()
        self.client = client
        self.cache_id = cache_id
        self.id: str = begun.speculation_id
        self.committed_offset: int = begun.offset
        self.result: Optional[pb.CacheInfo] = None  # the cache as commit or abort left it

    def commit(self, accepted: int) -> pb.CacheInfo:
        """Keeps the first `accepted` drafted tokens of every layer; ends it."""
        self.result = self.client.commit_speculation(self.id, accepted)
        self.released = True
        return self.result

    def abort(self) -> pb.CacheInfo:
        """Drops every drafted token; ends it."""
        self.released = True
        self.result = self.client.abort_speculation(self.id)
        return self.result

    def release(self) -> None:
        """Aborts the speculation unless it has ended."""
        self.released = True
        _release_quietly(self.client.abort_speculation, self.id)
