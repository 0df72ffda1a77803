"""Models whose KV cache a kvcached server (or a local reference) holds: a
Llama-architecture transformer in torch, its weights read from Hugging
Face-style safetensors checkpoints, and generation (greedy, sampled, beams,
speculative decoding) against any cache following cache_protocol.KVCache.

    from kvcached import models
    model = models.load_pretrained("path/to/llama")        # config.json + *.safetensors
    cache = models.LocalCache.for_model(model.config, dtype=torch.float16)
    out = models.greedy(model, prompt_ids, cache, max_new_tokens=32, prefill_chunk=512)

torch is required here (Debian's python3-torch), unlike in the rest of the
package.
"""

from . import layout
from .cache_protocol import KVCache, LayerCacheSpec, ModelCache
from .checkpoint import load_pretrained, random_model, save_pretrained, tiny_config
from .config import LlamaConfig
from .generate import (BeamSearchResult, Generation, beam_search, greedy, prefill, sample,
                       speculative)
from .llama import LlamaModel
from .local_cache import LocalCache, RotatingLayerCache, StandardLayerCache

__all__ = ["BeamSearchResult", "Generation", "KVCache", "LayerCacheSpec", "LlamaConfig",
           "LlamaModel", "LocalCache", "ModelCache", "RotatingLayerCache", "StandardLayerCache",
           "beam_search", "greedy", "load_pretrained", "prefill", "random_model",
           "layout", "sample", "save_pretrained", "speculative", "tiny_config"]
