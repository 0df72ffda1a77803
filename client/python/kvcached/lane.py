"""Update and Fetch over the data lane (kvcache.proto, LaneFrameKind).

A LanePool keeps connections between calls and decides, as the C++
client's does (client/lane_client.cc), whether the lane is used at all:
ClientOptions.data_lane "" never, host:port always (no fallback), "auto"
when the server advertises a lane (Stats.data_lane_address) that answers.

    Update:  UPDATE* UPDATE_END  ->  UPDATE_ACK* STATUS
    Fetch:   FETCH               ->  [FETCH_LENGTH] FETCH_CHUNK* STATUS
"""

import ssl
import tempfile
import threading
from typing import Callable, Iterable, List, Optional

import grpc

from . import frames, wire
from .errors import KvCacheError, from_lane_status
from .grpc_bulk import chunk_error
from .lane_socket import LaneClosed, LaneSocket, split_host_port
from .options import ClientOptions, pem_bytes
from .proto import pb
from .update_encoding import LayerUpdate, Piece, encode_update

# Sends between two looks for acknowledgements: the server batches them, and
# a few sends' worth is far below what the socket buffers hold, so neither
# side blocks on the other (a look after every send would mostly find none).
WRITES_PER_ACK_POLL = 8
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def reachable(lane_address: str, grpc_address: str) -> str:
    """A lane address advertised with a wildcard host means the host the
    client reaches the server at already (that of the gRPC address)."""
    try:
        host, port = split_host_port(lane_address)
        grpc_host, _ = split_host_port(grpc_address)
    except ValueError:
        return lane_address
    if host not in _WILDCARD_HOSTS:
        return lane_address
    return ("[%s]:%d" if ":" in grpc_host else "%s:%d") % (grpc_host, port)


def lane_tls_context(options: ClientOptions) -> Optional[ssl.SSLContext]:
    """The lane's TLS (TLS 1.3, the channel's certificates); None for plaintext."""
    if not options.tls:
        return None
    roots = pem_bytes(options.tls_root_certs_pem)
    context = ssl.create_default_context(cadata=roots.decode("ascii") if roots else None)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    cert, key = pem_bytes(options.tls_client_cert_pem), pem_bytes(options.tls_client_key_pem)
    if cert:
        # ssl loads a certificate chain from files only: a private temporary one.
        with tempfile.NamedTemporaryFile() as cert_file, tempfile.NamedTemporaryFile() as key_file:
            cert_file.write(cert)
            key_file.write(key or b"")
            cert_file.flush()
            key_file.flush()
            context.load_cert_chain(cert_file.name, key_file.name if key else None)
    return context


class LanePool:
    """The lane's connections, kept between calls, and whether to use it."""

    def __init__(self, options: ClientOptions, ask_server: Callable[[], str]) -> None:
        self._options = options
        self._ask_server = ask_server  # the lane address the server advertises
        self._tls = lane_tls_context(options)
        self._lock = threading.Lock()
        self._address: Optional[str] = None  # resolved; "" when off
        self._idle: List[LaneSocket] = []

    def enabled(self) -> bool:
        """Whether update and fetch go over the lane (resolves "auto" once)."""
        with self._lock:
            return bool(self._resolved_address())

    def _resolved_address(self) -> Optional[str]:
        """The lane's address; "" when off (call with the lock held)."""
        if self._address is None:
            self._address = self._resolve()
        return self._address

    def _resolve(self) -> Optional[str]:
        setting = self._options.data_lane
        if setting != "auto":
            return setting
        try:
            advertised = self._ask_server()
        except KvCacheError:
            return None  # asked again next time
        if not advertised:
            return ""
        address = reachable(advertised, self._options.address)
        try:
            self._idle.append(self._open(address))
        except (KvCacheError, ValueError):
            return ""  # a lane that does not answer: gRPC from now on
        return address

    def _open(self, address: str) -> LaneSocket:
        keepalive = None
        if self._options.keepalive_time > 0:
            keepalive = (self._options.keepalive_time, self._options.keepalive_timeout)
        lane = LaneSocket.connect(address, self._options.deadline, self._tls,
                                  self._options.tls_server_name, keepalive)
        if self._options.token:
            try:
                lane.authenticate(self._options.token)
            except BaseException:
                lane.close()
                raise
        return lane

    def take(self) -> LaneSocket:
        """An idle connection the server has not closed since, or a new one."""
        with self._lock:
            while self._idle:
                lane = self._idle.pop()
                if not lane.has_input():  # between calls a live one is quiet
                    return lane
                lane.close()
            address = self._resolved_address()
        if not address:
            raise KvCacheError(grpc.StatusCode.FAILED_PRECONDITION,
                               "data lane: off (ClientOptions.data_lane)")
        return self._open(address)

    def give(self, lane: LaneSocket) -> None:
        """A connection whose call ended cleanly, for the next call."""
        lane.reused = True
        with self._lock:
            self._idle.append(lane)

    def close(self) -> None:
        """Closes the idle connections (calls under way keep theirs)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for lane in idle:
            lane.close()


class LaneUpdateStream:
    """An Update call on one lane connection (as GrpcUpdateStream's surface)."""

    def __init__(self, pool: LanePool, cache_id: str) -> None:
        self._pool = pool
        self._cache_id = cache_id
        self._lane = pool.take()
        self.acknowledged: List[pb.UpdateResponse] = []
        self._frames_sent = 0
        self._end: Optional[KvCacheError] = None  # the call's failure, once read
        self._ended = False  # its STATUS, or the connection's end, was read
        self._clean = True  # ended as the protocol says: the connection is reusable
        self._finished = False

    def write(self, update: LayerUpdate) -> None:
        """Sends one layer's step (copied by the kernel before this returns);
        raises the call's error once it has failed."""
        self.write_encoded(encode_update(self._cache_id, update))

    def write_encoded(self, pieces: List[Piece]) -> None:
        """write() of an update encoded already (update_encoding.encode_update)."""
        if self._finished:
            raise ValueError("the Update stream is finished")
        if self._ended:
            self.finish()  # raises the server's answer
            raise KvCacheError(grpc.StatusCode.DATA_LOSS,
                               "data lane: the server ended the Update call before UPDATE_END")
        try:
            self._lane.send_frame(frames.FrameKind.UPDATE, pieces)
        except LaneClosed:
            self._read_acks(wait=True)  # the server's STATUS says why, where it sent one
            self.finish()
            raise
        self._frames_sent += 1
        if self._frames_sent % WRITES_PER_ACK_POLL == 0:
            self._read_acks(wait=False)
            if self._ended:
                self.finish()  # raises the server's refusal

    def write_many(self, updates: Iterable[LayerUpdate]) -> None:
        """write() of each update, in order."""
        for update in updates:
            self.write(update)

    def _read_acks(self, wait: bool) -> None:
        """Takes the acknowledgements that arrived (wait: all, up to the STATUS)."""
        while not self._ended and (wait or self._lane.has_input()):
            try:
                header = self._lane.read_header()
                payload = self._lane.read_exact(header.length)
            except LaneClosed as closed:
                self._end_with(closed, clean=False)
                return
            if header.kind == frames.FrameKind.UPDATE_ACK:
                self.acknowledged.append(pb.UpdateResponse.FromString(payload))
            elif header.kind == frames.FrameKind.STATUS:
                status = pb.LaneStatus.FromString(payload)
                failure = from_lane_status(status.code, status.message) if status.code else None
                self._end_with(failure, clean=True)
            else:
                self._end_with(KvCacheError(grpc.StatusCode.DATA_LOSS,
                                            "data lane: a frame of kind %d in an Update call"
                                            % header.kind), clean=False)

    def _end_with(self, error: Optional[KvCacheError], clean: bool) -> None:
        self._end, self._ended, self._clean = error, True, clean

    def finish(self) -> List[pb.UpdateResponse]:
        """Ends the call: every acknowledgement, or the first failure (the
        requests before it stay applied; `acknowledged` lists them)."""
        if not self._finished:
            self._finished = True
            self._close_call()
        if self._end is not None:
            raise self._end
        return list(self.acknowledged)

    def _close_call(self) -> None:
        if self._frames_sent == 0 and not self._ended:
            self._pool.give(self._lane)  # nothing was sent: nothing to end
            return
        try:
            # Always sent, also after an early STATUS: the server skips this
            # call's frames until it, and the connection stays usable.
            self._lane.send_frame(frames.FrameKind.UPDATE_END, [])
        except LaneClosed:
            self._clean = False
        self._read_acks(wait=True)
        if self._clean:
            self._pool.give(self._lane)
        else:
            self._lane.close()

    def cancel(self) -> None:
        """Abandons the call: the connection is closed, not reused (a
        finished call's connection is the pool's again: left alone)."""
        if self._finished:
            return
        self._finished = True
        self._lane.shutdown()
        self._lane.close()


class _FetchProgress:
    """A Fetch's chunk bytes against the length its server announced."""

    def __init__(self) -> None:
        self.announced: Optional[int] = None
        self.received = 0

    def announce(self, payload: bytes) -> None:
        if self.announced is not None or self.received:
            raise KvCacheError(grpc.StatusCode.DATA_LOSS,
                               "data lane: a misplaced FETCH_LENGTH frame")
        self.announced = pb.LaneFetchLength.FromString(payload).chunk_frame_bytes

    def count(self, length: int) -> None:
        self.received += frames.HEADER_BYTES + length
        if self.announced is not None and self.received > self.announced:
            raise KvCacheError(grpc.StatusCode.DATA_LOSS,
                               "data lane: the Fetch's chunks ran past the %d bytes announced"
                               % self.announced)

    def kept(self) -> bool:
        return self.announced is None or self.received == self.announced


# Reads one FETCH_CHUNK frame's payload of the given length from the lane.
ChunkReader = Callable[[LaneSocket, int], None]


def placing_chunks(place: wire.Placer) -> ChunkReader:
    """Token chunks whose tensors go where `place` says, as they arrive."""
    def read(lane: LaneSocket, length: int) -> None:
        try:
            wire.read_token_chunk(lane, length, place)
        except wire.WireError as error:
            raise chunk_error(error) from None
    return read


def message_chunks(on_chunk: Callable[[pb.FetchResponse], None]) -> ChunkReader:
    """Chunks parsed whole by protobuf (recurrent states, packed tensors)."""
    def read(lane: LaneSocket, length: int) -> None:
        on_chunk(pb.FetchResponse.FromString(lane.read_exact(length)))
    return read


def _fetch_on(lane: LaneSocket, request: pb.FetchRequest, read_chunk: ChunkReader,
              progress: _FetchProgress) -> bytes:
    """One Fetch call on `lane`: each chunk read as it arrives; the STATUS payload."""
    lane.send_message(frames.FrameKind.FETCH, request)
    try:
        return _read_fetch(lane, read_chunk, progress)
    finally:
        lane.expect(0)  # nothing more is promised on this connection


def _read_fetch(lane: LaneSocket, read_chunk: ChunkReader, progress: _FetchProgress) -> bytes:
    """A Fetch's frames up to its STATUS (whose payload it returns)."""
    while True:
        if progress.announced is not None:
            lane.expect(progress.announced - progress.received)
        header = lane.read_header()
        if header.kind == frames.FrameKind.FETCH_LENGTH:
            progress.announce(lane.read_exact(header.length))
        elif header.kind == frames.FrameKind.FETCH_CHUNK:
            progress.count(header.length)
            read_chunk(lane, header.length)
        elif header.kind == frames.FrameKind.STATUS:
            return lane.read_exact(header.length)
        else:
            raise KvCacheError(grpc.StatusCode.DATA_LOSS,
                               "data lane: a frame of kind %d in a Fetch" % header.kind)


def lane_fetch(pool: LanePool, request: pb.FetchRequest, read_chunk: ChunkReader) -> None:
    """Every chunk of `request` over the lane, each to `read_chunk`.

    Sent once more on a fresh connection where a kept one turns out closed
    before any chunk arrived (a Fetch is safe to repeat)."""
    for attempt in (0, 1):
        lane = pool.take()
        progress = _FetchProgress()
        try:
            status = _fetch_on(lane, request, read_chunk, progress)
        except LaneClosed:
            lane.close()
            if attempt == 0 and lane.reused and not progress.received:
                continue
            raise
        except BaseException:
            lane.close()  # mid-frame: the connection cannot serve another call
            raise
        if progress.kept():
            pool.give(lane)
        else:
            lane.close()
        LaneSocket.raise_status(status)
        return
