"""kvcached.Client: the kvcache.v1 API of kvcached in Python's idiom.

    with kvcached.Client(kvcached.ClientOptions(address="127.0.0.1:50051")) as client:
        with client.new_cache(spec) as cache:           # deleted on the way out
            client.update(cache.id, 0, keys, values)     # [B, H, L, D] arrays
            history = client.fetch(cache.id, 0)          # history.keys, history.values

Unary calls are in rpcs.py; update and fetch travel over the data lane where
ClientOptions.data_lane says so (lane.py), else over gRPC (grpc_bulk.py).
Every failure raises KvCacheError with the status code and the server's message.
"""

import dataclasses
import random
import threading
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import grpc

from google.protobuf.message import Message

from .channel import (BACKOFF_MULTIPLIER, INITIAL_BACKOFF_S, MAX_ATTEMPTS, MAX_BACKOFF_S,
                      call_metadata, make_channel)
from .errors import KvCacheError, from_rpc_error
from .fetch import FetchAssembler, LayerAssembler, LayerHistory, OutPair
from .grpc_bulk import GrpcBulk, GrpcUpdateStream
from .handles import Cache, Snapshot, Speculation
from .lane import LanePool, LaneUpdateStream, lane_fetch, message_chunks, placing_chunks
from .options import ClientOptions
from .proto import health_pb, health_pb_grpc, pb, pb_grpc
from .rpcs import UnaryCalls
from .update_encoding import LayerUpdate, RecurrentStateUpdate, encode_update

UpdateStream = Union[GrpcUpdateStream, LaneUpdateStream]

# ImportSnapshot sends the file in pieces below gRPC's default 4 MiB message cap.
IMPORT_CHUNK_BYTES = 1 << 20


def new_request_id() -> str:
    """128 random bits in hex: unique without coordination between clients."""
    return "%032x" % random.SystemRandom().getrandbits(128)


def with_request_id(request: Message) -> Message:
    """`request` with a fresh request_id where its type has one and none is set."""
    fields = request.DESCRIPTOR.fields_by_name
    if "request_id" in fields and not request.request_id:
        request.request_id = new_request_id()
    return request


class Client(UnaryCalls):
    """A connection to one kvcached server (gRPC, and its data lane)."""

    def __init__(self, options: Optional[ClientOptions] = None, **overrides: Any) -> None:
        """Connects lazily: calls wait for the connection as ClientOptions says.
        Keyword arguments override fields of `options` (Client(address=...))."""
        options = options or ClientOptions()
        if overrides:
            options = dataclasses.replace(options, **overrides)
        self.options = options
        self.channel = make_channel(options)
        self._metadata = call_metadata(options)
        self._stub = pb_grpc.KvCacheServiceStub(self.channel)
        self._grpc_bulk = GrpcBulk(self.channel, options.deadline, self._metadata)
        self._lanes = LanePool(options, lambda: self.get_stats().data_lane_address)
        self._connected_once = threading.Event()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Closes the data lane's connections and the channel."""
        self._lanes.close()
        self.channel.close()

    # Connecting.

    def _await_first_connect(self) -> None:
        """Until the channel has connected once, waits up to first_connect_wait
        for it (not past the deadline) before a call is sent."""
        if self._connected_once.is_set():
            return
        wait = min(self.options.first_connect_wait, self.options.deadline)
        if wait <= 0:
            return
        try:
            grpc.channel_ready_future(self.channel).result(timeout=wait)
            self._connected_once.set()
        except grpc.FutureTimeoutError:
            pass  # the call goes out and fails as it will

    def wait_for_ready(self, timeout: float) -> None:
        """Waits until the server answers; KvCacheError(UNAVAILABLE) after `timeout` s."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise KvCacheError(grpc.StatusCode.UNAVAILABLE,
                               "no kvcached answers at %s" % self.options.address) from None
        self._connected_once.set()

    def _unary(self, method: str, request):
        self._await_first_connect()
        sent = with_request_id(request)  # once: every retry of gRPC's carries the same id
        try:
            return getattr(self._stub, method)(sent, timeout=self.options.deadline,
                                               metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def serving(self, service: str = "kvcache.v1.KvCacheService") -> bool:
        """The gRPC health check: True when `service` is SERVING ("" : the server)."""
        self._await_first_connect()
        stub = health_pb_grpc.HealthStub(self.channel)
        try:
            answer = stub.Check(health_pb.HealthCheckRequest(service=service),
                                timeout=self.options.deadline, metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return answer.status == health_pb.HealthCheckResponse.SERVING

    # Handles released by `with`.

    def new_cache(self, spec: pb.CacheSpec, *, ttl_seconds: int = 0) -> Cache:
        """Creates a cache; as a context manager, deletes it on the way out."""
        return Cache(self, self.create_cache(spec, ttl_seconds=ttl_seconds))

    def new_snapshot(self, cache_id: str, *, from_offset: int = 0, pinned: bool = False,
                     ttl_seconds: int = 0) -> Snapshot:
        """Takes a snapshot; as a context manager, releases it on the way out."""
        return Snapshot(self, self.snapshot(cache_id, from_offset=from_offset, pinned=pinned,
                                            ttl_seconds=ttl_seconds))

    def speculation(self, cache_id: str, *, isolated: bool = False) -> Speculation:
        """Opens a speculation; as a context manager, aborts it on the way out
        unless it was committed (or aborted) inside."""
        return Speculation(self, cache_id,
                           self.begin_speculation(cache_id, isolated=isolated))

    # Bulk data.

    def uses_data_lane(self) -> bool:
        """Whether update and fetch go over the data lane (ClientOptions.data_lane)."""
        return self._lanes.enabled()

    def open_update(self, cache_id: str) -> UpdateStream:
        """A long-lived Update call for one cache: write() each layer's step,
        then finish() for the acknowledgements (or the first failure)."""
        if self.uses_data_lane():
            return LaneUpdateStream(self._lanes, cache_id)
        self._await_first_connect()
        return self._grpc_bulk.open_update(cache_id)

    def update_many(self, cache_id: str, updates: Iterable[LayerUpdate]) -> List[pb.UpdateResponse]:
        """Every update in one call, in order; the acknowledgements (layer, offset).

        All are encoded before any is sent, so one that cannot be (a mixed
        dtype, a missing tensor) raises with nothing applied. A failed update
        raises the server's error; those before it stay applied."""
        encoded = [encode_update(cache_id, update) for update in updates]
        if not self.uses_data_lane():
            self._await_first_connect()
            return self._grpc_bulk.update_many(encoded)
        stream = LaneUpdateStream(self._lanes, cache_id)
        try:
            for pieces in encoded:
                stream.write_encoded(pieces)
        except BaseException:
            stream.cancel()
            raise
        return stream.finish()

    def update(self, cache_id: str, layer: int, keys: Any = None, values: Any = None, *,
               state: Optional[RecurrentStateUpdate] = None,
               expected_offset: Optional[int] = None,
               speculation_id: str = "") -> pb.UpdateResponse:
        """One layer's step: keys [B, H, L, Dk] and values [B, H, L, Dv] (numpy
        arrays or torch tensors), or a recurrent layer's state. Returns the
        layer's offset after it."""
        update = LayerUpdate(layer, keys, values, state, expected_offset, speculation_id)
        return self.update_many(cache_id, [update])[0]

    def fetch_layers(self, cache_id: str = "", layers: Sequence[int] = (), *, start: int = 0,
                     end: Optional[int] = None, snapshot_id: str = "", speculation_id: str = "",
                     out: Optional[Mapping[int, OutPair]] = None,
                     max_chunk_tokens: int = 0) -> Dict[int, LayerHistory]:
        """Layers' histories (all layers where `layers` is empty) in
        [start, end), of the live cache, a snapshot or a speculation's view.

        out: per layer, (keys, values) arrays [B, H, T, D] to fetch into, in
        place; each LayerHistory then holds them cut to the tokens fetched."""
        request = pb.FetchRequest(cache_id=cache_id, snapshot_id=snapshot_id, layers=list(layers),
                                  start=start, max_chunk_tokens=max_chunk_tokens,
                                  speculation_id=speculation_id)
        if end is not None:
            request.end = end
        assembler = FetchAssembler(dict(out) if out else None)
        if self.uses_data_lane():
            lane_fetch(self._lanes, request, placing_chunks(assembler))
        else:
            self._await_first_connect()
            self._grpc_bulk.fetch(request, assembler)
        return assembler.results()

    def fetch_chunks(self, request: pb.FetchRequest) -> List[pb.FetchResponse]:
        """Every chunk of `request` as a protobuf message (its tensors copied
        into it): for recurrent states and packed quantized tensors, which
        fetch and fetch_layers do not assemble."""
        chunks: List[pb.FetchResponse] = []
        if self.uses_data_lane():
            lane_fetch(self._lanes, request, message_chunks(chunks.append))
        else:
            self._await_first_connect()
            self._grpc_bulk.fetch_messages(request, chunks.append)
        return chunks

    def fetch_state(self, cache_id: str, layer: int, *,
                    snapshot_id: str = "") -> pb.RecurrentState:
        """A recurrent layer's state (conv_state, delta_state as Tensors)."""
        chunks = self.fetch_chunks(pb.FetchRequest(cache_id=cache_id, snapshot_id=snapshot_id,
                                                   layers=[layer]))
        if len(chunks) != 1 or not chunks[0].HasField("state"):
            raise KvCacheError(grpc.StatusCode.FAILED_PRECONDITION,
                               "layer %d returned no recurrent state (is it recurrent, and set?)"
                               % layer)
        return chunks[0].state

    def fetch_packed(self, cache_id: str, layer: int, *,
                     snapshot_id: str = "") -> List[pb.FetchResponse]:
        """A quantized layer's chunks as stored (packed_keys, packed_values)."""
        return self.fetch_chunks(pb.FetchRequest(cache_id=cache_id, snapshot_id=snapshot_id,
                                                 layers=[layer], packed=True))

    def fetch(self, cache_id: str, layer: int, *, start: int = 0, end: Optional[int] = None,
              snapshot_id: str = "", speculation_id: str = "", out: Optional[OutPair] = None,
              max_chunk_tokens: int = 0) -> LayerHistory:
        """One layer's history in [start, end) (see fetch_layers)."""
        histories = self.fetch_layers(cache_id, [layer], start=start, end=end,
                                      snapshot_id=snapshot_id, speculation_id=speculation_id,
                                      out=None if out is None else {layer: out},
                                      max_chunk_tokens=max_chunk_tokens)
        return histories[layer] if layer in histories else LayerAssembler(layer).result()

    # Whole files (prompt-cache files, streamed).

    def export_snapshot(self, *, name: str = "", snapshot_id: str = "",
                        metadata: Optional[Mapping[str, str]] = None) -> bytes:
        """A saved file's bytes, or a snapshot's encoded on the fly (mlx-lm's layout)."""
        self._await_first_connect()
        request = pb.ExportSnapshotRequest(name=name, snapshot_id=snapshot_id,
                                           metadata=dict(metadata or {}))
        try:
            return b"".join(chunk.data for chunk in self._stub.ExportSnapshot(
                request, timeout=self.options.deadline, metadata=self._metadata))
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def import_snapshot(self, data: bytes, *, name: str = "", pinned: bool = False,
                        ttl_seconds: int = 0, request_id: str = "") -> pb.LoadSnapshotResponse:
        """A new snapshot from a prompt-cache file's bytes (saved as `name` too, if set).

        Sent again from the start, with the same request_id, when UNAVAILABLE
        (gRPC keeps too little of a client stream to retry it itself)."""
        self._await_first_connect()
        first = with_request_id(pb.ImportSnapshotRequest(
            name=name, pinned=pinned, ttl_seconds=ttl_seconds, request_id=request_id))
        deadline = time.monotonic() + self.options.deadline
        return _retry_unavailable(deadline, lambda: self._stub.ImportSnapshot(
            _import_requests(first, memoryview(data)),
            timeout=max(0.0, deadline - time.monotonic()), metadata=self._metadata))


def _import_requests(first: pb.ImportSnapshotRequest, data: memoryview):
    """The ImportSnapshot stream: the options with the first piece, then the rest."""
    request = pb.ImportSnapshotRequest()
    request.CopyFrom(first)
    at = 0
    while True:  # at least one message, so that the options arrive with an empty file
        request.data = bytes(data[at:at + IMPORT_CHUNK_BYTES])
        at += IMPORT_CHUNK_BYTES
        yield request
        if at >= len(data):
            return
        request = pb.ImportSnapshotRequest()


def _retry_unavailable(deadline: float, attempt):
    """attempt() until it is not UNAVAILABLE: at most four tries, with gRPC's
    backoff (a random part of 50 ms, doubling to 1 s), never past `deadline`."""
    backoff = INITIAL_BACKOFF_S
    for tries in range(1, MAX_ATTEMPTS + 1):
        try:
            return attempt()
        except grpc.RpcError as error:
            failure = from_rpc_error(error)
        wait = backoff * random.random()
        if (failure.code != grpc.StatusCode.UNAVAILABLE or tries == MAX_ATTEMPTS
                or time.monotonic() + wait >= deadline):
            raise failure
        time.sleep(wait)
        backoff = min(backoff * BACKOFF_MULTIPLIER, MAX_BACKOFF_S)
