"""Cache adapters model workers call, with their K/V held in kvcached.

- KvcachedCache (transformers_cache.py): the cache protocol of
  kvcached.models (transformers-style update / crop / reorder_cache), in
  write-through or authoritative mode, beams as snapshot-branched caches,
  speculation by kvcached's Begin/Commit/Abort.
- make_prompt_cache (mlx_cache.py): mlx-lm-style per-layer caches
  (update_and_fetch, offset, trim, state, meta_state) over one kvcached cache.
- restore_prefix / publish_prefix (prefixes.py): prefix reuse across workers.
- model_specs.py: CacheSpecs from a model's per-layer windows and sinks.
"""

from .layer_state import LayerKind, LayerState
from .mlx_cache import (KvcachedKVCache, KvcachedPromptCache, KvcachedRotatingKVCache,
                        MlxBacking, can_trim_prompt_cache, make_prompt_cache, prompt_cache_spec,
                        trim_prompt_cache)
from .model_specs import cache_spec_for_layers, cache_spec_from_config, layer_spec
from .prefixes import publish_prefix, restore_prefix
from .transformers_cache import AUTHORITATIVE, WRITE_THROUGH, KvcachedCache

__all__ = ["AUTHORITATIVE", "KvcachedCache", "KvcachedKVCache", "KvcachedPromptCache",
           "KvcachedRotatingKVCache", "LayerKind", "LayerState", "MlxBacking", "WRITE_THROUGH",
           "cache_spec_for_layers", "cache_spec_from_config", "can_trim_prompt_cache",
           "layer_spec", "make_prompt_cache", "prompt_cache_spec", "publish_prefix",
           "restore_prefix", "trim_prompt_cache"]
