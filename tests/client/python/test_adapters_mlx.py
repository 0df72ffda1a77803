"""The mlx-lm-style caches (adapters/mlx_cache.py) answer exactly as mlx-lm's
KVCache and RotatingKVCache (mlx_reference.py, a line-for-line transcription):
update_and_fetch's arrays in mlx-lm's ring order, offset, state, meta_state,
is_trimmable and trim, over random sequences of one-token and longer updates
and trims; kvcached's fetched layers equal the reference in temporal order."""

import random

import pytest
import torch

from kvcached import specs
from kvcached.adapters import (can_trim_prompt_cache, make_prompt_cache, prompt_cache_spec,
                               trim_prompt_cache)
from kvcached.dtypes import DType
import mlx_reference
from adapter_support import server  # noqa: F401 (a fixture of its tests)
from adapter_support import client_fixture
from adapter_support import kv, layer_history

HEADS, DIM, BATCH = 2, 4, 2


client = client_fixture("lane", "grpc")


def references():
    return [mlx_reference.KVCache(), mlx_reference.RotatingKVCache(8, keep=4),
            mlx_reference.RotatingKVCache(6, keep=0)]


def model_spec(dtype):
    return specs.cache_spec([specs.standard(HEADS, DIM),
                             specs.rotating(HEADS, DIM, max_size=8, keep=4),
                             specs.rotating(HEADS, DIM, max_size=6, keep=0)], dtype=dtype)


def assert_same(ours, reference, got, want):
    assert ours.offset == reference.offset
    assert ours.meta_state == reference.meta_state
    assert ours.is_trimmable() == reference.is_trimmable()
    for mine, theirs in zip(got + ours.state, want + reference.state):
        assert mine.shape == theirs.shape and torch.equal(mine, theirs)


def assert_kvcached_holds(client, cache, refs):
    cache.backing.flush()
    for layer, reference in enumerate(refs):
        positions, keys, values = layer_history(client, cache.backing.cache_id(), layer)
        want_keys, want_values = reference.temporal()
        assert len(positions) == want_keys.shape[2], "layer %d" % layer
        assert positions[-1] == reference.offset - 1
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16], ids=lambda d: d.name)
def test_random_updates_and_trims_answer_as_mlx_lm(client, dtype):
    torch_dtype = {DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}[dtype]
    rng, generator = random.Random(int(dtype)), torch.Generator().manual_seed(int(dtype))
    refs = references()
    with make_prompt_cache(client, model_spec(dtype), ack_every_steps=4) as cache:
        for op in range(40):
            if rng.random() < 0.2 and refs[0].offset and op < 39:  # ends with an update
                n = rng.randint(1, 4)
                can = all(ref.is_trimmable() for ref in refs)
                assert can_trim_prompt_cache(cache) == can
                want = [ref.trim(n) for ref in refs][0] if can else 0
                assert trim_prompt_cache(cache, n) == want
                for layer, reference in zip(cache, refs):
                    assert_same(layer, reference, (), ())
                continue
            tokens = rng.choice([1, 1, 1, 1, 2, 5, 9])
            for layer, reference in zip(cache, refs):
                keys, values = kv(generator, BATCH, HEADS, tokens, DIM)
                got = layer.update_and_fetch(keys, values)
                want = reference.update_and_fetch(keys.to(torch_dtype), values.to(torch_dtype))
                assert_same(layer, reference, got, want)
        assert_kvcached_holds(client, cache, refs)


def test_mlx_defaults_and_a_trim_right_after_a_prompt(client):
    spec = prompt_cache_spec(2, HEADS, DIM, dtype=DType.FLOAT32, max_kv_size=16)
    assert [layer.rotating.keep for layer in spec.layers] == [4, 4]  # mlx-lm's keep = 4
    refs = [mlx_reference.RotatingKVCache(16, keep=4) for _ in range(2)]
    generator = torch.Generator().manual_seed(3)
    with make_prompt_cache(client, spec) as cache:
        assert cache[0].state == (None, None) and cache[0].offset == 0
        for tokens in (10, 1, 1):
            for layer, reference in zip(cache, refs):
                keys, values = kv(generator, 1, HEADS, tokens, DIM)
                assert_same(layer, reference, layer.update_and_fetch(keys, values),
                            reference.update_and_fetch(keys, values))
        assert trim_prompt_cache(cache, 5) == 5 and [r.trim(5) for r in refs] == [5, 5]
        for tokens in (1, 7, 1):
            for layer, reference in zip(cache, refs):
                keys, values = kv(generator, 1, HEADS, tokens, DIM)
                assert_same(layer, reference, layer.update_and_fetch(keys, values),
                            reference.update_and_fetch(keys, values))
        assert not can_trim_prompt_cache(cache) and trim_prompt_cache(cache, 1) == 0
        assert_kvcached_holds(client, cache, refs)


def test_one_layer_trimmed_alone_is_refused_at_its_next_update(client):
    spec = prompt_cache_spec(2, HEADS, DIM, dtype=DType.FLOAT32)
    generator = torch.Generator().manual_seed(4)
    with make_prompt_cache(client, spec) as cache:
        for layer in cache:
            layer.update_and_fetch(*kv(generator, 1, HEADS, 3, DIM))
        assert cache[0].trim(1) == 1
        with pytest.raises(ValueError):
            cache[0].update_and_fetch(*kv(generator, 1, HEADS, 1, DIM))
        assert cache[1].trim(1) == 1  # now in step: one Trim of kvcached
        for layer in cache:
            layer.update_and_fetch(*kv(generator, 1, HEADS, 1, DIM))
        cache.backing.flush()
        assert list(client.get_cache(cache.backing.cache_id()).layer_offsets) == [3, 3]
