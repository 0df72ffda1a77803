"""What one attention layer holds, kept as torch tensors with their positions.

Both adapters keep layers in this form: the write-through mirror between
steps, the authoritative mode for the length of one step (built from a
Fetch). The eviction rule is the one kvcached's rotating layer follows
(server/engine/layers/rotating_layer.cc), which is mlx-lm's RotatingKVCache:

    positions  0 .. keep-1 | evicted ........... | oldest held .. offset-1
               [  sinks   ]                        [ the recent tokens     ]

An update of L tokens first evicts the oldest non-sink tokens until at most
max_size - 1 are held (so every new token sees a full window), then appends
all L. A one-token update past the window thus holds exactly max_size; a
longer one holds max_size - 1 + L, a superset of what its queries need.
"""

import dataclasses
from typing import Optional, Sequence, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """A layer's cache kind: standard (max_size 0) or rotating (max_size, keep)."""

    max_size: int = 0
    keep: int = 0

    @property
    def rotating(self) -> bool:
        """Whether the layer keeps only its sinks and a recent window."""
        return self.max_size > 0

    def trimmable(self, offset: int) -> bool:
        """mlx-lm is_trimmable: a rotating layer only until its window has filled
        (after that evicted tokens cannot come back)."""
        return not self.rotating or offset < self.max_size


@dataclasses.dataclass(frozen=True)
class LayerState:
    """The tokens a layer holds: keys [B, H, T, Dk], values [B, H, T, Dv], in
    temporal order, positions [T] their absolute positions, offset the tokens
    the layer has seen (the next token's position)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    offset: int

    @property
    def held(self) -> int:
        """How many tokens the layer holds (T)."""
        return int(self.positions.shape[0])


def positions_of(ranges: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """Absolute positions of a fetch's ranges [(begin, end), ...], in order."""
    if not ranges:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(begin, end, dtype=torch.long) for begin, end in ranges])


def _evicted_for(kind: LayerKind, state: LayerState) -> LayerState:
    """The state with the oldest non-sink tokens gone until at most
    max_size - 1 remain (mlx-lm _update_concat / _update_in_place's trim)."""
    evict = state.held + 1 - kind.max_size
    if not kind.rotating or evict <= 0:
        return state
    sinks = min(kind.keep, state.offset)  # positions 0 .. sinks-1 lead the held tokens
    keep = torch.cat([torch.arange(sinks), torch.arange(sinks + evict, state.held)])
    return LayerState(state.keys[:, :, keep], state.values[:, :, keep], state.positions[keep],
                      state.offset)


def appended(kind: LayerKind, state: Optional[LayerState], keys: torch.Tensor,
             values: torch.Tensor) -> LayerState:
    """The state after an update of keys/values [B, H, L, D] (already in the
    storage dtype): what kvcached holds after the same Update."""
    tokens = int(keys.shape[2])
    if state is None:  # an empty layer evicts nothing
        return LayerState(keys, values, torch.arange(tokens, dtype=torch.long), tokens)
    start = state.offset
    kept = _evicted_for(kind, state)
    return LayerState(torch.cat([kept.keys, keys], dim=2), torch.cat([kept.values, values], dim=2),
                      torch.cat([kept.positions,
                                 torch.arange(start, start + tokens, dtype=torch.long)]),
                      start + tokens)


def cut(kind: LayerKind, state: Optional[LayerState], tokens: int) -> Optional[LayerState]:
    """The state with its last `tokens` positions dropped (mlx-lm trim), which
    only a trimmable layer allows (ValueError otherwise); None when empty."""
    if state is None or tokens <= 0:
        return state
    if not kind.trimmable(state.offset):
        raise ValueError("a rotating layer whose window has filled (offset %d, max_size %d) "
                         "cannot be cut back; restore a snapshot instead"
                         % (state.offset, kind.max_size))
    offset = max(0, state.offset - tokens)
    if offset == 0:
        return None
    keep = state.positions < offset
    return LayerState(state.keys[:, :, keep], state.values[:, :, keep], state.positions[keep],
                      offset)


def rows(state: Optional[LayerState], index: torch.Tensor) -> Optional[LayerState]:
    """The state with its batch rows reordered/repeated as `index` says."""
    if state is None:
        return None
    return LayerState(state.keys.index_select(0, index), state.values.index_select(0, index),
                      state.positions, state.offset)
