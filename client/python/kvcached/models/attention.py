"""Attention over what a cache returned: select the needed keys by position,
mask per query, softmax in float32, grouped-query heads.

Which keys a query may attend (q, k absolute positions):

    full layer:     k <= q
    sliding layer:  k <= q  and  (q - k < window  or  k < keep)

A cache may return more keys than that (cache_protocol.py). Before any
arithmetic, `select_needed` keeps exactly the keys some query of the step
may attend, in temporal order, so two caches returning different supersets
give the same tensors to the same matmuls: bit-identical outputs.
"""

from typing import Optional, Tuple

import torch


def needed_keys(key_positions: torch.Tensor, query_positions: torch.Tensor,
                window: Optional[int] = None, keep: int = 0) -> torch.Tensor:
    """BoolTensor [T]: the keys some query of query_positions may attend."""
    last = int(query_positions.max())
    needed = key_positions <= last
    if window is not None:
        first = int(query_positions.min())
        needed &= (key_positions >= first - window + 1) | (key_positions < keep)
    return needed


def select_needed(keys: torch.Tensor, values: torch.Tensor, key_positions: torch.Tensor,
                  query_positions: torch.Tensor, window: Optional[int] = None, keep: int = 0
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys, values [B, H, T, D] and positions [T] cut to the needed keys."""
    if key_positions.numel() != keys.shape[2]:
        raise ValueError("the cache returned %d keys but %d key positions"
                         % (keys.shape[2], key_positions.numel()))
    needed = needed_keys(key_positions, query_positions, window, keep)
    if bool(needed.all()):  # the usual case of a full layer: no selection
        # Contiguous whatever the cache's layout (a view of a growing buffer,
        # a fetched array), so the matmuls see the same memory layout too.
        return keys.contiguous(), values.contiguous(), key_positions
    index = needed.nonzero().squeeze(1)
    return (keys.index_select(2, index), values.index_select(2, index),
            key_positions.index_select(0, index))


def allowed_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                 window: Optional[int] = None, keep: int = 0) -> torch.Tensor:
    """BoolTensor [L, S]: whether query i may attend key j."""
    query = query_positions.unsqueeze(1)
    key = key_positions.unsqueeze(0)
    allowed = key <= query
    if window is not None:
        allowed &= ((query - key) < window) | (key < keep)
    return allowed


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           query_positions: torch.Tensor, key_positions: torch.Tensor,
           window: Optional[int] = None, keep: int = 0) -> torch.Tensor:
    """Scaled dot-product attention of query [B, H_q, L, D] over keys and
    values [B, H_kv, T, D] (float32) at the given positions; each group of
    H_q / H_kv consecutive query heads shares one key/value head, as HF's
    repeat_kv pairs them. Returns [B, H_q, L, D]."""
    keys, values, key_positions = select_needed(keys, values, key_positions, query_positions,
                                                window, keep)
    batch, query_heads, length, dim = query.shape
    kv_heads, selected = keys.shape[1], keys.shape[2]
    groups = query_heads // kv_heads
    # [B, H_kv, groups * L, D]: every query of a group against its one key head,
    # so keys and values are never repeated in memory.
    grouped = query.reshape(batch, kv_heads, groups * length, dim)
    scores = torch.matmul(grouped, keys.transpose(2, 3)) * dim ** -0.5  # HF scaling
    scores = scores.view(batch, kv_heads, groups, length, selected)
    mask = allowed_mask(query_positions, key_positions, window, keep)
    scores = scores.masked_fill(~mask, float("-inf"))
    probabilities = torch.softmax(scores, dim=-1).view(batch, kv_heads, groups * length, selected)
    return torch.matmul(probabilities, values).view(batch, query_heads, length, dim)
