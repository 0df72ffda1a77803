"""Update and Fetch over gRPC, with the tensors kept out of protobuf.

grpcio hands a serializer's bytes to the core as one buffer, so an update is
joined once from its pieces (update_encoding.py) where protobuf would copy
each tensor twice; a fetched chunk arrives as the message's bytes and its
tensors are copied once, into the caller's arrays (wire.read_token_chunk).
"""

import queue
import threading
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import grpc

from . import wire
from .errors import KvCacheError, from_rpc_error
from .proto import pb
from .update_encoding import LayerUpdate, Piece, encode_update, join

UPDATE_METHOD = "/kvcache.v1.KvCacheService/Update"
FETCH_METHOD = "/kvcache.v1.KvCacheService/Fetch"

Metadata = Tuple[Tuple[str, str], ...]


def _same_bytes(message: bytes) -> bytes:
    return message


def chunk_error(error: wire.WireError) -> KvCacheError:
    """A chunk that could not be read: the call's error, whichever transport."""
    if isinstance(error, wire.NotATokenChunk):
        return KvCacheError(grpc.StatusCode.INVALID_ARGUMENT,
                            "the chunks hold no [B, H, L, D] keys and values (a recurrent "
                            "layer: fetch_state; packed quantized tensors: fetch_packed)")
    return KvCacheError(grpc.StatusCode.DATA_LOSS, "a Fetch chunk: %s" % error)


class GrpcBulk:
    """Update streams and Fetch calls on one channel."""

    def __init__(self, channel: grpc.Channel, deadline: float, metadata: Metadata) -> None:
        self._update = channel.stream_stream(UPDATE_METHOD, request_serializer=_same_bytes,
                                             response_deserializer=pb.UpdateResponse.FromString)
        self._fetch = channel.unary_stream(FETCH_METHOD,
                                           request_serializer=pb.FetchRequest.SerializeToString,
                                           response_deserializer=_same_bytes)
        self._deadline = deadline
        self._metadata = metadata

    def fetch(self, request: pb.FetchRequest, place: wire.Placer) -> None:
        """Every chunk of `request`, its tensors where `place` says."""
        call = self._fetch(request, timeout=self._deadline, metadata=self._metadata)
        try:
            for message in call:
                wire.read_token_chunk(wire.MemorySource(message), len(message), place)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        except wire.WireError as error:
            call.cancel()
            raise chunk_error(error) from None
        except BaseException:
            call.cancel()  # a placer's refusal (out too small): no more chunks wanted
            raise

    def fetch_messages(self, request: pb.FetchRequest,
                       on_chunk: Callable[[pb.FetchResponse], None]) -> None:
        """Every chunk of `request` parsed whole by protobuf (states, packed tensors)."""
        call = self._fetch(request, timeout=self._deadline, metadata=self._metadata)
        try:
            for message in call:
                on_chunk(pb.FetchResponse.FromString(message))
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def update_many(self, encoded: Sequence[List[Piece]]) -> List[pb.UpdateResponse]:
        """Encoded updates (update_encoding.encode_update) in one call; their
        acknowledgements. Joined one by one as gRPC takes them, the
        acknowledgements read on this thread: no queue and no reader thread
        between them, which cost GrpcUpdateStream more than half its throughput."""
        call = self._update((join(pieces) for pieces in encoded), timeout=self._deadline,
                            metadata=self._metadata)
        try:
            return list(call)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def open_update(self, cache_id: str) -> "GrpcUpdateStream":
        """A new Update call for `cache_id`."""
        return GrpcUpdateStream(self._update, cache_id, self._deadline, self._metadata)


_END = None  # the request queue's end marker


class GrpcUpdateStream:
    """An Update call: write() queues a request (its tensors joined into the
    message before it returns), a reader thread collects the acknowledgements,
    finish() ends the call and returns them or raises the first failure."""

    def __init__(self, method: Callable, cache_id: str, deadline: float,
                 metadata: Metadata) -> None:
        self._cache_id = cache_id
        self._requests: "queue.Queue[Optional[bytes]]" = queue.Queue()
        self._call = method(iter(self._requests.get, _END), timeout=deadline, metadata=metadata)
        self.acknowledged: List[pb.UpdateResponse] = []
        self._error: Optional[KvCacheError] = None
        self._reader = threading.Thread(target=self._read_acks, daemon=True)
        self._reader.start()
        self._closed = False

    def _read_acks(self) -> None:
        try:
            for ack in self._call:
                self.acknowledged.append(ack)
        except grpc.RpcError as error:
            self._error = from_rpc_error(error)

    def write(self, update: LayerUpdate) -> None:
        """Sends one layer's step; raises the call's error once it has failed."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ValueError("the Update stream is finished")
        self._requests.put(join(encode_update(self._cache_id, update)))

    def write_many(self, updates: Iterable[LayerUpdate]) -> None:
        """write() of each update, in order."""
        for update in updates:
            self.write(update)

    def finish(self) -> List[pb.UpdateResponse]:
        """Ends the call: every acknowledgement, or the first failure."""
        if not self._closed:
            self._closed = True
            self._requests.put(_END)
        self._reader.join()
        if self._error is not None:
            raise self._error
        return list(self.acknowledged)

    def cancel(self) -> None:
        """Abandons the call (requests not yet applied are dropped)."""
        self._closed = True
        self._call.cancel()
        self._requests.put(_END)
