"""One kvcached cache as an adapter writes it: the handle, one long-lived
Update stream, and the offset every layer will have once all that was
written is acknowledged.

Writes are pipelined: each goes out on the open stream as the model
produces it (the data lane copies it into the kernel before write returns;
gRPC joins it into one message), carrying the layer's expected_offset, so a
write that would land anywhere but where this process thinks is refused
rather than applied twice. flush() ends the stream and checks every
acknowledgement; the adapters call it before anything that depends on the
writes (fetch, trim, snapshot, speculation) and every few steps, so an
error surfaces within a bounded number of steps.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import grpc

from ..client import Client
from ..errors import KvCacheError
from ..fetch import LayerHistory
from ..proto import pb
from ..update_encoding import LayerUpdate


class RemoteCache:
    """A kvcached cache written layer by layer, its acknowledgements checked in flush()."""

    def __init__(self, client: Client, info: pb.CacheInfo, owned: bool = True) -> None:
        """Wraps an existing cache; `owned`: release() deletes it."""
        self.client = client
        self.id: str = info.cache_id
        self.owned = owned
        # Where each layer will be once every write so far is applied.
        self.offsets: List[int] = [int(offset) for offset in info.layer_offsets]
        self.speculation_id = ""
        # Attached to another process's cache: tokens it has already are skipped.
        self.resuming = False
        self._stream: Any = None
        self._expected_acks: List[Tuple[int, int]] = []

    @classmethod
    def create(cls, client: Client, spec: pb.CacheSpec, ttl_seconds: int = 0) -> "RemoteCache":
        """A new, empty cache of `spec`, deleted by release()."""
        return cls(client, client.create_cache(spec, ttl_seconds=ttl_seconds))

    @classmethod
    def attach(cls, client: Client, cache_id: str, owned: bool = True) -> "RemoteCache":
        """An existing cache (another process's, say), its layers where the
        server has them: writes resume from there."""
        cache = cls(client, client.get_cache(cache_id), owned)
        cache.resuming = True
        return cache

    def send(self, layer: int, start: int, keys: Any, values: Any) -> None:
        """Writes tokens [start, start + L) of `layer`. Where the cache was
        attached (resuming), tokens below the layer's offset are there
        already and are skipped; otherwise start must be the layer's offset."""
        tokens = int(keys.shape[2])
        have = self.offsets[layer]
        if start > have or (start < have and not self.resuming):
            raise ValueError("layer %d: tokens from %d, but the cache's layer is at %d"
                             % (layer, start, have))
        skip = have - start
        if skip >= tokens:
            return
        if skip:
            keys, values = keys[:, :, skip:].contiguous(), values[:, :, skip:].contiguous()
        self._write(LayerUpdate(layer, keys, values, expected_offset=have,
                                speculation_id=self.speculation_id))
        self.offsets[layer] = have + tokens - skip
        self._expected_acks.append((layer, self.offsets[layer]))

    def _write(self, update: LayerUpdate) -> None:
        if self._stream is None:
            self._stream = self.client.open_update(self.id)
        try:
            self._stream.write(update)
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        stream, self._stream = self._stream, None
        self._expected_acks = []
        if stream is not None:
            try:
                stream.cancel()
            except Exception:  # noqa: BLE001 - the write's own error is the one to raise
                pass

    def flush(self) -> None:
        """Ends the open stream; raises its first failure, or KvCacheError
        (DATA_LOSS) where an acknowledgement is not the offset expected."""
        stream, self._stream = self._stream, None
        expected, self._expected_acks = self._expected_acks, []
        if stream is None:
            return
        acks = [(ack.layer, int(ack.offset)) for ack in stream.finish()]
        if acks != expected:
            raise KvCacheError(grpc.StatusCode.DATA_LOSS,
                               "cache %s: the Update stream acknowledged %s, expected %s"
                               % (self.id, acks[:8], expected[:8]))

    def fetch_all(self, layers: Sequence[int] = ()) -> Dict[int, LayerHistory]:
        """Every layer's (or these layers') history, after a flush; a
        speculation's view while one is open."""
        self.flush()
        if self.speculation_id:
            return self.client.fetch_layers("", layers, speculation_id=self.speculation_id)
        return self.client.fetch_layers(self.id, layers)

    def refresh_offsets(self) -> pb.CacheInfo:
        """Reads the layers' offsets from the server (after a restore, say)."""
        info = self.client.get_cache(self.id)
        self.offsets = [int(offset) for offset in info.layer_offsets]
        return info

    def trim(self, tokens: int) -> int:
        """Trim: drops the last `tokens` of every layer; how many it dropped."""
        self.flush()
        trimmed = self.client.trim(self.id, tokens)
        self.offsets = [int(offset) for offset in trimmed.cache.layer_offsets]
        return int(trimmed.trimmed)

    def snapshot(self, ttl_seconds: int = 0) -> pb.SnapshotInfo:
        """A snapshot of every layer from 0 (page references, no copy)."""
        self.flush()
        return self.client.snapshot(self.id, ttl_seconds=ttl_seconds)

    def restore(self, snapshot: pb.SnapshotInfo, target: Optional[int] = None) -> None:
        """Replaces every layer with a snapshot's (at its end unless `target`)."""
        self.flush()
        end = int(snapshot.to_offset) if target is None else target
        info = self.client.restore(self.id, end, snapshot_id=snapshot.snapshot_id)
        self.offsets = [int(offset) for offset in info.layer_offsets]

    def begin_speculation(self) -> None:
        """Opens a speculation: sends draft on top of the committed history."""
        self.flush()
        begun = self.client.begin_speculation(self.id)
        self.speculation_id = begun.speculation_id

    def end_speculation(self, accepted: Optional[int]) -> None:
        """Commits the first `accepted` drafted tokens, or aborts (None)."""
        self.flush()
        speculation_id, self.speculation_id = self.speculation_id, ""
        if accepted is None:
            info = self.client.abort_speculation(speculation_id)
        else:
            info = self.client.commit_speculation(speculation_id, accepted)
        self.offsets = [int(offset) for offset in info.layer_offsets]

    def release(self) -> None:
        """Ends the stream and any speculation, then deletes the cache if owned.
        NOT_FOUND (gone already: expired, deleted) counts as released."""
        try:
            self._abandon()
            if self.speculation_id:
                _quietly(self.client.abort_speculation, self.speculation_id)
                self.speculation_id = ""
        finally:
            if self.owned:
                _quietly(self.client.delete_cache, self.id)
                self.owned = False


def _quietly(call: Any, *args: Any) -> None:
    """A release call, taking NOT_FOUND as done already."""
    try:
        call(*args)
    except KvCacheError as error:
        if error.code != grpc.StatusCode.NOT_FOUND:
            raise
