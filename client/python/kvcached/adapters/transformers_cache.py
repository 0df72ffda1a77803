"""KvcachedCache: a transformers-style KV cache whose K/V live in kvcached.

It follows kvcached.models.cache_protocol.KVCache (update, key_positions,
get_seq_length, crop, reorder_cache), so a model runs on it exactly as on
LocalCache. Each batch row is a kvcached cache of its own, so beams branch
by Snapshot/Restore and share pages:

    row 0 ──> cache A          reorder_cache([0, 0, 1]):  snapshot A, B;
    row 1 ──> cache B                                     restore A's into B and
                                                          into a new C; rows A, B, C

Two modes:
- "write_through": a local mirror answers update() as LocalCache would; each
  update is also streamed to kvcached (pipelined on one Update stream per
  row, acknowledgements checked by flush() before anything that depends on
  them and every `ack_every_steps` steps), so kvcached holds the durable,
  shareable copy.
- "authoritative": no K/V is kept between steps. At a step's first update
  the cache fetches every layer's history once; each layer then attends over
  that history plus the step's own rounded tokens (evicted as kvcached
  evicts them), which is what kvcached holds after the step's Update.

Inputs are cast to the cache's dtype (f32, f16, bf16) before they are sent
or returned, so both sides hold the same rounded bytes.
"""

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..client import Client
from ..dtypes import DType, as_torch
from ..fetch import LayerHistory
from ..proto import pb
from .layer_state import LayerKind, LayerState, appended, cut, positions_of, rows
from .model_specs import check_update, layer_kinds, one_row
from .remote import RemoteCache, _quietly

WRITE_THROUGH = "write_through"
AUTHORITATIVE = "authoritative"

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16,
                DType.BFLOAT16: torch.bfloat16}


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype a kvcached DType is stored as (bf16: torch.bfloat16)."""
    try:
        return TORCH_DTYPES[DType(dtype)]
    except (KeyError, ValueError):
        raise ValueError("a cache needs dtype f32, f16 or bf16, not %r" % (dtype,)) from None


def history_state(histories: Sequence[LayerHistory], offset: int) -> Optional[LayerState]:
    """One layer's fetched histories (one per row) as a LayerState, rows stacked."""
    if offset == 0 or not histories[0].ranges:
        return None
    keys = torch.cat([as_torch(h.keys, h.dtype) for h in histories], dim=0)
    values = torch.cat([as_torch(h.values, h.dtype) for h in histories], dim=0)
    return LayerState(keys, values, positions_of(histories[0].ranges), offset)


class KvcachedCache:
    """A model's KV cache held in kvcached: one kvcached cache per batch row."""

    def __init__(self, client: Client, spec: pb.CacheSpec, *, mode: str = WRITE_THROUGH,
                 ttl_seconds: int = 0, ack_every_steps: int = 8) -> None:
        """spec: the layers and dtype (model_specs builds it from a model's
        config); its batch size is ignored, rows follow the first update.
        ttl_seconds: the lease of each kvcached cache (0: the server's default)."""
        if mode not in (WRITE_THROUGH, AUTHORITATIVE):
            raise ValueError("mode must be %r or %r, not %r" % (WRITE_THROUGH, AUTHORITATIVE,
                                                                 mode))
        self.client = client
        self.spec = one_row(spec)
        self.kinds: List[LayerKind] = layer_kinds(spec)
        self.dtype = DType(spec.dtype)
        self.torch_dtype = torch_dtype(self.dtype)
        self.mode = mode
        self.ttl_seconds = ttl_seconds
        self.ack_every_steps = ack_every_steps
        self.rows: List[RemoteCache] = []
        layers = len(self.kinds)
        self._offsets = [0] * layers
        # write_through: the mirror; authoritative: this step's fetched view.
        self._states: List[Optional[LayerState]] = [None] * layers
        self._view_loaded = False
        self._positions = [torch.empty(0, dtype=torch.long)] * layers
        self._step_layers: Set[int] = set()
        self._steps = 0
        # While speculating: the committed states and each layer's drafted tokens.
        self._committed: Optional[List[Optional[LayerState]]] = None
        self._committed_offsets: List[int] = []
        self._drafts: List[List[Tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(layers)]

    @classmethod
    def attach(cls, client: Client, spec: pb.CacheSpec, cache_ids: Sequence[str], *,
               ttl_seconds: int = 0, ack_every_steps: int = 8) -> "KvcachedCache":
        """A write-through cache over existing kvcached caches (one per row),
        for a worker taking over another's: the model runs from position 0 and
        each layer's update sends only the tokens beyond that layer's offset on
        the server (expected_offset set), so a half-written step completes."""
        cache = cls(client, spec, mode=WRITE_THROUGH, ttl_seconds=ttl_seconds,
                    ack_every_steps=ack_every_steps)
        cache.rows = [RemoteCache.attach(client, cache_id) for cache_id in cache_ids]
        return cache

    # The cache protocol.

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: Optional[Dict[str, Any]] = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Appends L tokens [B, H, L, D] to a layer; returns (keys, values) to
        attend over, [B, H, T, D] in temporal order in the cache's dtype."""
        del cache_kwargs  # transformers' signature; nothing here reads it
        check_update(self.spec, layer_idx, key_states, value_states)
        self._note_step(layer_idx)
        # Copied even where no cast is needed: the mirror keeps these tensors,
        # and the caller may reuse its own.
        keys = key_states.detach().to(self.torch_dtype, copy=True).contiguous()
        values = value_states.detach().to(self.torch_dtype, copy=True).contiguous()
        if self.mode == AUTHORITATIVE and not self._view_loaded:
            self._states = self._fetch_states()  # before this update is sent
            self._view_loaded = True
        self._send(layer_idx, keys, values)
        state = self._next_state(layer_idx, keys, values)
        self._offsets[layer_idx] = state.offset
        self._positions[layer_idx] = state.positions
        return state.keys, state.values

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        """Absolute positions [T] of the keys the layer's last update returned."""
        return self._positions[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The tokens the layer has seen (the next token's position)."""
        return self._offsets[layer_idx]

    def crop(self, max_length: int) -> None:
        """Keeps the first max_length tokens (negative: drops that many), by
        Trim; ValueError where a rotating layer's window has filled."""
        length = max(self._offsets)
        if max_length < 0:
            max_length = length - abs(max_length)
        if length <= max_length:
            return
        self._refuse_while_speculating("crop")
        tokens = length - max(0, max_length)
        for kind, offset in zip(self.kinds, self._offsets):
            if not kind.trimmable(offset):
                raise ValueError("crop: a rotating layer's window has filled (offset %d, "
                                 "max_size %d); it cannot be cut back" % (offset, kind.max_size))
        for row in self.rows:
            trimmed = row.trim(tokens)
            if trimmed != tokens:
                raise ValueError("crop: kvcached trimmed %d tokens, not %d" % (trimmed, tokens))
        if self.mode == WRITE_THROUGH:
            self._states = [cut(kind, state, tokens) for kind, state in zip(self.kinds,
                                                                            self._states)]
        self._offsets = [max(0, offset - tokens) for offset in self._offsets]
        self._new_step()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Row i becomes old row beam_idx[i] (beam_idx may be longer than the
        batch): each row's kvcached cache is restored from a snapshot of its
        source row's, sharing its pages."""
        self._refuse_while_speculating("reorder_cache")
        index = beam_idx.to(device="cpu", dtype=torch.long)
        sources = [int(source) for source in index.tolist()]
        if self.rows:
            self._reorder_rows(sources)
        if self.mode == WRITE_THROUGH:
            self._states = [rows(state, index) for state in self._states]
        self._new_step()

    # Beyond the protocol: speculation, flushing, closing.

    def begin_speculation(self) -> None:
        """Drafts from here on: updates go to a kvcached speculation of each
        row until commit_speculation or abort_speculation."""
        self._refuse_while_speculating("begin_speculation")
        for row in self.rows:
            row.begin_speculation()
        self._committed = list(self._states)
        self._committed_offsets = list(self._offsets)
        self._drafts = [[] for _ in self.kinds]
        self._new_step()

    def commit_speculation(self, accepted: int) -> None:
        """Keeps the first `accepted` drafted tokens of every layer."""
        self._end_speculation(accepted)

    def abort_speculation(self) -> None:
        """Drops every drafted token."""
        self._end_speculation(None)

    @property
    def speculating(self) -> bool:
        """Whether a speculation is open."""
        return self._committed is not None

    def flush(self) -> None:
        """Waits for every row's writes to be acknowledged (raises their failure)."""
        for row in self.rows:
            row.flush()

    def cache_ids(self) -> List[str]:
        """The kvcached cache of each row, in row order."""
        return [row.id for row in self.rows]

    def ensure_rows(self, batch: int) -> List[RemoteCache]:
        """The rows' kvcached caches, created (empty) for a batch of `batch`
        where there are none yet."""
        if not self.rows:
            self.rows = [RemoteCache.create(self.client, self.spec, self.ttl_seconds)
                         for _ in range(batch)]
        elif len(self.rows) != batch:
            raise ValueError("a batch of %d rows on a cache of %d (reorder_cache changes it)"
                             % (batch, len(self.rows)))
        return self.rows

    def load_restored(self) -> None:
        """Takes the rows' caches as the server holds them now (after a Restore
        by hand, e.g. of a prefix): offsets re-read, the mirror fetched."""
        self._refuse_while_speculating("load_restored")
        offsets = [row.refresh_offsets() for row in self.rows][0].layer_offsets
        self._offsets = [int(offset) for offset in offsets]
        self._view_loaded = False
        if self.mode == WRITE_THROUGH:
            self._states = self._fetch_states()
        self._new_step()

    def close(self) -> None:
        """Releases every handle: open speculations, then each row's cache."""
        rows_, self.rows = self.rows, []
        failure: Optional[BaseException] = None
        for row in rows_:
            try:
                row.release()
            except BaseException as error:  # noqa: BLE001 - release the rest first
                failure = failure or error
        self._committed = None
        if failure is not None:
            raise failure

    def __enter__(self) -> "KvcachedCache":
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never hide the error already on its way out
            if exc is None:
                raise

    # Steps, sends and states.

    def _note_step(self, layer: int) -> None:
        """A layer updated twice starts a new step: the authoritative view is
        fetched again, and every few steps the writes' acks are checked."""
        if layer in self._step_layers:
            self._steps += 1
            self._new_step()
            if self.ack_every_steps and self._steps % self.ack_every_steps == 0:
                self.flush()
        self._step_layers.add(layer)

    def _new_step(self) -> None:
        self._step_layers = set()
        self._view_loaded = False

    def _send(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Each row's tokens to its cache (batch slices of a contiguous tensor
        are contiguous: sent from the tensor's own memory)."""
        start = self._offsets[layer]
        for index, row in enumerate(self.ensure_rows(int(keys.shape[0]))):
            row.send(layer, start, keys[index:index + 1], values[index:index + 1])

    def _next_state(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> LayerState:
        kind = self.kinds[layer]
        if self.mode == AUTHORITATIVE:
            prior, self._states[layer] = self._states[layer], None
            return appended(kind, prior, keys, values)
        if self._committed is None:
            self._states[layer] = appended(kind, self._states[layer], keys, values)
            return self._states[layer]
        # Drafting: the view is the committed state plus every draft as one
        # update, as kvcached's speculation view is.
        self._drafts[layer].append((keys, values))
        self._states[layer] = self._drafted(layer, None)
        return self._states[layer]

    def _drafted(self, layer: int, accepted: Optional[int]) -> Optional[LayerState]:
        """The committed state plus the first `accepted` drafted tokens (all: None)."""
        committed = self._committed[layer] if self._committed is not None else None
        drafts = self._drafts[layer]
        if not drafts or accepted == 0:
            return committed
        keys = torch.cat([k for k, _ in drafts], dim=2)[:, :, :accepted]
        values = torch.cat([v for _, v in drafts], dim=2)[:, :, :accepted]
        return appended(self.kinds[layer], committed, keys, values)

    def _fetch_states(self) -> List[Optional[LayerState]]:
        """Every layer as the rows' caches hold it now (one Fetch per row)."""
        if not self.rows or not any(self._offsets):
            return [None] * len(self.kinds)
        fetched = [row.fetch_all() for row in self.rows]
        return [history_state([histories[layer] for histories in fetched], offset)
                if layer in fetched[0] else None
                for layer, offset in enumerate(self._offsets)]

    def _end_speculation(self, accepted: Optional[int]) -> None:
        if self._committed is None:
            raise ValueError("no speculation is open")
        for row in self.rows:
            row.end_speculation(accepted)
        if self.mode == WRITE_THROUGH:
            self._states = [self._drafted(layer, accepted) if accepted else committed
                            for layer, committed in enumerate(self._committed)]
        self._offsets = [offset + (accepted or 0) for offset in self._committed_offsets]
        self._committed = None
        self._drafts = [[] for _ in self.kinds]
        self._new_step()

    def _refuse_while_speculating(self, what: str) -> None:
        if self._committed is not None:
            raise ValueError("%s while a speculation is open: commit or abort it first" % what)

    def _reorder_rows(self, sources: List[int]) -> None:
        """Row j's cache becomes a copy (by page reference) of row sources[j]'s."""
        self.flush()
        old = self.rows
        if any(source >= len(old) or source < 0 for source in sources):
            raise IndexError("beam_idx %s names rows beyond %d" % (sources, len(old)))
        moved = {source for row, source in enumerate(sources) if row >= len(old) or source != row}
        snapshots = {source: old[source].snapshot() for source in moved if any(old[source].offsets)}
        added: List[RemoteCache] = []  # new rows' caches, released if this fails
        try:
            for row in range(len(old), len(sources)):
                added.append(RemoteCache.create(self.client, self.spec, self.ttl_seconds))
            new = old[:len(sources)] + added
            for row, source in enumerate(sources):
                if source in snapshots and (row >= len(old) or source != row):
                    new[row].restore(snapshots[source])
        except BaseException:
            for row_cache in added:
                row_cache.release()
            raise
        finally:
            for snapshot in snapshots.values():
                _quietly(self.client.release_snapshot, snapshot.snapshot_id)
        self.rows = new
        for extra in old[len(sources):]:
            extra.release()
