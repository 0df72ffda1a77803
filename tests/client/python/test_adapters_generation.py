"""A seeded tiny Llama (kvcached.models) generates with its cache in kvcached
exactly as with LocalCache: greedy logits torch.equal at every step in both
modes and every dtype, with sliding-window layers that keep sinks; at the
end every layer's fetched bytes equal LocalCache's tensors. Beams via
snapshot-branched caches equal reorder_cache on local tensors; speculation
(crop, or Begin/Commit/Abort) equals greedy; trim then continue equals
cutting the local tensors."""

import pytest
import torch

from kvcached.adapters import AUTHORITATIVE, WRITE_THROUGH, KvcachedCache, cache_spec_from_config
from kvcached.dtypes import DType
from kvcached.models import (KVCache, LocalCache, beam_search, greedy, random_model, speculative,
                             tiny_config)
from kvcached.models.generate import prefill
from adapter_support import server  # noqa: F401 (a fixture of its tests)
from adapter_support import client_fixture
from adapter_support import TORCH_OF, layer_history

# Full, sliding (window 6, 2 sinks: wraps within the run), full.
SLIDING = dict(num_hidden_layers=3, sliding_window=6, attention_sinks=2,
               layer_types=["full_attention", "sliding_attention", "full_attention"])
PROMPT = [(7 * i + 3) % 256 for i in range(13)]
DTYPES = [DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16]


client = client_fixture("lane")


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(**SLIDING), seed=11)


def kvcached_cache(client, model, dtype, mode=WRITE_THROUGH):
    spec = cache_spec_from_config(model.config, dtype=dtype, model="tiny-sliding")
    return KvcachedCache(client, spec, mode=mode, ack_every_steps=4)


def assert_fetched_equal_local(client, cache, local):
    """Every row's every layer in kvcached: LocalCache's positions and bytes."""
    cache.flush()
    for layer in range(len(local)):
        keys, values = local.keys_values(layer)
        for row, cache_id in enumerate(cache.cache_ids()):
            positions, got_keys, got_values = layer_history(client, cache_id, layer)
            assert positions == local.key_positions(layer).tolist(), "layer %d" % layer
            assert torch.equal(got_keys, keys[row:row + 1])
            assert torch.equal(got_values, values[row:row + 1])


@pytest.mark.parametrize("mode", [WRITE_THROUGH, AUTHORITATIVE])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_greedy_is_token_for_token_the_local_run(client, model, mode, dtype):
    local = LocalCache.for_model(model.config, TORCH_OF[dtype])
    want = greedy(model, PROMPT, local, 20, prefill_chunk=5, return_logits=True)
    with kvcached_cache(client, model, dtype, mode) as cache:
        assert isinstance(cache, KVCache)  # the models' cache protocol
        got = greedy(model, PROMPT, cache, 20, prefill_chunk=5, return_logits=True)
        assert torch.equal(got.tokens, want.tokens)
        for step, (mine, theirs) in enumerate(zip(got.logits, want.logits)):
            assert torch.equal(mine, theirs), "step %d" % step
        assert_fetched_equal_local(client, cache, local)


@pytest.mark.parametrize("mode", [WRITE_THROUGH, AUTHORITATIVE])
def test_beams_via_snapshots_equal_local_reorders(client, model, mode):
    local = LocalCache.for_model(model.config, torch.float16)
    want = beam_search(model, PROMPT, local, 8, num_beams=3, prefill_chunk=6)
    with kvcached_cache(client, model, DType.FLOAT16, mode) as cache:
        got = beam_search(model, PROMPT, cache, 8, num_beams=3, prefill_chunk=6)
        assert torch.equal(got.sequences, want.sequences)
        assert torch.equal(got.scores, want.scores)
        assert len(cache.cache_ids()) == 3
        assert_fetched_equal_local(client, cache, local)


def test_speculative_decoding_by_crop_equals_the_local_run(client):
    # Windows wider than the run: crop (Trim) stays allowed on every layer.
    config = tiny_config(**dict(SLIDING, sliding_window=64))
    target, draft = random_model(config, seed=12), random_model(config, seed=13)
    local = LocalCache.for_model(config, torch.float32)
    want = speculative(target, draft, PROMPT, local, LocalCache.for_model(config), 16,
                       draft_tokens=3, return_logits=True)
    plain = greedy(target, PROMPT, LocalCache.for_model(config), 16)
    spec = cache_spec_from_config(config, dtype=DType.FLOAT32, model="tiny-spec")
    with KvcachedCache(client, spec) as cache:
        got = speculative(target, draft, PROMPT, cache, LocalCache.for_model(config), 16,
                          draft_tokens=3, return_logits=True)
        assert torch.equal(got.tokens, want.tokens) and got.accepted == want.accepted
        assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
        assert torch.equal(got.tokens, plain.tokens)
        assert_fetched_equal_local(client, cache, local)


def speculate_with_commits(target, draft, cache, draft_cache, new_tokens, draft_tokens):
    """Greedy speculative decoding whose target cache drafts in a kvcached
    speculation: the verify pass is committed up to the accepted tokens (or
    aborted and redone when none is), so rotating windows that have filled
    need no crop."""
    logits = prefill(target, cache, PROMPT)
    prefill(draft, draft_cache, PROMPT)
    tokens, rounds = [int(logits.argmax(-1))], []
    while len(tokens) < new_tokens:
        base = cache.get_seq_length()
        proposals, token = [], torch.tensor([tokens[-1]])
        for _ in range(min(draft_tokens, new_tokens - len(tokens) - 1)):
            token = draft(token.view(1, 1), draft_cache, last_only=True)[:, -1].argmax(-1)
            proposals.append(int(token))
        cache.begin_speculation()
        verified = target(torch.tensor([[tokens[-1]] + proposals]), cache)[0].argmax(-1)
        kept = 0
        while kept < len(proposals) and proposals[kept] == int(verified[kept]):
            kept += 1
        cache.commit_speculation(1 + kept)
        rounds.append(kept)
        tokens += proposals[:kept] + [int(verified[kept])]
        # The draft was fed the pending token and all proposals but the last.
        draft_cache.crop(base + 1 + kept)
        if draft_cache.get_seq_length() < base + 1 + kept:
            fed_last = proposals[-1] if proposals else tokens[-2 - kept]
            draft(torch.tensor([[fed_last]]), draft_cache, last_only=True)
    return tokens[:new_tokens], rounds


@pytest.mark.parametrize("mode", [WRITE_THROUGH, AUTHORITATIVE])
@pytest.mark.parametrize("draft_seed", [11, 14], ids=["same-model", "other-model"])
def test_speculation_by_commit_equals_greedy_past_a_filled_window(client, model, mode,
                                                                   draft_seed):
    draft = random_model(model.config, seed=draft_seed)
    plain = greedy(model, PROMPT, LocalCache.for_model(model.config, torch.float16), 18)
    with kvcached_cache(client, model, DType.FLOAT16, mode) as cache:
        draft_cache = LocalCache.for_model(model.config, rotating_windows=False)
        tokens, rounds = speculate_with_commits(model, draft, cache, draft_cache, 18, 3)
        assert tokens == plain.tokens[0].tolist()
        assert cache.get_seq_length() == len(PROMPT) + 17
        if draft_seed == 11:
            assert max(rounds) == 3, "the same model as draft: whole drafts accepted"
        # An aborted speculation leaves the cache as it was.
        cache.begin_speculation()
        model(torch.tensor([[1, 2, 3]]), cache)
        cache.abort_speculation()
        assert cache.get_seq_length() == len(PROMPT) + 17
        cache.flush()


@pytest.mark.parametrize("mode", [WRITE_THROUGH, AUTHORITATIVE])
def test_trim_then_continue_equals_cutting_local_tensors(client, mode):
    config = tiny_config(num_hidden_layers=2)
    model = random_model(config, seed=15)
    local = LocalCache.for_model(config, torch.bfloat16)
    spec = cache_spec_from_config(config, dtype=DType.BFLOAT16, model="tiny-trim")
    with KvcachedCache(client, spec, mode=mode) as cache:
        for run in (local, cache):
            greedy(model, PROMPT, run, 10)
            run.crop(len(PROMPT) + 4)
        assert cache.get_seq_length() == local.get_seq_length() == len(PROMPT) + 4
        want = greedy(model, [9, 8, 7], local, 6, return_logits=True)
        got = greedy(model, [9, 8, 7], cache, 6, return_logits=True)
        assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
        assert_fetched_equal_local(client, cache, local)
