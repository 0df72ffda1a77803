"""Prefix reuse as a worker does it, on a KvcachedCache of one row.

    cached = restore_prefix(cache, prompt)     # LookupPrefix -> Restore: no new pages
    logits = model(prompt[cached:], cache)     # prefill only the rest
    publish_prefix(cache, prompt)              # Snapshot -> PublishPrefix -> release

kvcached matches prefixes by token ids per (model, layout). A layout of
standard layers restores at any length, so any shared leading tokens match;
one with rotating layers restores only where an entry ends, so only an entry
whose every token leads the prompt matches, and it must have been published
at its snapshot's end (PublishPrefixRequest).
"""

from typing import Sequence

from ..proto import pb
from .remote import _quietly
from .transformers_cache import KvcachedCache


def restore_prefix(cache: KvcachedCache, tokens: Sequence[int], ttl_seconds: int = 0) -> int:
    """Restores the longest published prefix of `tokens` into the cache (a
    fresh one-row cache: it replaces what is there) and returns how many
    tokens it holds; 0 on a miss. The last token is never matched, so a
    prefill of tokens[returned:] always has a token to give logits for.
    The lookup's snapshot handle is released before this returns."""
    if len(tokens) < 2:
        return 0
    rows = cache.ensure_rows(1)
    hit = cache.client.lookup_prefix(list(tokens[:-1]), cache_id=rows[0].id,
                                     ttl_seconds=ttl_seconds)
    if not hit.matched_tokens:
        return 0
    try:
        rows[0].restore(hit.snapshot, int(hit.matched_tokens))
    finally:
        _quietly(cache.client.release_snapshot, hit.snapshot.snapshot_id)
    cache.load_restored()
    return int(hit.matched_tokens)


def publish_prefix(cache: KvcachedCache, tokens: Sequence[int],
                   ttl_seconds: int = 0) -> pb.PublishPrefixResponse:
    """Publishes the cache's first len(tokens) positions as the K/V of
    `tokens` (a layout with rotating layers: len(tokens) must be the
    cache's offset). The snapshot it publishes is released once the index
    holds its own; the entry lives under its own lease (`ttl_seconds`)."""
    rows = cache.ensure_rows(1)
    snapshot = rows[0].snapshot()
    try:
        return cache.client.publish_prefix(snapshot.snapshot_id, list(tokens),
                                           ttl_seconds=ttl_seconds)
    finally:
        _quietly(cache.client.release_snapshot, snapshot.snapshot_id)
