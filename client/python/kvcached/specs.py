"""Building CacheSpecs: one function per layer kind, as mlx-lm names them.

    spec = kvcached.specs.cache_spec(
        [kvcached.specs.standard(heads=8, head_dim=128)] * 30
        + [kvcached.specs.rotating(heads=8, head_dim=128, max_size=4096, keep=4)] * 2,
        dtype=kvcached.DType.FLOAT16, model="llama-3-8b")
"""

from typing import Sequence

from .dtypes import DType
from .proto import pb


def standard(heads: int, head_dim: int, v_head_dim: int = 0) -> pb.LayerSpec:
    """Keeps every token (mlx-lm KVCache)."""
    return pb.LayerSpec(num_kv_heads=heads, k_head_dim=head_dim, v_head_dim=v_head_dim,
                        standard=pb.StandardLayer())


def rotating(heads: int, head_dim: int, max_size: int, keep: int = 4,
             v_head_dim: int = 0) -> pb.LayerSpec:
    """A window of max_size tokens whose first `keep` are never evicted (RotatingKVCache)."""
    return pb.LayerSpec(num_kv_heads=heads, k_head_dim=head_dim, v_head_dim=v_head_dim,
                        rotating=pb.RotatingLayer(max_size=max_size, keep=keep))


def quantized(heads: int, head_dim: int, group_size: int = 64, bits: int = 8,
              v_head_dim: int = 0) -> pb.LayerSpec:
    """Every token, quantized on the device (QuantizedKVCache)."""
    return pb.LayerSpec(num_kv_heads=heads, k_head_dim=head_dim, v_head_dim=v_head_dim,
                        quantized=pb.QuantizedLayer(group_size=group_size, bits=bits))


def chunked(heads: int, head_dim: int, chunk_size: int, v_head_dim: int = 0) -> pb.LayerSpec:
    """The last chunk_size tokens, trimmed from the front (ChunkedKVCache)."""
    return pb.LayerSpec(num_kv_heads=heads, k_head_dim=head_dim, v_head_dim=v_head_dim,
                        chunked=pb.ChunkedLayer(chunk_size=chunk_size))


def recurrent(conv_tail: int, conv_dim: int, num_v_heads: int, head_v_dim: int,
              head_k_dim: int) -> pb.LayerSpec:
    """A linear-recurrent layer's state, replaced whole by each update (ArraysCache)."""
    return pb.LayerSpec(recurrent=pb.RecurrentLayer(
        conv_tail=conv_tail, conv_dim=conv_dim, num_v_heads=num_v_heads, head_v_dim=head_v_dim,
        head_k_dim=head_k_dim))


def cache_spec(layers: Sequence[pb.LayerSpec], dtype: DType = DType.FLOAT16,
               batch_size: int = 1, model: str = "",
               left_padding: Sequence[int] = ()) -> pb.CacheSpec:
    """A cache of these layers, in order."""
    return pb.CacheSpec(layers=list(layers), dtype=int(dtype), batch_size=batch_size,
                        model=model, left_padding=list(left_padding))
