"""Client against the real kvcached on loopback, over gRPC and over the data
lane: bytes round trip exactly, bad input gets the documented status codes,
handles are released, and every page is back on the free list after each test."""

import grpc
import numpy as np
import pytest

import kvcached
from kvcached import specs
from kvcached.dtypes import DType
from kvcached_process import Kvcached

HEADS, DIM = 2, 8
WINDOW, SINKS = 8, 4  # the rotating layer's


@pytest.fixture(scope="module")
def server(kvcached_path):
    process = Kvcached(kvcached_path)
    yield process
    assert process.stop() == 0, "".join(process.log)


def assert_nothing_held(client):
    """Every cache, snapshot and page released; what is left is cleaned up
    (so one failing test does not fail the next) and reported."""
    stats = client.get_stats()
    held = (stats.caches, stats.snapshots, stats.pages_used)
    if held != (0, 0, 0):
        for cache in client.list_caches():
            client.delete_cache(cache.cache_id)
        for snapshot in client.list_snapshots():
            client.release_snapshot(snapshot.snapshot_id)
    assert held == (0, 0, 0), "caches, snapshots, pages still held"


@pytest.fixture(params=["grpc", "lane"])
def client(request, server):
    lane = request.param == "lane"
    with kvcached.Client(address=server.address, data_lane="auto" if lane else "",
                         deadline=30, keepalive_time=0) as connected:
        assert connected.uses_data_lane() == lane
        yield connected
        assert_nothing_held(connected)


class Mirror:
    """What each layer should hold: keys and values [1, H, T, D] and positions."""

    def __init__(self, kinds):
        self.kinds = kinds
        empty = np.empty((1, HEADS, 0, DIM), np.float16)
        self.keys, self.values = [empty] * len(kinds), [empty] * len(kinds)
        self.positions = [[] for _ in kinds]
        self.offsets = [0] * len(kinds)

    def append(self, layer, keys, values):
        tokens = keys.shape[2]
        self.keys[layer] = np.concatenate([self.keys[layer], keys], axis=2)
        self.values[layer] = np.concatenate([self.values[layer], values], axis=2)
        self.positions[layer] += list(range(self.offsets[layer], self.offsets[layer] + tokens))
        self.offsets[layer] += tokens
        if self.kinds[layer] == "rotating" and len(self.positions[layer]) > WINDOW:
            # One token at a time past the window: the sinks, then the recent rest.
            keep = list(range(SINKS)) + list(range(len(self.positions[layer]) - WINDOW + SINKS,
                                                   len(self.positions[layer])))
            self.keys[layer] = self.keys[layer][:, :, keep]
            self.values[layer] = self.values[layer][:, :, keep]
            self.positions[layer] = [self.positions[layer][i] for i in keep]


def three_layer_spec():
    return specs.cache_spec([specs.standard(HEADS, DIM), specs.standard(HEADS, DIM),
                             specs.rotating(HEADS, DIM, max_size=WINDOW, keep=SINKS)],
                            dtype=DType.FLOAT16, model="python-client-test")


def step(rng, tokens, dtype=np.float16, heads=HEADS, dim=DIM, batch=1):
    shape = (batch, heads, tokens, dim)
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)


def stream_steps(client, cache_id, mirror, rng, step_tokens):
    updates = []
    for tokens in step_tokens:
        for layer in range(len(mirror.kinds)):
            keys, values = step(rng, tokens)
            mirror.append(layer, keys, values)
            updates.append(kvcached.LayerUpdate(layer, keys, values))
    acks = client.update_many(cache_id, updates)
    assert [ack.offset for ack in acks][-len(mirror.kinds):] == mirror.offsets


def positions(history):
    return [p for begin, end in history.ranges for p in range(begin, end)]


def assert_holds(client, cache_id, mirror, **where):
    for layer in range(len(mirror.kinds)):
        got = client.fetch(cache_id, layer, max_chunk_tokens=3, **where)
        assert positions(got) == mirror.positions[layer], "layer %d" % layer
        assert got.keys.tobytes() == mirror.keys[layer].tobytes(), "layer %d keys" % layer
        assert got.values.tobytes() == mirror.values[layer].tobytes(), "layer %d values" % layer


def test_updates_fetch_back_byte_for_byte(client):
    rng = np.random.default_rng(1)
    mirror = Mirror(["standard", "standard", "rotating"])
    with client.new_cache(three_layer_spec()) as cache:
        stream_steps(client, cache.id, mirror, rng, [6] + [1] * 9)
        assert list(cache.refresh().layer_offsets) == [15, 15, 15]
        assert_holds(client, cache.id, mirror)
        assert mirror.positions[2] == [0, 1, 2, 3, 11, 12, 13, 14]
        # A range of one layer, and every layer at once into arrays of the caller's.
        ranged = client.fetch(cache.id, 0, start=2, end=7, max_chunk_tokens=2)
        assert positions(ranged) == [2, 3, 4, 5, 6]
        assert ranged.keys.tobytes() == np.ascontiguousarray(mirror.keys[0][:, :, 2:7]).tobytes()
        out = {layer: (np.zeros((1, HEADS, 20, DIM), np.float16),
                       np.zeros((1, HEADS, 20, DIM), np.float16)) for layer in range(3)}
        got = client.fetch_layers(cache.id, out=out, max_chunk_tokens=4)
        for layer in range(3):
            assert np.shares_memory(got[layer].keys, out[layer][0])
            assert got[layer].values.tobytes() == mirror.values[layer].tobytes()


@pytest.mark.parametrize("dtype, numpy_type", [(DType.FLOAT32, np.float32),
                                               (DType.FLOAT16, np.float16),
                                               (DType.BFLOAT16, np.uint16)])
def test_each_dtype_round_trips_in_default_chunks(client, dtype, numpy_type):
    rng = np.random.default_rng(2)
    heads, dim, tokens = 4, 64, 700  # f32: 700 KiB per tensor, more than one default chunk
    spec = specs.cache_spec([specs.standard(heads, dim)], dtype=dtype, batch_size=2)
    bits = rng.integers(0, 1 << 16, size=(2, heads, tokens, dim), dtype=np.uint16)
    if numpy_type == np.uint16:
        keys, values = bits, bits[:, :, ::-1].copy()
    else:
        keys, values = step(rng, tokens, numpy_type, heads, dim, batch=2)
    with client.new_cache(spec) as cache:
        assert client.update(cache.id, 0, keys, values).offset == tokens
        got = client.fetch(cache.id, 0)
        assert got.keys.dtype == keys.dtype and got.keys.shape == keys.shape
        assert got.keys.tobytes() == keys.tobytes() and got.values.tobytes() == values.tobytes()
        out = (np.empty_like(keys), np.empty_like(values))
        client.fetch(cache.id, 0, out=out)
        assert out[0].tobytes() == keys.tobytes() and out[1].tobytes() == values.tobytes()


def test_torch_tensors_go_and_come_back(client):
    torch = pytest.importorskip("torch")
    spec = specs.cache_spec([specs.standard(HEADS, DIM)], dtype=DType.BFLOAT16)
    keys = torch.randn(1, HEADS, 5, DIM, dtype=torch.bfloat16)
    values = torch.randn(1, HEADS, 5, DIM, dtype=torch.bfloat16)
    with client.new_cache(spec) as cache:
        client.update(cache.id, 0, keys, values)
        out = (torch.empty_like(keys), torch.empty_like(values))
        got = client.fetch(cache.id, 0, out=out)
        assert torch.equal(got.keys, keys) and torch.equal(out[1], values)


def test_unknown_ids_are_not_found(client):
    keys, values = step(np.random.default_rng(3), 1)
    for call in (lambda: client.get_cache("0" * 32),
                 lambda: client.update("0" * 32, 0, keys, values),
                 lambda: client.fetch("0" * 32, 0),
                 lambda: client.release_snapshot("0" * 32)):
        with pytest.raises(kvcached.KvCacheError) as missing:
            call()
        assert missing.value.code == grpc.StatusCode.NOT_FOUND


def test_bad_updates_name_the_field_and_change_nothing(client):
    rng = np.random.default_rng(4)
    mirror = Mirror(["standard", "standard", "rotating"])
    with client.new_cache(three_layer_spec()) as cache:
        stream_steps(client, cache.id, mirror, rng, [3])
        keys, values = step(rng, 2)
        bad = {"layer": dict(layer=7, keys=keys, values=values),
               "keys.dtype": dict(layer=0, keys=keys.astype(np.float32),
                                  values=values.astype(np.float32)),
               "keys.shape[1]": dict(layer=0, keys=keys[:, :1].copy(), values=values),
               "values.shape[3]": dict(layer=0, keys=keys, values=values[..., :4].copy())}
        for field, update in bad.items():
            with pytest.raises(kvcached.KvCacheError) as refused:
                client.update(cache.id, **update)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, field
            assert refused.value.message.startswith(field), refused.value.message
        empty = keys[:, :, :0]
        with pytest.raises(kvcached.KvCacheError) as no_tokens:
            client.update(cache.id, 0, empty, empty)
        assert no_tokens.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert no_tokens.value.message.startswith("keys.shape[2]")
        with pytest.raises(kvcached.KvCacheError) as behind:
            client.update(cache.id, 0, keys, values, expected_offset=1)
        assert behind.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert behind.value.message.startswith("expected_offset")
        with pytest.raises(TypeError):  # refused before anything is sent
            client.update_many(cache.id, [kvcached.LayerUpdate(0, keys, values),
                                          kvcached.LayerUpdate(1, keys, values.astype(np.float32))])
        assert list(client.get_cache(cache.id).layer_offsets) == [3, 3, 3]
        assert_holds(client, cache.id, mirror)  # the same connection serves on


def test_a_bad_spec_is_invalid_argument(client):
    spec = specs.cache_spec([specs.standard(HEADS, DIM)], dtype=DType.UNSPECIFIED)
    with pytest.raises(kvcached.KvCacheError) as refused:
        client.create_cache(spec)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "dtype" in refused.value.message


def test_snapshots_restore_split_merge_and_trim(client):
    rng = np.random.default_rng(5)
    mirror = Mirror(["standard", "standard"])
    spec = specs.cache_spec([specs.standard(HEADS, DIM)] * 2)
    with client.new_cache(spec) as cache:
        stream_steps(client, cache.id, mirror, rng, [10])
        snapshot = client.snapshot(cache.id)
        assert (snapshot.from_offset, snapshot.to_offset) == (0, 10)
        at_ten = [list(mirror.positions[0]), mirror.keys[0].copy(), mirror.values[0].copy()]
        stream_steps(client, cache.id, mirror, rng, [4])
        split = client.split_snapshot(snapshot.snapshot_id, 6)
        assert (split.parent.to_offset, split.child.from_offset) == (6, 6)
        merged = client.merge_snapshots(split.parent.snapshot_id, split.child.snapshot_id)
        assert (merged.from_offset, merged.to_offset) == (0, 10)
        with kvcached.Snapshot(client, merged) as handle:
            restored = client.restore(cache.id, 10, snapshot_id=handle.id)
            assert list(restored.layer_offsets) == [10, 10]
            got = client.fetch(cache.id, 0, snapshot_id=handle.id)
            assert got.keys.tobytes() == at_ten[1].tobytes()
        assert client.fetch(cache.id, 1).values.tobytes() == mirror.values[1][:, :, :10].tobytes()
        trimmed = client.trim(cache.id, 3)
        assert (trimmed.trimmed, trimmed.cache.offset) == (3, 7)
        assert client.fetch(cache.id, 0).keys.tobytes() == at_ten[1][:, :, :7].tobytes()
        with pytest.raises(kvcached.KvCacheError) as consumed:
            client.release_snapshot(split.parent.snapshot_id)
        assert consumed.value.code == grpc.StatusCode.NOT_FOUND


def test_speculation_drafts_then_commits_or_aborts(client):
    rng = np.random.default_rng(6)
    spec = specs.cache_spec([specs.standard(HEADS, DIM)])
    with client.new_cache(spec) as cache:
        base = step(rng, 4)
        client.update(cache.id, 0, *base)
        draft = step(rng, 3)
        with client.speculation(cache.id) as speculation:
            assert speculation.committed_offset == 4
            client.update("", 0, *draft, speculation_id=speculation.id)
            view = client.fetch("", 0, speculation_id=speculation.id)
            assert view.keys.tobytes() == np.concatenate([base[0], draft[0]], axis=2).tobytes()
            assert client.get_cache(cache.id).offset == 4
            assert speculation.commit(2).offset == 6
        kept = client.fetch(cache.id, 0)
        assert kept.keys.tobytes() == np.concatenate([base[0], draft[0][:, :, :2]],
                                                     axis=2).tobytes()
        with pytest.raises(RuntimeError):
            with client.speculation(cache.id) as speculation:
                client.update(cache.id, 0, *step(rng, 2), speculation_id=speculation.id)
                raise RuntimeError("the draft model failed")
        assert client.get_cache(cache.id).offset == 6  # aborted on the way out


def test_prefixes_publish_lookup_and_unpublish(client):
    rng = np.random.default_rng(7)
    spec = specs.cache_spec([specs.standard(HEADS, DIM)], model="prefix-test")
    tokens = list(range(100, 140))
    with client.new_cache(spec) as cache:
        client.update(cache.id, 0, *step(rng, len(tokens)))
        with client.new_snapshot(cache.id) as snapshot:
            published = client.publish_prefix(snapshot.id, tokens)
        hit = client.lookup_prefix(tokens[:30] + [1, 2, 3], spec=spec)
        assert hit.matched_tokens == 30
        with kvcached.Snapshot(client, hit.snapshot):
            entries = client.list_prefixes()
            assert [entry.snapshot.snapshot_id for entry in entries] == [
                published.entry.snapshot_id]
        assert client.lookup_prefix([9, 9], cache_id=cache.id).matched_tokens == 0
    client.release_snapshot(published.entry.snapshot_id)  # unpublishes it
    assert client.list_prefixes() == []


def test_leases_and_pins(client):
    spec = specs.cache_spec([specs.standard(HEADS, DIM)])
    with client.new_cache(spec, ttl_seconds=600) as cache:
        client.update(cache.id, 0, *step(np.random.default_rng(8), 2))
        with client.new_snapshot(cache.id, ttl_seconds=600) as snapshot:
            renewed = client.renew_lease([cache.id], [snapshot.id])
            assert [lease.ttl_seconds for lease in renewed.caches] == [600]
            assert client.set_pinned(snapshot.id, True).pinned
            assert client.get_stats().pinned_bytes > 0
            assert not client.set_pinned(snapshot.id, False).pinned
        with pytest.raises(kvcached.KvCacheError) as unknown:
            client.renew_lease([cache.id, "0" * 32])
        assert unknown.value.code == grpc.StatusCode.NOT_FOUND


def test_health_and_stats(client):
    assert client.serving()
    stats = client.get_stats()
    assert stats.page_bytes == 8192 and stats.pages_total > 0
    assert stats.data_lane_address.startswith("127.0.0.1:")


def test_a_recurrent_layers_state_round_trips(client):
    rng = np.random.default_rng(9)
    spec = specs.cache_spec([specs.recurrent(conv_tail=3, conv_dim=16, num_v_heads=2,
                                             head_v_dim=4, head_k_dim=4)], dtype=DType.FLOAT32)
    conv = rng.standard_normal((1, 3, 16)).astype(np.float32)
    delta = rng.standard_normal((1, 2, 4, 4)).astype(np.float32)
    with client.new_cache(spec) as cache:
        state = kvcached.RecurrentStateUpdate(conv, delta, advance=5)
        assert client.update(cache.id, 0, state=state).offset == 5
        got = client.fetch_state(cache.id, 0)
        assert got.conv_state.data == conv.tobytes()
        assert got.delta_state.data == delta.tobytes()
        with pytest.raises(kvcached.KvCacheError) as not_tokens:
            client.fetch(cache.id, 0)
        assert not_tokens.value.code == grpc.StatusCode.INVALID_ARGUMENT
        keys, values = step(rng, 1, np.float32)
        with pytest.raises(kvcached.KvCacheError) as refused:
            client.update(cache.id, 0, keys, values)
        assert refused.value.message.startswith("keys")


def test_a_quantized_layer_fetches_packed_and_dequantized(client):
    rng = np.random.default_rng(10)
    spec = specs.cache_spec([specs.quantized(HEADS, 64, group_size=64, bits=8)])
    keys, values = step(rng, 5, dim=64)
    with client.new_cache(spec) as cache:
        client.update(cache.id, 0, keys, values)
        chunks = client.fetch_packed(cache.id, 0)
        assert sum(chunk.packed_keys.wq.shape[2] for chunk in chunks) == 5
        assert list(chunks[0].packed_keys.wq.shape[-1:]) == [64 * 8 // 32]
        assert chunks[0].packed_values.bits == 8 and chunks[0].packed_values.group_size == 64
        dequantized = client.fetch(cache.id, 0)
        # mlx affine 8-bit: within half a step of a group's range (about 6 / 255 here).
        np.testing.assert_allclose(dequantized.keys.astype(np.float32),
                                   keys.astype(np.float32), atol=0.05)


def test_large_updates_and_fetches(client):
    rng = np.random.default_rng(13)
    heads, dim, tokens = 8, 128, 4096  # 8 MiB keys and 8 MiB values in one update
    spec = specs.cache_spec([specs.standard(heads, dim)])
    keys, values = step(rng, tokens, heads=heads, dim=dim)
    with client.new_cache(spec) as cache:
        assert client.update(cache.id, 0, keys, values).offset == tokens
        out = (np.empty_like(keys), np.empty_like(values))
        got = client.fetch(cache.id, 0, out=out)
        assert got.ranges == [(0, tokens)]
        assert out[0].tobytes() == keys.tobytes() and out[1].tobytes() == values.tobytes()


def test_a_request_id_is_answered_once(client):
    spec = specs.cache_spec([specs.standard(HEADS, DIM)])
    request_id = kvcached.new_request_id()
    first = client.create_cache(spec, request_id=request_id)
    again = client.create_cache(spec, request_id=request_id)  # a retry: the same answer
    assert again.cache_id == first.cache_id
    assert len(client.list_caches()) == 1
    with pytest.raises(kvcached.KvCacheError) as reused:
        client.create_cache(specs.cache_spec([specs.standard(4, DIM)]), request_id=request_id)
    assert reused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert reused.value.message.startswith("request_id")
    client.delete_cache(first.cache_id)


def test_batch_rows_extract_filter_and_merge(client):
    rng = np.random.default_rng(14)
    spec = specs.cache_spec([specs.standard(HEADS, DIM)], batch_size=2)
    keys, values = step(rng, 6, batch=2)
    with client.new_cache(spec) as batch:
        client.update(batch.id, 0, keys, values)
        with kvcached.Cache(client, client.extract_row(batch.id, 1)) as row:
            assert client.fetch(row.id, 0).keys.tobytes() == keys[1:2].tobytes()
            with kvcached.Cache(client, client.merge_caches([row.id, row.id])) as merged:
                assert merged.info.spec.batch_size == 2
                got = client.fetch(merged.id, 0)
                assert got.values.tobytes() == np.concatenate([values[1:2]] * 2).tobytes()
        assert client.filter_rows(batch.id, [1]).spec.batch_size == 1
        assert client.fetch(batch.id, 0).keys.tobytes() == keys[1:2].tobytes()
