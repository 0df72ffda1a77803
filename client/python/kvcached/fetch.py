"""Fetched chunks assembled into one [B, H, T, D] array per layer and tensor.

Each chunk holds one layer's tokens [start, start + L) as [B, H, L, D]
tensors. Its bytes go where `place` says while they arrive (wire.py), so
with arrays of the caller's (`out`) they land in place with no copy:

    out keys [B, H, T, D]          chunk keys [B, H, L, D]
    row (b, h): |..at..|<-- L -->|      row (b, h): |<-- L -->|
                        ^ one view per (b, h) row, filled in order

Without `out`, each chunk gets an array of its own, and a layer of several
chunks is joined at the end (one copy).
"""

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import wire
from .dtypes import ELEMENT_BYTES, DType, dtype_of, numpy_dtype, writable_array

# What a caller fetches a layer into: (keys, values) arrays or torch tensors.
OutPair = Tuple[Any, Any]


@dataclass
class LayerHistory:
    """One layer's history in temporal order.

    keys [B, H, T, Dk] and values [B, H, T, Dv]: the caller's `out` tensors
    cut to the T tokens fetched, or new numpy arrays (bf16 as uint16).
    ranges: the absolute positions [begin, end) they hold, in order (a
    rotating layer: its sinks, then its recent window)."""

    layer: int
    keys: Any
    values: Any
    ranges: List[Tuple[int, int]] = field(default_factory=list)
    dtype: DType = DType.UNSPECIFIED

    @property
    def tokens(self) -> int:
        """How many positions the history holds (T)."""
        return sum(end - begin for begin, end in self.ranges)


def _check_header(layer: int, header: wire.TensorHeader) -> Tuple[int, int, int, int]:
    """A token tensor's [B, H, L, D], once its dtype, rank and size agree."""
    if header.dtype not in ELEMENT_BYTES or len(header.shape) != 4:
        raise wire.WireError("layer %d: a chunk tensor of dtype %d and shape %s is no "
                             "[B, H, L, D] tensor" % (layer, header.dtype, header.shape))
    if math.prod(header.shape) * ELEMENT_BYTES[DType(header.dtype)] != header.data_bytes:
        raise wire.WireError("layer %d: a chunk's %d data bytes do not fill its shape %s"
                             % (layer, header.data_bytes, header.shape))
    return header.shape  # type: ignore[return-value]


def _check_out(layer: int, name: str, array: np.ndarray, dtype: DType,
               shape: Sequence[int], end: int) -> None:
    """`out` must match the chunk: dtype, B, H, D, and room for `end` tokens."""
    if array.ndim != 4 or dtype_of(array) != dtype:
        raise ValueError("layer %d: out %s must be a [B, H, T, D] array of %s, not %s %s"
                         % (layer, name, dtype.name, array.dtype, array.shape))
    b, h, _, d = shape
    if (array.shape[0], array.shape[1], array.shape[3]) != (b, h, d):
        raise ValueError("layer %d: out %s is %s; the chunks are [%d, %d, ., %d]"
                         % (layer, name, array.shape, b, h, d))
    if end > array.shape[2]:
        raise ValueError("layer %d: out %s holds %d tokens; the fetch returned more (%d+)"
                         % (layer, name, array.shape[2], end))


def _flat_bytes(array: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes as one flat memoryview (1-D: memoryview
    slices only one dimension, and its slices cost far less than numpy's)."""
    return memoryview(array.reshape(-1).view(np.uint8))


def _row_views(flat: memoryview, shape: Sequence[int], at: int,
               tokens: int) -> List[memoryview]:
    """Byte views of tokens [at, at + tokens) of each (b, h) row of a
    [B, H, T, D] array of this `shape`, whose bytes are `flat`."""
    b, h, total, _ = shape
    if b * h == 0 or (at == 0 and tokens == total):
        return [flat]  # the whole array (or nothing), in one read
    stride = len(flat) // (b * h)  # bytes per (b, h) row
    token_bytes = stride // total
    begin, end = at * token_bytes, (at + tokens) * token_bytes
    return [flat[r * stride + begin:r * stride + end] for r in range(b * h)]


class LayerAssembler:
    """Places one layer's chunks, into `out` or into arrays of its own."""

    def __init__(self, layer: int, out: Optional[OutPair] = None) -> None:
        self.layer = layer
        self._out = out
        self._out_arrays = None if out is None else [writable_array(t) for t in out]
        # Their bytes, viewed once: every chunk takes slices of them.
        self._out_bytes: List[Optional[memoryview]] = [None, None]
        self._chunks: List[List[np.ndarray]] = [[], []]  # keys, values without out
        self._pending: Dict[int, int] = {}  # field -> tokens of the chunk being read
        self._at = 0  # tokens placed
        self._ranges: List[Tuple[int, int]] = []
        self._dtype = DType.UNSPECIFIED

    def place(self, start: int, field_number: int, header: wire.TensorHeader) -> List[memoryview]:
        """Where one chunk tensor's data goes (wire.Placer, for this layer)."""
        shape = _check_header(self.layer, header)
        dtype = DType(header.dtype)
        if self._dtype not in (DType.UNSPECIFIED, dtype):
            raise wire.WireError("layer %d: chunks of %s and %s" % (self.layer, self._dtype.name,
                                                                   dtype.name))
        self._dtype = dtype
        which = 0 if field_number == wire.CHUNK_KEYS else 1
        views = self._views(which, dtype, shape)
        self._pending[field_number] = shape[2]
        if len(self._pending) == 2:
            self._end_chunk(start)
        return views

    def _views(self, which: int, dtype: DType, shape: Sequence[int]) -> List[memoryview]:
        tokens = shape[2]
        if self._out_arrays is None:
            array = np.empty(shape, dtype=numpy_dtype(dtype))
            self._chunks[which].append(array)
            return [memoryview(array.reshape(-1).view(np.uint8))]
        array = self._out_arrays[which]
        _check_out(self.layer, ("keys", "values")[which], array, dtype, shape, self._at + tokens)
        flat = self._out_bytes[which]
        if flat is None:
            flat = self._out_bytes[which] = _flat_bytes(array)
        return _row_views(flat, array.shape, self._at, tokens)

    def _end_chunk(self, start: int) -> None:
        keys_tokens, values_tokens = self._pending.values()
        self._pending.clear()
        if keys_tokens != values_tokens:
            raise wire.WireError("layer %d: a chunk of %d key and %d value tokens"
                                 % (self.layer, keys_tokens, values_tokens))
        if self._ranges and self._ranges[-1][1] == start:
            self._ranges[-1] = (self._ranges[-1][0], start + keys_tokens)
        else:
            self._ranges.append((start, start + keys_tokens))
        self._at += keys_tokens

    def result(self) -> LayerHistory:
        """The layer's history once every chunk is placed."""
        if self._out is not None:
            keys, values = (t[:, :, :self._at] for t in self._out)
        elif not self._chunks[0]:
            keys = values = np.empty((0, 0, 0, 0), dtype=np.float32)
        else:
            keys, values = (parts[0] if len(parts) == 1 else np.concatenate(parts, axis=2)
                            for parts in self._chunks)
        return LayerHistory(self.layer, keys, values, list(self._ranges), self._dtype)


class FetchAssembler:
    """Places a Fetch's chunks, layer by layer (wire.Placer)."""

    def __init__(self, out: Optional[Dict[int, OutPair]] = None) -> None:
        self._out = out or {}
        self.layers: Dict[int, LayerAssembler] = {}

    def __call__(self, layer: int, start: int, field_number: int,
                 header: wire.TensorHeader) -> List[memoryview]:
        assembler = self.layers.get(layer)
        if assembler is None:
            assembler = self.layers[layer] = LayerAssembler(layer, self._out.get(layer))
        return assembler.place(start, field_number, header)

    def results(self) -> Dict[int, LayerHistory]:
        """Every layer that returned chunks, or had an `out` to fill."""
        for layer in self._out:
            if layer not in self.layers:
                self.layers[layer] = LayerAssembler(layer, self._out[layer])
        return {layer: assembler.result() for layer, assembler in sorted(self.layers.items())}
