"""LocalCache: the plain in-process KV cache the models run against, the
reference every kvcached-backed cache is compared with.

Per layer, one of two kinds (cache_protocol.LayerCacheSpec decides):

- StandardLayerCache (transformers DynamicLayer, mlx-lm KVCache): every
  token, in one growing buffer.
- RotatingLayerCache (mlx-lm RotatingKVCache, ported rule for rule): at most
  max_size tokens, the first `keep` of them sinks never evicted, a ring whose
  write index returns to `keep` on wrap. Updates are returned in temporal
  order (mlx-lm returns the ring as it lies; its attention is order-blind,
  ours selects by position).

Tensors are stored in the cache's dtype (float32, float16 or bfloat16): an
update casts the model's float32 keys and values, and returns the stored
copies, so rounding happens here and only here.
"""

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .cache_protocol import LayerCacheSpec

if TYPE_CHECKING:  # only for the hint: llama imports nothing from here
    from .llama import LlamaConfig

STORAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Buffers grow by this many tokens (mlx-lm's step), so a decode step appends
# in place instead of copying the whole history.
GROWTH_STEP = 256


def _check_states(key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Raises ValueError unless keys and values are [B, H, L, D] alike, L >= 1."""
    if key_states.dim() != 4 or value_states.dim() != 4:
        raise ValueError("key_states and value_states must be [B, H, L, D], got %s and %s"
                         % (tuple(key_states.shape), tuple(value_states.shape)))
    if key_states.shape[:3] != value_states.shape[:3]:
        raise ValueError("key_states %s and value_states %s differ in [B, H, L]"
                         % (tuple(key_states.shape), tuple(value_states.shape)))
    if key_states.shape[2] < 1:
        raise ValueError("an update needs at least one token (L = 0)")
    if not key_states.is_floating_point() or not value_states.is_floating_point():
        raise ValueError("key_states and value_states must be floating point")


def _check_matches(held: Optional[torch.Tensor], new: torch.Tensor, what: str) -> None:
    """Raises ValueError when `new` cannot be appended to `held` (B, H or D differ)."""
    if held is None:
        return
    if held.shape[0] != new.shape[0] or held.shape[1] != new.shape[1] or \
            held.shape[3] != new.shape[3]:
        raise ValueError("%s %s do not match the layer's [B, H, *, D] %s"
                         % (what, tuple(new.shape), tuple(held.shape)))


class StandardLayerCache:
    """Every token of one layer, in temporal order, in one buffer that grows
    by GROWTH_STEP tokens (the returned tensors are views of it)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.offset = 0
        self._keys: Optional[torch.Tensor] = None   # [B, H, capacity, D]
        self._values: Optional[torch.Tensor] = None

    def update(self, key_states: torch.Tensor,
               value_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Appends [B, H, L, D] keys and values; returns all tokens, [B, H, T, D]."""
        _check_states(key_states, value_states)
        _check_matches(self._keys, key_states, "key_states")
        _check_matches(self._values, value_states, "value_states")
        end = self.offset + key_states.shape[2]
        self._reserve(key_states, value_states, end)
        self._keys[:, :, self.offset:end] = key_states
        self._values[:, :, self.offset:end] = value_states
        self.offset = end
        return self.keys_values()

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> None:
        """Grows the buffers to hold `end` tokens (a whole step more, so the
        next decode steps copy nothing)."""
        capacity = 0 if self._keys is None else self._keys.shape[2]
        if end <= capacity:
            return
        capacity = (end + GROWTH_STEP - 1) // GROWTH_STEP * GROWTH_STEP
        self._keys = self._grown(self._keys, key_states, capacity)
        self._values = self._grown(self._values, value_states, capacity)

    def _grown(self, held: Optional[torch.Tensor], like: torch.Tensor,
               capacity: int) -> torch.Tensor:
        batch, heads, _, dim = like.shape
        grown = torch.zeros((batch, heads, capacity, dim), dtype=self.dtype)
        if held is not None:
            grown[:, :, :self.offset] = held[:, :, :self.offset]
        return grown

    def keys_values(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """What the layer holds, [B, H, offset, D] in temporal order (views)."""
        if self._keys is None:
            raise ValueError("the layer holds nothing yet")
        return self._keys[:, :, :self.offset], self._values[:, :, :self.offset]

    @property
    def state(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) as mlx-lm KVCache's state: the first offset tokens."""
        return self.keys_values()

    def positions(self) -> torch.Tensor:
        """The positions of keys_values(): 0 .. offset - 1."""
        return torch.arange(self.offset, dtype=torch.long)

    def crop(self, max_length: int) -> None:
        """Keeps the first max_length tokens (the buffer stays, past them unused)."""
        self.offset = min(self.offset, max(0, max_length))

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Row i becomes old row beam_idx[i]."""
        if self._keys is not None:
            self._keys = self._keys.index_select(0, beam_idx)
            self._values = self._values.index_select(0, beam_idx)

    @property
    def batch_size(self) -> Optional[int]:
        """Rows held, or None before the first update."""
        return None if self._keys is None else self._keys.shape[0]


def _ranges(v: torch.Tensor, axis: int, ranges: Sequence[Tuple[int, Optional[int]]],
            append: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Concatenates v[start:end] along `axis` for each range (end None: to
    the end), then `append`: mlx-lm's slicing and concatenation."""
    size = v.shape[axis]
    pieces = []
    for start, end in ranges:
        end = size if end is None else min(end, size)
        start = min(start, size)
        pieces.append(v.narrow(axis, start, end - start))
    if append is not None:
        pieces.append(append)
    return torch.cat(pieces, dim=axis)


class RotatingLayerCache:
    """mlx-lm RotatingKVCache for one layer: `keep` sinks and a ring of the
    most recent tokens, max_size in all once a single-token update runs.

    The buffer lies in ring order:

        slot   0 .. keep-1 | keep ........ _idx-1 | _idx ....... max_size-1
               [ sinks     ][ newest tokens      ][ oldest non-sinks      ]

    A single-token update writes at _idx (which returns to keep at the end:
    the oldest non-sink is overwritten); a multi-token update puts the buffer
    in temporal order, keeps max_size - 1 of it (sinks first) so every new
    token sees a full window, and appends all L. A positions tensor rides
    along through the same slicing, so each slot's position is known.
    """

    def __init__(self, max_size: int, keep: int = 0, dtype: torch.dtype = torch.float32) -> None:
        if max_size < 1 or keep < 0 or keep >= max_size:
            raise ValueError("a rotating layer needs 0 <= keep < max_size, got keep %d, "
                             "max_size %d" % (keep, max_size))
        self.max_size = max_size
        self.keep = keep
        self.dtype = dtype
        self.offset = 0
        self._idx = 0
        # keys, values [B, H, slots, D] and positions [slots], in ring order.
        self._keys: Optional[torch.Tensor] = None
        self._values: Optional[torch.Tensor] = None
        self._positions: Optional[torch.Tensor] = None

    def update(self, key_states: torch.Tensor,
               value_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Appends [B, H, L, D]; returns what mlx-lm returns, in temporal order."""
        _check_states(key_states, value_states)
        _check_matches(self._keys, key_states, "key_states")
        _check_matches(self._values, value_states, "value_states")
        # A copy even where no cast is needed: the first update's tensors
        # become the ring, which later updates write into.
        key_states = key_states.to(self.dtype, copy=True)
        value_states = value_states.to(self.dtype, copy=True)
        new_positions = torch.arange(self.offset, self.offset + key_states.shape[2])
        if key_states.shape[2] == 1:
            self._update_in_place(key_states, value_states, new_positions)
        else:
            self._update_concat(key_states, value_states, new_positions)
        return self.keys_values()

    def _apply(self, function: Any) -> None:
        """Applies function(tensor, axis) to keys, values and positions alike."""
        self._keys = function(self._keys, 2)
        self._values = function(self._values, 2)
        self._positions = function(self._positions, 0)

    def _temporal_order(self, v: torch.Tensor, axis: int) -> torch.Tensor:
        """mlx-lm _temporal_order: sinks, then the ring from _idx, then up to _idx."""
        if self._idx == v.shape[axis]:
            return v
        if self._idx < self.offset:
            return _ranges(v, axis, [(0, self.keep), (self._idx, None), (self.keep, self._idx)])
        return v.narrow(axis, 0, self._idx)

    def _trim(self, trim_size: int, v: torch.Tensor, axis: int,
              append: Optional[torch.Tensor] = None) -> torch.Tensor:
        """mlx-lm _trim: drops the trim_size oldest non-sinks, then appends."""
        if trim_size > 0:
            return _ranges(v, axis, [(0, self.keep), (trim_size + self.keep, None)], append)
        return v if append is None else torch.cat([v, append], dim=axis)

    def _update_concat(self, keys: torch.Tensor, values: torch.Tensor,
                       positions: torch.Tensor) -> None:
        if self._keys is None:
            self._keys, self._values, self._positions = keys, values, positions
        else:
            self._apply(self._temporal_order)
            self._idx = self._keys.shape[2]
            # At most max_size + L - 1 afterwards: every new token sees a full window.
            trim_size = self._idx - self.max_size + 1
            self._keys = self._trim(trim_size, self._keys, 2, keys)
            self._values = self._trim(trim_size, self._values, 2, values)
            self._positions = self._trim(trim_size, self._positions, 0, positions)
        self.offset += keys.shape[2]
        self._idx = self._keys.shape[2]

    def _update_in_place(self, keys: torch.Tensor, values: torch.Tensor,
                         positions: torch.Tensor) -> None:
        previous = self.offset
        if self._keys is None or (previous >= self._keys.shape[2]
                                  and self._keys.shape[2] < self.max_size):
            self._grow(keys, values, min(GROWTH_STEP, self.max_size - previous))
            self._idx = previous
        trim_size = self._keys.shape[2] - self.max_size
        if trim_size > 0:  # a multi-token update left more than max_size
            self._apply(lambda v, axis: self._trim(trim_size, v, axis))
            self._idx = self.max_size
        if self._idx == self.max_size:  # wrap: the sinks stay
            self._idx = self.keep
        self._keys[:, :, self._idx:self._idx + 1] = keys
        self._values[:, :, self._idx:self._idx + 1] = values
        self._positions[self._idx:self._idx + 1] = positions
        self.offset += 1
        self._idx += 1

    def _grow(self, keys: torch.Tensor, values: torch.Tensor, new_size: int) -> None:
        """Appends new_size empty slots (position -1) to the ring."""
        batch, heads, _, dim = keys.shape
        empty = torch.zeros((batch, heads, new_size, dim), dtype=self.dtype)
        empty_positions = torch.full((new_size,), -1, dtype=torch.long)
        if self._keys is None:
            self._keys, self._values = empty, empty.clone()
            self._positions = empty_positions
            return
        self._keys = torch.cat([self._keys, empty], dim=2)
        self._values = torch.cat([self._values, empty.clone()], dim=2)
        self._positions = torch.cat([self._positions, empty_positions])

    def keys_values(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """What the layer holds, [B, H, T, D] in temporal order."""
        if self._keys is None:
            raise ValueError("the layer holds nothing yet")
        return self._temporal_order(self._keys, 2), self._temporal_order(self._values, 2)

    def positions(self) -> torch.Tensor:
        """The positions of keys_values(), increasing."""
        if self._positions is None:
            return torch.zeros(0, dtype=torch.long)
        return self._temporal_order(self._positions, 0)

    @property
    def state(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) as mlx-lm's state: the buffer in ring order, cut at
        the offset while the window has not filled."""
        if self._keys is None:
            raise ValueError("the layer holds nothing yet")
        if self.offset < self._keys.shape[2]:
            return self._keys[:, :, :self.offset], self._values[:, :, :self.offset]
        return self._keys, self._values

    @property
    def meta_state(self) -> Tuple[int, int, int, int]:
        """mlx-lm's meta_state, as integers: (keep, max_size, offset, _idx)."""
        return self.keep, self.max_size, self.offset, self._idx

    def crop(self, max_length: int) -> None:
        """Keeps the first max_length tokens; only while nothing was evicted
        (mlx-lm: trimmable while offset < max_size), else ValueError."""
        max_length = max(0, max_length)
        if max_length >= self.offset:
            return
        if self.offset >= self.max_size:
            raise ValueError("cannot crop a rotating layer (keep %d, max_size %d) at offset %d: "
                             "its window has filled" % (self.keep, self.max_size, self.offset))
        # Unfilled: slots 0 .. offset-1 hold positions 0 .. offset-1 in order.
        self._apply(lambda v, axis: v.narrow(axis, 0, max_length))
        self.offset = max_length
        self._idx = max_length

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Row i becomes old row beam_idx[i]."""
        if self._keys is not None:
            self._keys = self._keys.index_select(0, beam_idx)
            self._values = self._values.index_select(0, beam_idx)

    @property
    def batch_size(self) -> Optional[int]:
        """Rows held, or None before the first update."""
        return None if self._keys is None else self._keys.shape[0]


LayerCache = Union[StandardLayerCache, RotatingLayerCache]


class LocalCache:
    """The local reference cache (cache_protocol.KVCache): one
    StandardLayerCache or RotatingLayerCache per layer, storing `dtype`.

    rotating_windows=False keeps every token even in sliding-window layers
    (standard layers throughout): a superset cache, which must give the
    same logits, bit for bit, as the rotating one.
    """

    def __init__(self, layers: Sequence[LayerCacheSpec], dtype: torch.dtype = torch.float32,
                 rotating_windows: bool = True) -> None:
        if dtype not in STORAGE_DTYPES:
            raise ValueError("LocalCache dtype must be float32, float16 or bfloat16, got %s"
                             % dtype)
        self.dtype = dtype
        self.specs: List[LayerCacheSpec] = list(layers)
        self.layers: List[LayerCache] = [self._layer_for(spec, rotating_windows)
                                         for spec in self.specs]

    @classmethod
    def for_model(cls, config: "LlamaConfig", dtype: torch.dtype = torch.float32,
                  rotating_windows: bool = True) -> "LocalCache":
        """A cache laid out for a model config (its layer_cache_specs())."""
        return cls(config.layer_cache_specs(), dtype, rotating_windows)

    def _layer_for(self, spec: LayerCacheSpec, rotating_windows: bool) -> LayerCache:
        if spec.sliding and rotating_windows:
            return RotatingLayerCache(spec.max_size, spec.keep, self.dtype)
        return StandardLayerCache(self.dtype)

    def __len__(self) -> int:
        return len(self.layers)

    def _layer(self, layer_idx: int) -> LayerCache:
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError("layer_idx %d is not in 0 .. %d" % (layer_idx, len(self.layers) - 1))
        return self.layers[layer_idx]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: Optional[Dict[str, Any]] = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """cache_protocol.KVCache.update: stores, returns [B, H_kv, T, D] in `dtype`."""
        return self._layer(layer_idx).update(key_states, value_states)

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        """cache_protocol.KVCache.key_positions: LongTensor [T], increasing."""
        return self._layer(layer_idx).positions()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """cache_protocol.KVCache.get_seq_length: the layer's offset."""
        return self._layer(layer_idx).offset

    def keys_values(self, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """What layer `layer_idx` holds now, [B, H_kv, T, D] in temporal order."""
        return self._layer(layer_idx).keys_values()

    def crop(self, max_length: int) -> None:
        """cache_protocol.KVCache.crop. Checks every layer first, so a refusal
        (a rotating layer whose window has filled) changes nothing."""
        if max_length < 0:
            max_length = max(0, self.get_seq_length() + max_length)
        for index, layer in enumerate(self.layers):
            if (isinstance(layer, RotatingLayerCache) and max_length < layer.offset
                    and layer.offset >= layer.max_size):
                raise ValueError("cannot crop layer %d to %d tokens: its rotating window "
                                 "(max_size %d) has filled at offset %d"
                                 % (index, max_length, layer.max_size, layer.offset))
        for layer in self.layers:
            layer.crop(max_length)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """cache_protocol.KVCache.reorder_cache: index_select along the batch."""
        beam_idx = torch.as_tensor(beam_idx, dtype=torch.long)
        size = self.batch_size
        if beam_idx.dim() != 1 or (size is not None and beam_idx.numel() > 0 and (
                int(beam_idx.min()) < 0 or int(beam_idx.max()) >= size)):
            raise ValueError("beam_idx must be a 1-D index into the %s rows" % size)
        for layer in self.layers:
            layer.reorder(beam_idx)

    @property
    def batch_size(self) -> Optional[int]:
        """Rows of the batch held, or None before the first update."""
        for layer in self.layers:
            if layer.batch_size is not None:
                return layer.batch_size
        return None
