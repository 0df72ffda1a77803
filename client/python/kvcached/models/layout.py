"""A model's cache layout as a kvcached CacheSpec: full-attention layers as
standard layers, sliding-window layers as rotating ones with
max_size = window + keep (cache_protocol.LayerCacheSpec.max_size), so a
kvcached cache holds exactly what LocalCache holds, layer for layer.
"""

from typing import Optional

import torch

from .. import specs
from ..dtypes import dtype_of_torch
from ..proto import pb
from .cache_protocol import LayerCacheSpec
from .config import LlamaConfig


def layer_spec_for(cache: Optional[LayerCacheSpec], heads: int, head_dim: int,
                   v_head_dim: int = 0) -> pb.LayerSpec:
    """kvcached's LayerSpec for a layer that needs `cache` (None: full attention)."""
    if cache is None or not cache.sliding:
        return specs.standard(heads, head_dim, v_head_dim)
    return specs.rotating(heads, head_dim, max_size=cache.max_size, keep=cache.keep,
                          v_head_dim=v_head_dim)


def layer_spec(config: LlamaConfig, layer_idx: int) -> pb.LayerSpec:
    """kvcached's LayerSpec for one layer of the model."""
    return layer_spec_for(config.layer_cache_spec(layer_idx), config.num_key_value_heads,
                          config.head_dim)


def cache_spec(config: LlamaConfig, dtype: torch.dtype = torch.float16, batch_size: int = 1,
               model: str = "") -> pb.CacheSpec:
    """kvcached's CacheSpec for the model's KV cache, stored as `dtype`."""
    layers = [layer_spec(config, index) for index in range(config.num_hidden_layers)]
    return specs.cache_spec(layers, dtype_of_torch(dtype), batch_size=batch_size, model=model)
