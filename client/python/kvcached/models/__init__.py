"""Models whose KV cache a kvcached server (or a local reference) holds: a
Llama-architecture transformer in torch, its weights read from Hugging
Face-style safetensors checkpoints, and generation (greedy, sampled, beams,
speculative decoding) against any cache following cache_protocol.KVCache.

torch is required here (Debian's python3-torch), unlike in the rest of the
package.
"""

from .cache_protocol import KVCache, LayerCacheSpec
from .local_cache import LocalCache, RotatingLayerCache, StandardLayerCache

__all__ = ["KVCache", "LayerCacheSpec", "LocalCache", "RotatingLayerCache",
           "StandardLayerCache"]
