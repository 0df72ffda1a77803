"""A model's cache layout as a kvcached CacheSpec: full-attention layers as
standard layers, sliding-window layers as rotating ones with
max_size = window + keep (cache_protocol.LayerCacheSpec.max_size), so a
kvcached cache holds exactly what LocalCache holds, layer for layer.
"""

from typing import Dict

import torch

from .. import specs
from ..dtypes import DType
from ..proto import pb
from .config import LlamaConfig

DTYPE_OF_TORCH: Dict[torch.dtype, DType] = {
    torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16,
}


def layer_spec(config: LlamaConfig, layer_idx: int) -> pb.LayerSpec:
    """kvcached's LayerSpec for one layer of the model."""
    spec = config.layer_cache_spec(layer_idx)
    heads, head_dim = config.num_key_value_heads, config.head_dim
    if spec.sliding:
        return specs.rotating(heads, head_dim, max_size=spec.max_size, keep=spec.keep)
    return specs.standard(heads, head_dim)


def cache_spec(config: LlamaConfig, dtype: torch.dtype = torch.float16, batch_size: int = 1,
               model: str = "") -> pb.CacheSpec:
    """kvcached's CacheSpec for the model's KV cache, stored as `dtype`."""
    if dtype not in DTYPE_OF_TORCH:
        raise ValueError("kvcached stores float32, float16 or bfloat16, not %s" % dtype)
    layers = [layer_spec(config, index) for index in range(config.num_hidden_layers)]
    return specs.cache_spec(layers, DTYPE_OF_TORCH[dtype], batch_size=batch_size, model=model)
