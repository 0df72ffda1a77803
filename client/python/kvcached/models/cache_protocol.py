"""The cache contract the models of this package call, and the per-layer
layout a cache must follow for a model.

A model calls three methods of its cache (ModelCache), and nothing else:

    keys, values = cache.update(k, v, layer_idx)     # k, v: [B, H_kv, L, D] f32, RoPE applied
    positions = cache.key_positions(layer_idx)       # LongTensor [T]: those keys' positions
    start = cache.get_seq_length(0)                  # where this step's queries begin

Generation (generate.py) also calls `crop` (speculative decoding) and
`reorder_cache` (beam search): KVCache is ModelCache with those two.
LocalCache (local_cache.py) is the plain reference; kvcached-backed caches
implement exactly the same surface, so a model run against either sees the
same attention inputs.

Why positions, not just tensors: a cache may return a superset of the keys a
step needs (mlx-lm's rotating cache returns the kept sinks, up to
max_size - 1 earlier tokens and all L new ones on a multi-token update). The
model first selects, by position, exactly the keys some query of the step may
attend (see attention.py), then masks per query. Two caches that both return
a superset of the needed keys therefore give bit-identical attention inputs,
and so torch.equal logits.

Sliding-window layers (LayerCacheSpec.window set): a query at position q
attends key k when k <= q and (q - k < window or k < keep): the `keep` first
tokens are attention sinks, never evicted. A rotating cache (mlx-lm
RotatingKVCache semantics: sinks kept, the write index returns to `keep` on
wrap) holds `keep` sinks and its max_size - keep most recent tokens, so it
must be made with max_size = window + keep to hold every key that mask
allows (`LayerCacheSpec.max_size`). With keep = 0 that is mlx-lm's
max_size = window.
"""

import dataclasses
from typing import Any, Dict, Optional, Protocol, Tuple, runtime_checkable

import torch


@dataclasses.dataclass(frozen=True)
class LayerCacheSpec:
    """What one layer of a model needs from its cache.

    window: None for a full-attention layer (keep everything); for a
    sliding-window layer, how far back a query attends (q - k < window).
    keep: the attention sinks of a sliding-window layer (its first `keep`
    tokens, always attended and never evicted); 0 for full layers.
    """

    window: Optional[int] = None
    keep: int = 0

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError("LayerCacheSpec.window must be >= 1, got %d" % self.window)
        if self.keep < 0:
            raise ValueError("LayerCacheSpec.keep must be >= 0, got %d" % self.keep)
        if self.window is None and self.keep != 0:
            raise ValueError("LayerCacheSpec.keep is for sliding-window layers (window set)")

    @property
    def sliding(self) -> bool:
        """Whether this layer attends a window (a rotating cache may hold it)."""
        return self.window is not None

    @property
    def max_size(self) -> Optional[int]:
        """The rotating cache size (mlx-lm max_size) that holds every key the
        layer's mask allows: window + keep; None for full layers."""
        return None if self.window is None else self.window + self.keep


@runtime_checkable
class ModelCache(Protocol):
    """The three methods a model's forward calls (KVCache adds what
    generation calls).

    Every layer keeps its own offset; a model updates each layer once per
    forward with the same L, so they stay equal. Rows of the batch share
    offsets (no per-row padding).
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: Optional[Dict[str, Any]] = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Appends L new tokens to layer `layer_idx` and returns what to attend over.

        key_states, value_states: [B, H_kv, L, D] float32 (contiguous: the
        model makes them so), RoPE already applied to the keys, for
        positions get_seq_length(layer_idx) .. + L - 1. Returns (keys,
        values), [B, H_kv, T, D] in temporal order, in the cache's storage
        dtype (float32, float16 or bfloat16; the model casts to float32
        itself). The new tokens are returned as stored, so
        the model attends over the cache's rounded copies, never its own
        float32 originals. T may exceed what the layer's mask needs (a
        rotating layer returns sinks + up to max_size - 1 earlier tokens +
        all L new ones); it must hold every key some query of this update
        may attend. cache_kwargs is accepted for transformers' signature and
        may be ignored. The returned tensors may be views of the cache's
        storage: valid until the next call that changes this layer.
        """
        ...

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        """The absolute positions (LongTensor [T], increasing) of the keys the
        last update of layer `layer_idx` returned, one per returned key."""
        ...

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The tokens layer `layer_idx` has seen (its offset): the position
        the next update's first token takes. 0 for a layer never updated."""
        ...



@runtime_checkable
class KVCache(ModelCache, Protocol):
    """A per-model KV cache as this package's models and generation call it:
    ModelCache, plus crop (speculative decoding) and reorder_cache (beams)."""

    def crop(self, max_length: int) -> None:
        """Keeps the first `max_length` tokens of every layer (negative: drops
        that many from the end), as transformers' DynamicCache.crop. Raises
        ValueError where a layer cannot rewind (a rotating layer that has
        filled its window)."""
        ...

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Row i of every layer becomes old row beam_idx[i] (index_select
        along the batch; beam_idx may be longer than the batch, to fan a
        prompt out into beams)."""
        ...
