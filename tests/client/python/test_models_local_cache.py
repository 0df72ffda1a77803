"""LocalCache, the reference cache: standard layers keep everything;
rotating layers follow mlx-lm's RotatingKVCache rule for rule (sinks kept,
the ring's write index back to `keep` on wrap, multi-token updates keeping
max_size - 1 earlier tokens); storage dtype rounding; crop, reorder_cache."""

import pytest

torch = pytest.importorskip("torch")

from kvcached.models import LayerCacheSpec, LocalCache  # noqa: E402 (after the torch check)
from kvcached.models.local_cache import RotatingLayerCache  # noqa: E402


def tokens_at(positions, batch=1, heads=2, dim=3):
    """[B, H, L, D] whose every element is its token's position (plus a
    fraction per row), so what a cache returns shows where it came from."""
    base = torch.tensor(positions, dtype=torch.float32).view(1, 1, -1, 1)
    rows = torch.arange(batch, dtype=torch.float32).view(-1, 1, 1, 1) / 8
    return (base + rows).expand(batch, heads, len(positions), dim).contiguous()


class Feeder:
    """Feeds positions in chunks to one cache layer and checks what it returns."""

    def __init__(self, cache, layer=0):
        self.cache, self.layer, self.next = cache, layer, 0

    def feed(self, length):
        states = tokens_at(range(self.next, self.next + length))
        keys, values = self.cache.update(states, -states, self.layer)
        self.next += length
        positions = self.cache.key_positions(self.layer)
        assert keys.shape[2] == values.shape[2] == positions.numel()
        assert torch.equal(keys[0, 0, :, 0], positions.float())  # each key is its position
        assert torch.equal(values, -keys)
        return positions.tolist()


def test_standard_layers_keep_everything_in_order():
    feeder = Feeder(LocalCache([LayerCacheSpec()]))
    for length in [3, 1, 300, 1, 2]:
        expected = list(range(feeder.next + length))
        assert feeder.feed(length) == expected
    assert feeder.cache.get_seq_length() == 307


def test_a_rotating_layer_follows_mlx_lm():
    """window 4, keep 2: max_size 6. Expected sets worked by hand from
    mlx-lm's cache.py (see local_cache.RotatingLayerCache)."""
    cache = LocalCache([LayerCacheSpec(window=4, keep=2)])
    feeder = Feeder(cache)
    steps = [
        (3, [0, 1, 2]),
        (1, [0, 1, 2, 3]), (1, [0, 1, 2, 3, 4]), (1, [0, 1, 2, 3, 4, 5]),
        (1, [0, 1, 3, 4, 5, 6]),                 # full: the oldest non-sink overwritten
        (5, [0, 1, 4, 5, 6] + list(range(7, 12))),  # sinks + max_size - 1 + all new
        (1, [0, 1, 9, 10, 11, 12]),              # trimmed back to max_size, then the ring
        (1, [0, 1, 10, 11, 12, 13]),
        (2, [0, 1, 11, 12, 13, 14, 15]),
        (1, [0, 1, 13, 14, 15, 16]),
    ]
    for length, expected in steps:
        assert feeder.feed(length) == expected, (length, feeder.next)
    layer = cache.layers[0]
    assert layer.meta_state == (2, 6, 17, 3)
    # mlx-lm's state is the ring as it lies: the newest went to slot keep (2)
    # after the 7 tokens the 2-token update left were trimmed to 6.
    ring = layer.state[0][0, 0, :, 0].tolist()
    assert ring == [0, 1, 16, 13, 14, 15]


def test_a_first_update_longer_than_the_window_is_kept_whole():
    feeder = Feeder(LocalCache([LayerCacheSpec(window=3, keep=0)]))
    assert feeder.feed(10) == list(range(10))
    assert feeder.feed(1) == [8, 9, 10]


@pytest.mark.parametrize("window, keep", [(1, 0), (3, 0), (4, 2), (5, 4), (2, 4)])
def test_a_rotating_layer_holds_every_key_its_mask_needs(window, keep):
    """Whatever the chunking, the returned keys include, for every query of
    the update, the sinks and the window behind it (and on a single-token
    update nothing more than the sinks and the window)."""
    generator = torch.Generator().manual_seed(window * 10 + keep)
    feeder = Feeder(LocalCache([LayerCacheSpec(window=window, keep=keep)]))
    for _ in range(40):
        length = int(torch.randint(1, 2 * (window + keep) + 2, (1,), generator=generator))
        first = feeder.next
        held = set(feeder.feed(length))
        for query in range(first, first + length):
            needed = {k for k in range(query + 1) if query - k < window or k < keep}
            assert needed <= held, (query, sorted(needed - held))
        if length == 1:
            assert len(held) <= window + keep


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_storage_dtype_rounds_in_the_cache(dtype):
    cache = LocalCache([LayerCacheSpec(), LayerCacheSpec(window=2, keep=1)], dtype=dtype)
    states = torch.randn(2, 2, 5, 4, generator=torch.Generator().manual_seed(1))
    for layer in range(2):
        keys, values = cache.update(states, states * 2, layer)
        assert keys.dtype == values.dtype == dtype
        assert torch.equal(keys, states.to(dtype)) and torch.equal(values, (states * 2).to(dtype))


def test_crop_like_dynamic_cache():
    cache = LocalCache([LayerCacheSpec(), LayerCacheSpec(window=8, keep=2)])
    feeders = [Feeder(cache, 0), Feeder(cache, 1)]
    for feeder in feeders:
        feeder.feed(5)
    cache.crop(3)
    assert [cache.get_seq_length(i) for i in range(2)] == [3, 3]
    cache.crop(-1)  # drops one more
    cache.crop(10)  # longer than held: nothing happens
    assert cache.get_seq_length() == 2
    for feeder in feeders:
        feeder.next = 2
        assert feeder.feed(2) == [0, 1, 2, 3]
        assert feeder.feed(1) == [0, 1, 2, 3, 4]


def test_crop_refuses_a_filled_rotating_layer_and_changes_nothing():
    cache = LocalCache([LayerCacheSpec(), LayerCacheSpec(window=2, keep=1)])
    feeders = [Feeder(cache, 0), Feeder(cache, 1)]
    for feeder in feeders:
        feeder.feed(4)
    with pytest.raises(ValueError, match="layer 1 .* has filled"):
        cache.crop(2)
    assert [cache.get_seq_length(i) for i in range(2)] == [4, 4]
    cache.crop(4)  # nothing to drop: allowed
    with pytest.raises(ValueError, match="window has filled"):
        cache.layers[1].crop(1)


def test_reorder_cache_fans_out_and_permutes_rows():
    cache = LocalCache([LayerCacheSpec(), LayerCacheSpec(window=2, keep=1)])
    states = tokens_at(range(3), batch=2)
    for layer in range(2):
        cache.update(states, states, layer)
    assert cache.batch_size == 2
    cache.reorder_cache(torch.tensor([1, 1, 0]))
    assert cache.batch_size == 3
    for layer in range(2):
        keys, _ = cache.keys_values(layer)
        assert keys[:, 0, 0, 0].tolist() == [1 / 8, 1 / 8, 0.0]
    with pytest.raises(ValueError, match="beam_idx"):
        cache.reorder_cache(torch.tensor([3]))


def test_bad_updates_are_refused():
    cache = LocalCache([LayerCacheSpec()])
    with pytest.raises(ValueError, match=r"\[B, H, L, D\]"):
        cache.update(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), 0)
    with pytest.raises(ValueError, match="layer_idx 1"):
        cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 1)
    cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)
    with pytest.raises(ValueError, match="do not match"):
        cache.update(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4), 0)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        LocalCache([LayerCacheSpec()], dtype=torch.float64)
    with pytest.raises(ValueError, match="keep < max_size"):
        RotatingLayerCache(max_size=2, keep=2)


def test_the_cache_never_aliases_the_callers_tensors():
    """The ring is written in place on later updates: the first update's
    tensors must have been copied, not adopted."""
    cache = LocalCache([LayerCacheSpec(window=2, keep=0)])
    first = tokens_at(range(3))
    kept = first.clone()
    cache.update(first, first, 0)
    for position in range(3, 8):
        cache.update(tokens_at([position]), tokens_at([position]), 0)
    assert torch.equal(first, kept)


def test_local_cache_is_a_kv_cache():
    from kvcached.models import KVCache, ModelCache

    cache = LocalCache([LayerCacheSpec()])
    assert isinstance(cache, KVCache) and isinstance(cache, ModelCache)
