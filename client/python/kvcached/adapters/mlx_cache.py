"""mlx-lm's per-layer caches (KVCache, RotatingKVCache) backed by one kvcached cache.

Each layer cache answers as mlx-lm's would (update_and_fetch, offset,
is_trimmable, trim, state, meta_state) from a local mirror, and streams
every update to its layer of a kvcached cache shared by the whole model
(write-through; remote.py pipelines and checks the acknowledgements):

    cache = make_prompt_cache(client, spec)        # one layer cache per spec layer
    keys, values = cache[0].update_and_fetch(k, v)  # k, v: [B, H, L, D] tensors
    trim_prompt_cache(cache, 3)                     # all layers, then one Trim

A rotating layer returns and reports what mlx-lm's buffer holds, in its ring
order: the sinks, then the slots from the write index `_idx` on, then those
from `keep` to `_idx` (mlx-lm's _temporal_order, inverted). kvcached holds
the same tokens in temporal order, and tracks `_idx` by the same rule.
"""

from typing import Any, List, Optional, Sequence, Set, Tuple

import torch

from ..client import Client
from ..dtypes import DType
from ..proto import pb
from .. import specs
from .layer_state import LayerKind, LayerState, appended, cut
from .model_specs import check_update, layer_kinds
from .remote import RemoteCache
from .transformers_cache import torch_dtype

# mlx-lm make_prompt_cache: rotating layers keep 4 attention sinks.
DEFAULT_KEEP = 4


class MlxBacking:
    """The kvcached cache that every layer cache of one model writes to."""

    def __init__(self, client: Client, spec: pb.CacheSpec, ttl_seconds: int = 0,
                 ack_every_steps: int = 8) -> None:
        """spec: the model's layers and dtype; the batch size follows the first update."""
        self.client = client
        self.spec = spec
        self.kinds = layer_kinds(spec)
        self.torch_dtype = torch_dtype(DType(spec.dtype))
        self.ttl_seconds = ttl_seconds
        self.ack_every_steps = ack_every_steps
        self.remote: Optional[RemoteCache] = None
        self.layers: List["KvcachedKVCache"] = []
        self._step_layers: Set[int] = set()
        self._steps = 0

    def send(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Streams one layer's update; its first creates the cache for this batch size."""
        if self.remote is None:
            spec = pb.CacheSpec()
            spec.CopyFrom(self.spec)
            spec.batch_size = int(keys.shape[0])
            self.remote = RemoteCache.create(self.client, spec, self.ttl_seconds)
        if self.remote.offsets[layer] != start:
            raise ValueError("layer %d is at %d here but %d in kvcached: trim every layer by "
                             "the same count (trim_prompt_cache)"
                             % (layer, start, self.remote.offsets[layer]))
        self._note_step(layer)
        self.remote.send(layer, start, keys, values)

    def _note_step(self, layer: int) -> None:
        """Every few steps (a layer updated again) the acknowledgements are checked."""
        if layer in self._step_layers:
            self._step_layers = set()
            self._steps += 1
            if self.ack_every_steps and self._steps % self.ack_every_steps == 0:
                self.flush()
        self._step_layers.add(layer)

    def trim_to_layers(self) -> None:
        """After layers were trimmed: one Trim once every layer is at the same
        offset below kvcached's (mlx-lm trims layer by layer)."""
        offsets = {layer.offset for layer in self.layers}
        if self.remote is None or len(offsets) != 1:
            return
        target = offsets.pop()
        ahead = max(self.remote.offsets) - target
        if ahead > 0 and len(set(self.remote.offsets)) == 1:
            self.remote.trim(ahead)
            self._step_layers = set()

    def flush(self) -> None:
        """Waits for every update to be acknowledged (raises their failure)."""
        if self.remote is not None:
            self.remote.flush()

    def cache_id(self) -> str:
        """The kvcached cache's id ("" before the first update)."""
        return self.remote.id if self.remote is not None else ""

    def close(self) -> None:
        """Deletes the kvcached cache."""
        remote, self.remote = self.remote, None
        if remote is not None:
            remote.release()


class KvcachedKVCache:
    """mlx-lm KVCache: every token, [B, H, offset, D]."""

    def __init__(self, backing: MlxBacking, layer: int) -> None:
        """Layer `layer` of the backing's cache (a standard layer)."""
        self.backing = backing
        self.layer = layer
        self.kind: LayerKind = backing.kinds[layer]
        self._state: Optional[LayerState] = None
        # [B, H, 0, D] of the first update's shapes: mlx-lm keeps its buffer
        # when trimmed to nothing, so its state is then empty, not None.
        self._empty: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        backing.layers.append(self)

    @property
    def offset(self) -> int:
        """Tokens seen: the next token's position."""
        return self._state.offset if self._state is not None else 0

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Appends keys/values [B, H, L, D] (cast to the cache's dtype); returns
        what mlx-lm returns: every token's keys and values."""
        check_update(self.backing.spec, self.layer, keys, values)
        # Copied even where no cast is needed: the mirror keeps these tensors.
        keys = keys.detach().to(self.backing.torch_dtype, copy=True).contiguous()
        values = values.detach().to(self.backing.torch_dtype, copy=True).contiguous()
        self.backing.send(self.layer, self.offset, keys, values)
        if self._empty is None:
            self._empty = (keys[:, :, :0], values[:, :, :0])
        self._advance(int(keys.shape[2]))
        self._state = appended(self.kind, self._state, keys, values)
        return self._returned()

    def _advance(self, tokens: int) -> None:
        """Bookkeeping of an update of `tokens` before it is stored (none here)."""

    def _returned(self) -> Tuple[torch.Tensor, torch.Tensor]:
        assert self._state is not None
        return self._state.keys, self._state.values

    @property
    def state(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(keys, values) as mlx-lm's `state` gives them; (None, None) before
        the first update."""
        if self._state is None:
            return self._empty if self._empty is not None else (None, None)
        return self._returned()

    @property
    def meta_state(self) -> Any:
        """mlx-lm's meta_state: "" for a KVCache."""
        return ""

    def is_trimmable(self) -> bool:
        """mlx-lm is_trimmable."""
        return self.kind.trimmable(self.offset)

    def trim(self, n: int) -> int:
        """Drops the last min(n, offset) tokens; how many (mlx-lm trim). kvcached
        is trimmed once every layer has been (trim_prompt_cache trims all)."""
        n = min(self.offset, max(0, n))
        self._state = cut(self.kind, self._state, n)
        self.backing.trim_to_layers()
        return n

    def empty(self) -> bool:
        """Whether nothing was ever stored (mlx-lm: keys is None)."""
        return self._empty is None

    def size(self) -> int:
        """mlx-lm size(): the offset."""
        return self.offset

    def positions(self) -> torch.Tensor:
        """Absolute positions of the held tokens, in temporal order."""
        if self._state is None:
            return torch.empty(0, dtype=torch.long)
        return self._state.positions


class KvcachedRotatingKVCache(KvcachedKVCache):
    """mlx-lm RotatingKVCache: `keep` sinks and a window, max_size in all."""

    def __init__(self, backing: MlxBacking, layer: int) -> None:
        """Layer `layer` of the backing's cache (a rotating layer)."""
        super().__init__(backing, layer)
        if not self.kind.rotating:
            raise ValueError("layer %d is not rotating" % layer)
        self._idx = 0

    @property
    def max_size(self) -> int:
        """The most tokens a single-token update leaves held."""
        return self.kind.max_size

    @property
    def keep(self) -> int:
        """Attention sinks: the first tokens, never evicted."""
        return self.kind.keep

    def _advance(self, tokens: int) -> None:
        """mlx-lm's `_idx` after an update of `tokens` (rotating_layer.cc
        PlanEviction), from what is held before it. update_and_fetch then
        returns mlx-lm's buffer in its ring order."""
        held = self._state.held if self._state is not None else 0
        if tokens > 1:  # _update_concat: temporal order, max_size - 1 old tokens kept
            self._idx = held - max(0, held + 1 - self.max_size) + tokens
        elif held < self.max_size:
            self._idx = self.offset + 1
        else:
            idx = self.max_size if held > self.max_size else self._idx
            self._idx = (self.keep if idx == self.max_size else idx) + 1

    def _returned(self) -> Tuple[torch.Tensor, torch.Tensor]:
        assert self._state is not None
        return (ring_order(self._state.keys, self._idx, self.keep, self.offset),
                ring_order(self._state.values, self._idx, self.keep, self.offset))

    @property
    def meta_state(self) -> Tuple[str, ...]:
        """(keep, max_size, offset, _idx) as strings, as mlx-lm has it."""
        return tuple(str(value) for value in (self.keep, self.max_size, self.offset, self._idx))

    def trim(self, n: int) -> int:
        """mlx-lm trim: offset and _idx back by min(n, offset); only while the
        window has not filled (is_trimmable), ValueError after."""
        n = min(self.offset, max(0, n))
        trimmed = super().trim(n)
        self._idx -= trimmed
        return trimmed

    def size(self) -> int:
        """mlx-lm size(): min(offset, max_size)."""
        return min(self.offset, self.max_size)


def ring_order(temporal: torch.Tensor, idx: int, keep: int, offset: int) -> torch.Tensor:
    """A rotating buffer's tokens in mlx-lm's ring order, from temporal order.

    mlx-lm's _temporal_order reads a ring buffer v of L slots as
    v[:keep] + v[idx:] + v[keep:idx] once it has wrapped (idx < offset), so
    v = T[:keep] + T[keep + (L - idx):] + T[keep:keep + (L - idx)]."""
    slots = int(temporal.shape[2])
    if idx >= slots or idx >= offset:
        return temporal
    tail = slots - idx
    return torch.cat([temporal[:, :, :keep], temporal[:, :, keep + tail:],
                      temporal[:, :, keep:keep + tail]], dim=2)


class KvcachedPromptCache(list):
    """The layer caches of one model (a list, as mlx-lm's prompt cache is),
    and the kvcached cache behind them: close() (or `with`) deletes it."""

    def __init__(self, backing: MlxBacking, layers: Sequence[KvcachedKVCache]) -> None:
        """The backing and its layer caches, in layer order."""
        super().__init__(layers)
        self.backing = backing

    def close(self) -> None:
        """Deletes the kvcached cache behind the layers."""
        self.backing.close()

    def __enter__(self) -> "KvcachedPromptCache":
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never hide the error already on its way out
            if exc is None:
                raise


def prompt_cache_spec(num_layers: int, heads: int, head_dim: int,
                      dtype: DType = DType.FLOAT16, max_kv_size: Optional[int] = None,
                      keep: int = DEFAULT_KEEP, model: str = "") -> pb.CacheSpec:
    """mlx-lm make_prompt_cache's layout: every layer a KVCache, or with
    max_kv_size every layer a RotatingKVCache(max_kv_size, keep=4)."""
    if max_kv_size is None:
        layer = specs.standard(heads, head_dim)
    else:
        layer = specs.rotating(heads, head_dim, max_size=max_kv_size, keep=keep)
    return specs.cache_spec([layer] * num_layers, dtype=dtype, model=model)


def make_prompt_cache(client: Client, spec: pb.CacheSpec, ttl_seconds: int = 0,
                      ack_every_steps: int = 8) -> KvcachedPromptCache:
    """One mlx-lm-style cache per layer of `spec` (standard: KVCache, rotating:
    RotatingKVCache), all backed by one kvcached cache made at the first update."""
    backing = MlxBacking(client, spec, ttl_seconds, ack_every_steps)
    layers = [KvcachedRotatingKVCache(backing, index) if kind.rotating
              else KvcachedKVCache(backing, index) for index, kind in enumerate(backing.kinds)]
    return KvcachedPromptCache(backing, layers)


def can_trim_prompt_cache(cache: Sequence[KvcachedKVCache]) -> bool:
    """mlx-lm can_trim_prompt_cache: every layer trimmable."""
    return all(layer.is_trimmable() for layer in cache)


def trim_prompt_cache(cache: Sequence[KvcachedKVCache], num_tokens: int) -> int:
    """mlx-lm trim_prompt_cache: trims every layer (0 where one cannot be)."""
    if not can_trim_prompt_cache(cache) or len(cache) == 0:
        return 0
    return [layer.trim(num_tokens) for layer in cache][0]
