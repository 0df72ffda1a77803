"""One request as a worker serves it: a system prompt and a user prompt in,
greedy tokens out, the system prompt's K/V shared through kvcached.

    with open_cache("write_through", model.config, client=client, model_name=name) as cache:
        result = serve(model, cache, system_ids, user_ids, max_new_tokens=16)

The steps, and what the clock (time to first token) covers:

    t0 ─ LookupPrefix -> Restore      (kvcached caches, reuse on; no new pages)
       ─ prefill system[matched:]     (nothing on a full hit)
       ─ Snapshot -> PublishPrefix    (only where the system prompt was computed here)
       ─ prefill the user prompt
    t1 ─ first token = argmax       ttft = t1 - t0
       ─ decode the rest, one token per forward

The system prompt and the user prompt are always prefilled as two forwards,
also in a local-cache run: the same computation whichever of them a run
does, so a run that restores the system prompt from kvcached gives exactly
the tokens of one that computed it (the restored K/V are the computed
ones' bytes, in the cache's dtype, as a local cache of that dtype holds them).
"""

import dataclasses
import time
from typing import Any, List, Optional, Sequence

import torch

from ..adapters import (AUTHORITATIVE, WRITE_THROUGH, KvcachedCache, cache_spec_from_config,
                        publish_prefix, restore_prefix)
from ..client import Client
from ..dtypes import DType
from ..models.local_cache import LocalCache

LOCAL = "local"
MODES = (WRITE_THROUGH, AUTHORITATIVE, LOCAL)
# The cache dtypes a worker may store K/V in, by the names the CLI takes.
CACHE_DTYPES = {"f32": DType.FLOAT32, "f16": DType.FLOAT16, "bf16": DType.BFLOAT16}
TORCH_OF = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16,
            DType.BFLOAT16: torch.bfloat16}


@dataclasses.dataclass
class ServeResult:
    """What one request did, in the JSON line the CLI prints.

    tokens: the generated ids. prefix_hit: kvcached held (part of) the
    system prompt; matched_tokens: how many of its tokens. prefilled_tokens:
    the tokens this run computed K/V for before its first token. published:
    this run published the system prompt. ttft_s: time to first token;
    lookup_s: LookupPrefix + Restore (+ the mirror's fetch, write-through);
    publish_s: Snapshot + PublishPrefix; decode_s: the remaining tokens.
    """

    mode: str
    tokens: List[int]
    prefix_hit: bool
    matched_tokens: int
    prefilled_tokens: int
    published: bool
    ttft_s: float
    lookup_s: float
    publish_s: float
    decode_s: float


def open_cache(mode: str, config: Any, *, client: Optional[Client] = None,
               model_name: str = "", dtype: DType = DType.FLOAT16) -> Any:
    """An empty cache for a model of `config`: LocalCache, or a KvcachedCache
    in write-through or authoritative mode (then `client` and `model_name`,
    which keys the prefixes it shares, are needed). Close it after use
    (`with`): a kvcached cache is deleted, its published prefixes stay."""
    if mode == LOCAL:
        return _Closing(LocalCache.for_model(config, TORCH_OF[DType(dtype)]))
    if mode not in (WRITE_THROUGH, AUTHORITATIVE):
        raise ValueError("mode must be one of %s, not %r" % (", ".join(MODES), mode))
    if client is None or not model_name:
        raise ValueError("a kvcached cache needs a client and a model name")
    spec = cache_spec_from_config(config, dtype=DType(dtype), model=model_name)
    return KvcachedCache(client, spec, mode=mode)


class _Closing:
    """A LocalCache as a context manager (it holds nothing to release)."""

    def __init__(self, cache: LocalCache) -> None:
        self.cache = cache

    def __enter__(self) -> LocalCache:
        return self.cache

    def __exit__(self, *exc_info: Any) -> None:
        pass


def _forward(model: Any, cache: Any, ids: Sequence[int]) -> torch.Tensor:
    """The last token's logits [vocab] after feeding `ids` (one row)."""
    batch = torch.tensor([list(ids)], dtype=torch.long)
    return model(batch, cache, last_only=True)[0, -1]


def _restore(cache: Any, prompt: Sequence[int], reuse: bool) -> int:
    """Tokens of `prompt` restored from a published prefix (0: none)."""
    if not reuse or not isinstance(cache, KvcachedCache):
        return 0
    return restore_prefix(cache, prompt)


def _publish(cache: Any, system: Sequence[int]) -> bool:
    """Publishes the system prompt's K/V (the cache is at its end)."""
    if not isinstance(cache, KvcachedCache) or not system:
        return False
    cache.flush()  # every write acknowledged before the snapshot takes them
    publish_prefix(cache, system)
    return True


def serve(model: Any, cache: Any, system: Sequence[int], user: Sequence[int],
          max_new_tokens: int, *, reuse: bool = True) -> ServeResult:
    """Greedy generation of `max_new_tokens` after system + user (see the
    module's steps). reuse=False skips the lookup (a recompute that still
    publishes). `cache` must be empty; `user` must not be."""
    if not user:
        raise ValueError("the user prompt is empty: the first token needs a prompt token "
                         "after the shared prefix")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    prompt = list(system) + list(user)
    start = time.perf_counter()
    matched = _restore(cache, prompt, reuse)
    looked_up = time.perf_counter()
    published, publish_s = False, 0.0
    if matched < len(system):
        _forward(model, cache, system[matched:])
        before_publish = time.perf_counter()
        published = _publish(cache, system)
        publish_s = time.perf_counter() - before_publish
    logits = _forward(model, cache, prompt[max(matched, len(system)):])
    tokens = [int(logits.argmax(-1))]
    first = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        tokens.append(int(_forward(model, cache, tokens[-1:]).argmax(-1)))
    done = time.perf_counter()
    return ServeResult(mode=_mode_of(cache), tokens=tokens, prefix_hit=matched > 0,
                       matched_tokens=matched, prefilled_tokens=len(prompt) - matched,
                       published=published, ttft_s=first - start, lookup_s=looked_up - start,
                       publish_s=publish_s, decode_s=done - first)


def _mode_of(cache: Any) -> str:
    return cache.mode if isinstance(cache, KvcachedCache) else LOCAL


def warm_up(model: Any) -> None:
    """One forward of one token without a cache: torch's first call pays for
    its thread pool and allocations, which no request's clock should."""
    model(torch.zeros((1, 1), dtype=torch.long), None, last_only=True)
