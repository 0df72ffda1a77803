"""KvcachedCache (adapters/transformers_cache.py) against kvcached: random
sequences of update / crop / reorder_cache return exactly what a reference
cache holds (positions and bytes), in both modes and every dtype, with
rotating layers that keep sinks; kvcached's fetched bytes equal it too.
Beams share pages, speculation commits what it accepts, bad input gets the
C++ client's statuses, and every test leaves nothing held."""

import copy
import random

import grpc
import pytest
import torch

import kvcached
from kvcached.adapters import AUTHORITATIVE, WRITE_THROUGH, KvcachedCache
from kvcached.dtypes import DType
from kvcached.models.cache_protocol import LayerCacheSpec
from kvcached.models.local_cache import LocalCache
from adapter_support import server  # noqa: F401 (a fixture of its tests)
from adapter_support import client_fixture
from adapter_support import (TORCH_OF, ReferenceLayer, assert_nothing_held, connect, held, kv,
                             layer_history, spec_of)

HEADS, DIM = 2, 4
# Standard; rotating with 2 sinks and room to crop for a while; rotating without sinks.
LAYERS = [(0, 0), (24, 2), (6, 0)]
MODES = [WRITE_THROUGH, AUTHORITATIVE]
DTYPES = [DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16]


client = client_fixture("lane", "grpc")


@pytest.fixture
def lane_client(server):
    with connect(server.address, True) as connected:
        yield connected
        assert_nothing_held(connected)


def layer_cache_specs(layers):
    """py-models' LayerCacheSpecs of (max_size, keep) layers: window = max_size - keep."""
    return [LayerCacheSpec(window=m - k, keep=k) if m else LayerCacheSpec() for m, k in layers]


class Run:
    """A KvcachedCache, py-models' LocalCache and the reference layers, stepped together."""

    def __init__(self, cache, dtype, seed, layers=LAYERS):
        self.cache, self.dtype = cache, TORCH_OF[dtype]
        self.shape = layers
        self.layers = [ReferenceLayer(m, k) for m, k in layers]
        self.local = LocalCache(layer_cache_specs(layers), self.dtype)
        self.generator = torch.Generator().manual_seed(seed)
        self.batch = 1

    def step(self, tokens):
        for index, layer in enumerate(self.layers):
            keys, values = kv(self.generator, self.batch, HEADS, tokens, DIM)
            got_keys, got_values = self.cache.update(keys, values, index)
            layer.update(keys.to(self.dtype), values.to(self.dtype))
            self.check_returned(index, got_keys, got_values)
            if self.local is not None:  # None once a test drives the layers by hand
                local_keys, local_values = self.local.update(keys, values, index)
                assert torch.equal(got_keys, local_keys)
                assert torch.equal(got_values, local_values)
                assert torch.equal(self.cache.key_positions(index),
                                   self.local.key_positions(index))

    def check_returned(self, index, got_keys, got_values):
        layer = self.layers[index]
        assert self.cache.key_positions(index).tolist() == layer.held, "layer %d" % index
        want_keys, want_values = layer.tensors()
        assert got_keys.dtype == self.dtype
        assert torch.equal(got_keys, want_keys) and torch.equal(got_values, want_values)
        assert self.cache.get_seq_length(index) == layer.offset

    def check_drafted(self, index, got_keys, got_values, draft):
        """While drafting: the committed layer plus the drafted tokens as one update."""
        view = copy.deepcopy(self.layers[index])
        view.update(*draft)
        assert self.cache.key_positions(index).tolist() == view.held
        want_keys, want_values = view.tensors()
        assert torch.equal(got_keys, want_keys) and torch.equal(got_values, want_values)

    def crop(self, tokens):
        offset = self.layers[0].offset
        if all(not m or offset < m for m, _ in self.shape):
            self.cache.crop(max(0, offset - tokens))
            self.local.crop(max(0, offset - tokens))
            for layer in self.layers:
                layer.cut(min(tokens, offset))
        else:
            with pytest.raises(ValueError):
                self.cache.crop(offset - tokens)
            with pytest.raises(ValueError):
                self.local.crop(offset - tokens)
        assert self.cache.get_seq_length() == self.layers[0].offset

    def reorder(self, rng):
        rows = rng.choice([1, 2, 3])
        self.reorder_to(torch.tensor([rng.randrange(self.batch) for _ in range(rows)]))

    def reorder_to(self, index):
        self.cache.reorder_cache(index)
        self.local.reorder_cache(index)
        for layer in self.layers:
            layer.rows(index)
        self.batch = int(index.shape[0])

    def check_kvcached(self, client):
        self.cache.flush()
        assert len(self.cache.cache_ids()) == self.batch
        for row, cache_id in enumerate(self.cache.cache_ids()):
            for index, layer in enumerate(self.layers):
                positions, keys, values = layer_history(client, cache_id, index)
                assert positions == layer.held, "row %d layer %d" % (row, index)
                want_keys, want_values = layer.tensors()
                assert torch.equal(keys, want_keys[row:row + 1])
                assert torch.equal(values, want_values[row:row + 1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_random_updates_crops_and_reorders_match_the_reference(client, mode, dtype):
    rng = random.Random("%s-%s" % (mode, dtype.name))
    with KvcachedCache(client, spec_of(LAYERS, HEADS, DIM, dtype), mode=mode,
                       ack_every_steps=3) as cache:
        run = Run(cache, dtype, seed=int(dtype))
        for _ in range(36):
            choice = rng.random()
            if choice < 0.7 or run.layers[0].offset == 0:
                run.step(rng.choice([1, 1, 1, 2, 3, 9]))
            elif choice < 0.85:
                run.crop(rng.randint(1, 3))
            else:
                run.reorder(rng)
        run.step(1)  # never empty at the end
        run.check_kvcached(client)


@pytest.mark.parametrize("mode", MODES)
def test_speculation_commits_what_it_accepts_and_abort_drops_all(lane_client, mode):
    layers = [(0, 0), (8, 2)]
    with KvcachedCache(lane_client, spec_of(layers, HEADS, DIM, DType.FLOAT16),
                       mode=mode) as cache:
        run = Run(cache, DType.FLOAT16, seed=5, layers=layers)
        run.step(7)
        committed = copy.deepcopy(run.layers)
        run.local = None  # LocalCache has no speculation: the reference layers judge
        cache.begin_speculation()
        drafts = []
        for index in range(len(layers)):  # one verify pass of 4 drafted tokens
            keys, values = kv(run.generator, 1, HEADS, 4, DIM)
            drafts.append((keys.to(torch.float16), values.to(torch.float16)))
            run.check_drafted(index, *cache.update(keys, values, index), drafts[-1])
        cache.commit_speculation(2)
        run.layers = committed
        for layer, (keys, values) in zip(run.layers, drafts):
            layer.update(keys[:, :, :2], values[:, :, :2])
        assert cache.get_seq_length() == 9
        run.step(1)
        cache.begin_speculation()
        before = copy.deepcopy(run.layers)
        for index in range(len(layers)):
            cache.update(*kv(run.generator, 1, HEADS, 3, DIM), index)
        cache.abort_speculation()
        run.layers = before
        assert cache.get_seq_length() == 10
        run.step(2)
        run.check_kvcached(lane_client)


def test_beams_share_pages_until_they_write(lane_client):
    layers = [(0, 0), (0, 0)]
    with KvcachedCache(lane_client, spec_of(layers, HEADS, DIM, DType.FLOAT32)) as cache:
        run = Run(cache, DType.FLOAT32, seed=6, layers=layers)
        run.step(40)  # 16-token pages: 3 per layer, the last one partly filled
        pages = held(lane_client)[2]
        assert pages == 2 * 3
        run.reorder_to(torch.tensor([0, 0, 0]))
        assert held(lane_client)[2] == pages, "three beams on the same pages"
        run.step(1)  # each beam writes its own token: copy-on-write of the last page only
        cache.flush()
        assert held(lane_client)[2] <= pages + 2 * 3
        run.reorder_to(torch.tensor([2, 2]))
        run.step(3)
        run.check_kvcached(lane_client)
    assert held(lane_client)[:3] == (0, 0, 0)


def test_crop_of_a_filled_window_is_refused_and_changes_nothing(lane_client):
    layers = [(0, 0), (6, 2)]
    with KvcachedCache(lane_client, spec_of(layers, HEADS, DIM, DType.FLOAT16)) as cache:
        run = Run(cache, DType.FLOAT16, seed=7, layers=layers)
        run.step(4)
        run.crop(2)  # allowed: the window has not filled
        run.step(5)
        with pytest.raises(ValueError):
            cache.crop(3)
        assert cache.get_seq_length() == 7
        cache.flush()
        # kvcached itself refuses as the C++ client sees it.
        with pytest.raises(kvcached.KvCacheError) as refused:
            lane_client.trim(cache.cache_ids()[0], 1)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "cannot be trimmed" in refused.value.message
        run.step(1)
        run.check_kvcached(lane_client)


def test_bad_input_gets_the_cpp_clients_statuses(lane_client):
    spec = spec_of([(0, 0), (8, 4)], HEADS, DIM, DType.FLOAT16)
    bad = kvcached.pb.CacheSpec()
    bad.CopyFrom(spec)
    bad.layers[0].num_kv_heads = 0
    with KvcachedCache(lane_client, bad) as cache:  # created at the first update, or:
        with pytest.raises(kvcached.KvCacheError) as refused:
            cache.ensure_rows(1)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.message.startswith("spec.layers[0].num_kv_heads") or \
            "layers[0].num_kv_heads" in refused.value.message
    bad.CopyFrom(spec)
    bad.layers[1].rotating.keep = 8
    with pytest.raises(kvcached.KvCacheError) as refused:
        KvcachedCache(lane_client, bad).ensure_rows(1)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "layers[1].rotating.keep" in refused.value.message
    with KvcachedCache(lane_client, spec) as cache:
        cache.update(*kv(torch.Generator(), 1, HEADS, 2, DIM), 0)
        # Three heads where the spec has two: refused here before anything is sent...
        with pytest.raises(ValueError):
            cache.update(*kv(torch.Generator(), 1, 3, 2, DIM), 1)
        assert cache.get_seq_length(1) == 0
        # ...and by kvcached where the adapter's pipelined stream carries it: seen
        # at the next flush, as the C++ client's Update sees it.
        keys, values = kv(torch.Generator(), 1, 3, 2, DIM)
        cache.rows[0].send(1, 0, keys.half(), values.half())
        with pytest.raises(kvcached.KvCacheError) as refused:
            cache.flush()
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.message.startswith("keys.shape[1]")
    with pytest.raises(kvcached.KvCacheError) as missing:
        KvcachedCache.attach(lane_client, spec, ["0" * 32])
    assert missing.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(ValueError):
        KvcachedCache(lane_client, spec, mode="write_back")


def refused(call, code, field):
    with pytest.raises(kvcached.KvCacheError) as error:
        call()
    assert error.value.code == code, error.value
    assert field in error.value.message, error.value


def test_bad_snapshot_fetch_and_speculation_input_gets_the_cpp_clients_statuses(lane_client):
    spec = spec_of([(0, 0), (0, 0), (8, 4)], HEADS, DIM, DType.FLOAT16)
    with KvcachedCache(lane_client, spec) as cache:
        run = Run(cache, DType.FLOAT16, seed=8, layers=[(0, 0), (0, 0), (8, 4)])
        run.step(5)
        cache.flush()
        row = cache.rows[0]
        code = grpc.StatusCode
        snapshot = row.snapshot()
        try:
            refused(lambda: lane_client.snapshot(row.id, from_offset=5),
                    code.FAILED_PRECONDITION, "from_offset")
            refused(lambda: lane_client.restore(row.id, 6), code.FAILED_PRECONDITION,
                    "beyond the live offset")
            refused(lambda: lane_client.restore(row.id, 6, snapshot_id=snapshot.snapshot_id),
                    code.FAILED_PRECONDITION, "beyond the snapshot's end")
            refused(lambda: lane_client.restore("0" * 32, 1), code.NOT_FOUND, "cache_id")
        finally:
            lane_client.release_snapshot(snapshot.snapshot_id)
        refused(lambda: lane_client.fetch(row.id, 3), code.INVALID_ARGUMENT, "layers[0]")
        refused(lambda: lane_client.fetch("0" * 32, 0), code.NOT_FOUND, "cache_id")
        refused(lambda: lane_client.begin_speculation("0" * 32), code.NOT_FOUND, "cache_id")
        cache.begin_speculation()
        cache.update(*kv(torch.Generator(), 1, HEADS, 2, DIM), 0)
        cache.flush()
        spec_id = row.speculation_id
        refused(lambda: lane_client.commit_speculation(spec_id, 3), code.INVALID_ARGUMENT,
                "accepted")
        refused(lambda: lane_client.commit_speculation(spec_id, 1), code.FAILED_PRECONDITION,
                "")  # layers out of step: only layer 0 drafted
        cache.abort_speculation()
        refused(lambda: lane_client.abort_speculation(spec_id), code.NOT_FOUND,
                "speculation_id")
        run.local = None
        run.step(1)
        run.check_kvcached(lane_client)
