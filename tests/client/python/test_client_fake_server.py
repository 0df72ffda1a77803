"""Client against an in-process gRPC servicer written here: what goes on the
wire (request ids, token, tensors) and what comes back (acks, chunks,
errors, handles released) over gRPC, without kvcached."""

from concurrent import futures

import grpc
import numpy as np
import pytest

import kvcached
from kvcached.proto import pb, pb_grpc


class FakeService(pb_grpc.KvCacheServiceServicer):
    """Two-layer caches of [1, 2, L, 4] f16 tokens, kept as arrays per layer."""

    def __init__(self):
        self.caches = {}  # id -> [layer bytes, layer bytes]
        self.requests = []  # (method, request, metadata)
        self.released = []

    def _record(self, method, request, context):
        self.requests.append((method, request, dict(context.invocation_metadata())))

    def _cache(self, cache_id, context):
        if cache_id not in self.caches:
            context.abort(grpc.StatusCode.NOT_FOUND, "cache_id: no cache %s" % cache_id)
        return self.caches[cache_id]

    def CreateCache(self, request, context):
        self._record("CreateCache", request, context)
        cache_id = "%032x" % (len(self.caches) + 1)
        self.caches[cache_id] = [np.empty((1, 2, 0, 4), np.float16) for _ in range(2)]
        return pb.CacheInfo(cache_id=cache_id, spec=request.spec)

    def DeleteCache(self, request, context):
        self._record("DeleteCache", request, context)
        self._cache(request.cache_id, context)
        del self.caches[request.cache_id]
        return pb.DeleteCacheResponse()

    def GetCache(self, request, context):
        self._cache(request.cache_id, context)
        return pb.CacheInfo(cache_id=request.cache_id)

    def GetStats(self, request, context):
        return pb.Stats(device="fake", data_lane_address="")

    def Snapshot(self, request, context):
        self._record("Snapshot", request, context)
        return pb.SnapshotInfo(snapshot_id="s" * 32, cache_id=request.cache_id)

    def ReleaseSnapshot(self, request, context):
        self.released.append(request.snapshot_id)
        return pb.ReleaseSnapshotResponse()

    def BeginSpeculation(self, request, context):
        return pb.BeginSpeculationResponse(speculation_id="p" * 32, offset=3)

    def AbortSpeculation(self, request, context):
        self.released.append(request.speculation_id)
        return pb.CacheInfo(cache_id="c")

    def Update(self, request_iterator, context):
        for request in request_iterator:
            self._record("Update", request, context)
            layers = self._cache(request.cache_id, context)
            if request.layer >= len(layers):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "layer: %d of 2" % request.layer)
            step = np.frombuffer(request.keys.data, np.float16).reshape(request.keys.shape)
            layers[request.layer] = np.concatenate([layers[request.layer], step], axis=2)
            yield pb.UpdateResponse(layer=request.layer, offset=layers[request.layer].shape[2])

    def Fetch(self, request, context):
        layers = self._cache(request.cache_id, context)
        for layer in request.layers or range(2):
            tokens = layers[layer]
            for start in range(0, tokens.shape[2], 3):  # 3-token chunks
                piece = np.ascontiguousarray(tokens[:, :, start:start + 3])
                tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT16, shape=piece.shape,
                                   data=piece.tobytes())
                yield pb.FetchResponse(layer=layer, start=start, keys=tensor, values=tensor)


@pytest.fixture
def served():
    service = FakeService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_KvCacheServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = kvcached.Client(address="127.0.0.1:%d" % port, data_lane="", token="tok",
                             deadline=10, keepalive_time=0)
    yield service, client
    client.close()
    server.stop(grace=None)


def spec():
    return kvcached.specs.cache_spec([kvcached.specs.standard(2, 4)] * 2)


def test_calls_carry_the_token_and_fresh_request_ids(served):
    service, client = served
    first, second = client.create_cache(spec()), client.create_cache(spec())
    assert first.cache_id != second.cache_id
    creates = [(r, m) for method, r, m in service.requests if method == "CreateCache"]
    assert all(m["authorization"] == "Bearer tok" for _, m in creates)
    ids = [r.request_id for r, _ in creates]
    assert len(set(ids)) == 2 and all(len(i) == 32 for i in ids)
    client.create_cache(spec(), request_id="mine")
    assert service.requests[-1][1].request_id == "mine"


def test_errors_carry_code_and_message(served):
    _, client = served
    with pytest.raises(kvcached.KvCacheError) as missing:
        client.get_cache("0" * 32)
    assert missing.value.code == grpc.StatusCode.NOT_FOUND
    assert "cache_id" in missing.value.message


def test_update_and_fetch_round_trip_over_grpc(served):
    service, client = served
    rng = np.random.default_rng(1)
    cache = client.create_cache(spec())
    steps = [rng.standard_normal((1, 2, n, 4)).astype(np.float16) for n in (5, 1, 2)]
    acks = client.update_many(cache.cache_id, [kvcached.LayerUpdate(0, s, s) for s in steps])
    assert [ack.offset for ack in acks] == [5, 6, 8]
    sent = [r for method, r, _ in service.requests if method == "Update"]
    assert [r.keys.data for r in sent] == [s.tobytes() for s in steps]
    history = client.fetch(cache.cache_id, 0)
    assert history.ranges == [(0, 8)]
    assert history.keys.tobytes() == np.concatenate(steps, axis=2).tobytes()
    out = (np.zeros((1, 2, 8, 4), np.float16), np.zeros((1, 2, 8, 4), np.float16))
    client.fetch(cache.cache_id, 0, out=out)
    assert out[1].tobytes() == np.concatenate(steps, axis=2).tobytes()
    assert client.fetch(cache.cache_id, 1).tokens == 0


def test_a_refused_update_raises_after_the_applied_ones(served):
    _, client = served
    cache = client.create_cache(spec())
    step = np.ones((1, 2, 1, 4), np.float16)
    with pytest.raises(kvcached.KvCacheError) as refused:
        client.update_many(cache.cache_id, [kvcached.LayerUpdate(0, step, step),
                                            kvcached.LayerUpdate(5, step, step)])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "layer" in refused.value.message
    assert client.fetch(cache.cache_id, 0).tokens == 1


def test_handles_are_released_on_error(served):
    service, client = served
    with pytest.raises(RuntimeError):
        with client.new_cache(spec()) as cache:
            with client.new_snapshot(cache.id) as snapshot:
                with client.speculation(cache.id) as speculation:
                    raise RuntimeError("the worker failed")
    assert cache.id not in service.caches
    assert service.released == [speculation.id, snapshot.id]
    assert speculation.committed_offset == 3


def test_a_handle_already_gone_is_not_an_error_on_the_way_out(served):
    _, client = served
    with client.new_cache(spec()) as cache:
        client.delete_cache(cache.id)
    assert cache.released


def test_a_long_lived_update_stream_over_grpc(served):
    service, client = served
    cache = client.create_cache(spec())
    step = np.arange(8, dtype=np.float16).reshape(1, 2, 1, 4)
    stream = client.open_update(cache.cache_id)
    for _ in range(3):
        stream.write(kvcached.LayerUpdate(1, step, step))
    assert [ack.offset for ack in stream.finish()] == [1, 2, 3]
    failing = client.open_update(cache.cache_id)
    failing.write(kvcached.LayerUpdate(9, step, step))
    with pytest.raises(kvcached.KvCacheError) as refused:
        failing.finish()
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_an_update_that_cannot_be_encoded_sends_nothing(served):
    service, client = served
    cache = client.create_cache(spec())
    good = np.ones((1, 2, 1, 4), np.float16)
    with pytest.raises(TypeError):
        client.update_many(cache.cache_id, [kvcached.LayerUpdate(0, good, good),
                                            kvcached.LayerUpdate(0, good, good.astype(np.float32))])
    assert [method for method, _, _ in service.requests].count("Update") == 0
