"""One data-lane connection: its socket (TLS or not), preamble, AUTH frame,
frames out from many buffers at once, and bytes in straight into arrays.

Sending: a frame is its 8-byte header and the pieces of its payload, handed
to the kernel in one sendmsg over memoryviews, so tensor bytes are copied
once, by the kernel, from the caller's arrays. An ssl socket has no
sendmsg; it encrypts each piece as it sends it (encrypting is a copy anyway).

Receiving: small reads (frame headers, protobuf tags) go through a buffer
that reads a little ahead; bulk reads (tensor data) drain what the buffer
holds, then recv_into the destination itself. The read-ahead is kept small
so that few tensor bytes pass through the buffer.
"""

import select
import socket
import ssl
from typing import List, Optional, Sequence, Tuple, Union

import grpc
from google.protobuf.message import Message

from . import frames, wire
from .errors import KvCacheError, from_lane_status
from .proto import pb

Piece = Union[bytes, memoryview]

# How far small reads read ahead: a chunk's header is about 40 bytes.
READ_AHEAD_BYTES = 256
# The most buffers one sendmsg takes (Linux's IOV_MAX).
IOV_MAX = 1024
# Bulk reads of at least LOW_WATER_FLOOR bytes first wait until that many
# (at most LOW_WATER_CAP) have arrived: SO_RCVLOWAT, which the poll() inside
# a socket with a timeout honours, so the reader wakes once per tensor rather
# than once per arriving segment. On loopback each wake-up also costs the
# sending side an inter-processor interrupt; woken per segment, this client
# fetched at a third of the C++ client's rate (protos/wire/lane/frame_reader.cc
# does the same). Only on sockets with a timeout: a blocking recv measures the
# mark against bytes not yet copied, and could sleep for ever.
LOW_WATER_FLOOR = 32 << 10
LOW_WATER_CAP = 1 << 20


class LaneClosed(KvCacheError):
    """The server closed the connection (or it broke) in the middle of a read."""

    def __init__(self, message: str = "data lane: the server closed the connection") -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


def split_host_port(address: str) -> Tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError("data lane address %r is not host:port" % address)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _set_keepalive(sock: socket.socket, idle: float, timeout: float) -> None:
    """TCP keepalive: probes after `idle` s of silence, dropped after `timeout` more."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    interval = max(1, int(timeout // 3) or 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(idle)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, int(timeout // interval)))


class LaneSocket:
    """A connected lane socket whose preamble the server answered."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.reused = False  # it served a call before the current one
        self._buffer = bytearray()
        self._at = 0  # bytes of _buffer already read
        self._low_water = 1  # the socket's SO_RCVLOWAT (1: the kernel's default)
        self._taken = 0  # bytes consumed since the connection opened
        self._promised_end = 0  # _taken once every byte promised by expect() is consumed
        self._may_wait_for_more = not self.tls and sock.gettimeout() is not None
        # Bulk bytes (read_into) that came through the read-ahead buffer rather
        # than straight from the socket: a copy each, so they should stay few.
        self.bulk_bytes_buffered = 0

    @classmethod
    def connect(cls, address: str, timeout: float, tls: Optional[ssl.SSLContext] = None,
                server_name: str = "", keepalive: Optional[Tuple[float, float]] = None
                ) -> "LaneSocket":
        """A connection to `address` whose KVLANE02 preamble was answered in kind."""
        host, port = split_host_port(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if keepalive is not None:
                _set_keepalive(sock, *keepalive)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=server_name or host)
        except ssl.SSLError as error:
            raise KvCacheError(grpc.StatusCode.UNAVAILABLE, "data lane %s: TLS handshake "
                               "failed: %s" % (address, error)) from None
        except OSError as error:
            raise KvCacheError(grpc.StatusCode.UNAVAILABLE,
                               "data lane %s: %s" % (address, error)) from None
        lane = cls(sock)
        try:
            lane.send([frames.MAGIC])
            lane._read_preamble_answer()
        except BaseException:
            lane.close()
            raise
        return lane

    def _read_preamble_answer(self) -> None:
        try:
            answer = self.read_exact(len(frames.MAGIC))
        except LaneClosed:
            raise LaneClosed("data lane: the server closed the connection without answering "
                             "its KVLANE02 preamble (not a lane of this version, or one that "
                             "expects TLS)") from None
        if answer == frames.MAGIC:
            return
        header = frames.decode_header(answer)  # a server that refuses says why in a STATUS
        if header.kind == frames.FrameKind.STATUS and header.length <= 64 << 10:
            status = pb.LaneStatus.FromString(self.read_exact(header.length))
            if status.code:
                raise from_lane_status(status.code, status.message)
        raise KvCacheError(grpc.StatusCode.DATA_LOSS,
                           "data lane: the server answered KVLANE02 with other bytes")

    def authenticate(self, token: str) -> None:
        """Sends the AUTH frame and reads the server's STATUS (raised unless OK)."""
        self.send_message(frames.FrameKind.AUTH, pb.LaneAuth(token=token))
        header = self.read_header()
        if header.kind != frames.FrameKind.STATUS:
            raise KvCacheError(grpc.StatusCode.DATA_LOSS,
                               "data lane: the server answered AUTH with a frame of kind %d"
                               % header.kind)
        self.raise_status(self.read_exact(header.length))

    # Sending.

    def send(self, pieces: Sequence[Piece]) -> None:
        """Sends the pieces' bytes in order, from where they lie."""
        views = [memoryview(piece).cast("B") for piece in pieces if len(piece)]
        try:
            if self.tls:
                for view in views:
                    self.sock.sendall(view)
                return
            while views:
                sent = self.sock.sendmsg(views[:IOV_MAX])
                views = _advance(views, sent)
        except socket.timeout:
            raise KvCacheError(grpc.StatusCode.DEADLINE_EXCEEDED, "data lane: a send timed out") \
                from None
        except OSError as error:
            raise LaneClosed("data lane: sending failed: %s" % error) from None

    def send_frame(self, kind: int, pieces: Sequence[Piece]) -> None:
        """One frame: its header, then the pieces as its payload."""
        length = sum(len(piece) for piece in pieces)
        if length > frames.MAX_PAYLOAD_BYTES:
            raise KvCacheError(grpc.StatusCode.INVALID_ARGUMENT,
                               "%d bytes is over the data lane's 4 GiB frame" % length)
        self.send([frames.encode_header(length, kind), *pieces])

    def send_message(self, kind: int, message: Message) -> None:
        """One frame whose payload is a protobuf message (a small one: it is serialised)."""
        self.send_frame(kind, [message.SerializeToString()])

    # Receiving (wire.ByteSource).

    def expect(self, size: int) -> None:
        """Promises that the next `size` bytes will come (a Fetch's announced
        chunks): small reads then wait until that many (up to LOW_WATER_CAP)
        have arrived, waking once where they would wake once per frame."""
        self._promised_end = self._taken + size

    def _fill(self, wanted: int) -> None:
        """Buffers at least `wanted` bytes."""
        if self._at and self._at * 2 >= len(self._buffer):
            del self._buffer[:self._at]  # drop what was read before growing
            self._at = 0
        while len(self._buffer) - self._at < wanted:
            unread = len(self._buffer) - self._at
            promised = self._promised_end - self._taken - unread
            self._set_low_water(max(wanted - unread, promised))
            data = self._recv(max(READ_AHEAD_BYTES, wanted - unread))
            self._buffer += data

    def _recv(self, size: int) -> bytes:
        try:
            data = self.sock.recv(size)
        except socket.timeout:
            raise KvCacheError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               "data lane: no answer within the deadline") from None
        except OSError as error:
            raise LaneClosed("data lane: reading failed: %s" % error) from None
        if not data:
            raise LaneClosed()
        return data

    def read_exact(self, size: int) -> bytes:
        """The next `size` bytes, through the read-ahead buffer (for small reads)."""
        self._fill(size)
        data = bytes(self._buffer[self._at:self._at + size])
        self._at += size
        self._taken += size
        return data

    def read_into(self, view: memoryview) -> None:
        """The next len(view) bytes into `view`: what the buffer holds, then
        straight from the socket (recv_into)."""
        self.read_into_many([view])

    def read_into_many(self, views: Sequence[memoryview]) -> None:
        """The next bytes into each view in turn: what the buffer holds, then
        straight from the socket, every view at once (recvmsg_into: a fetch
        into a [B, H, T, D] array fills B x H row pieces per tensor, and a
        syscall each cost as much as their bytes)."""
        self._taken += sum(len(view) for view in views)
        rest = self._drain_buffer(list(views))
        if self.tls:  # an ssl socket has no recvmsg_into
            for view in rest:
                self._receive(view, lambda piece: self.sock.recv_into(piece))
            return
        left = sum(len(view) for view in rest)
        while rest:
            # These bytes, and those promised after them: with a Fetch's
            # promise the mark stays at the cap, set once rather than per read.
            self._set_low_water(left + max(0, self._promised_end - self._taken))
            got = self._receive_once(lambda: self.sock.recvmsg_into(rest[:IOV_MAX])[0])
            rest = _advance(rest, got)
            left -= got

    def _set_low_water(self, left: int) -> None:
        """SO_RCVLOWAT for a read of `left` more bytes (see LOW_WATER_FLOOR)."""
        mark = min(left, LOW_WATER_CAP) if left >= LOW_WATER_FLOOR else 1
        if mark == self._low_water or not self._may_wait_for_more:
            return
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
            self._low_water = mark
        except OSError:
            self._may_wait_for_more = False  # a socket that refuses: read as it comes

    def _drain_buffer(self, views: List[memoryview]) -> List[memoryview]:
        """Fills views from the read-ahead buffer; the (parts of) views left."""
        first = 0
        while first < len(views) and self._at < len(self._buffer):
            view = views[first]
            buffered = min(len(view), len(self._buffer) - self._at)
            view[:buffered] = self._buffer[self._at:self._at + buffered]
            self._at += buffered
            self.bulk_bytes_buffered += buffered
            if buffered < len(view):
                views[first] = view[buffered:]
                break
            first += 1
        return [view for view in views[first:] if len(view)]

    def _receive(self, view: memoryview, recv_into) -> None:
        """All of `view` from the socket, by recv_into(rest of view) calls."""
        done = 0
        while done < len(view):
            done += self._receive_once(lambda: recv_into(view[done:]))

    @staticmethod
    def _receive_once(receive) -> int:
        """receive()'s byte count; the lane's errors for a timeout, a failure or the end."""
        try:
            got = receive()
        except socket.timeout:
            raise KvCacheError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               "data lane: no answer within the deadline") from None
        except OSError as error:
            raise LaneClosed("data lane: reading failed: %s" % error) from None
        if not got:
            raise LaneClosed()
        return got

    def peek(self, size: int) -> bytes:
        """The next `size` bytes (wire.ByteSource), buffered and not consumed:
        the caller knows they are on their way (they lie inside a frame)."""
        self._fill(size)
        return bytes(self._buffer[self._at:self._at + size])

    def consume(self, size: int) -> None:
        """Drops `size` buffered bytes (what peek returned)."""
        self._at += size
        self._taken += size

    def read_varint(self, max_bytes: int) -> Tuple[int, int]:
        """The next varint (wire.ByteSource): (value, bytes it took), decoded
        in one go from the read-ahead buffer, reading more only where it ends
        inside the varint."""
        while True:
            try:
                value, taken = wire.decode_varint(self._buffer, self._at, max_bytes)
            except IndexError:
                self._fill(len(self._buffer) - self._at + 1)
                continue
            self._at += taken
            self._taken += taken
            return value, taken

    def read_header(self) -> frames.FrameHeader:
        """The next frame's header."""
        return frames.decode_header(self.read_exact(frames.HEADER_BYTES))

    @staticmethod
    def raise_status(payload: bytes) -> None:
        """A STATUS frame's payload: returns on OK, raises its error otherwise."""
        status = pb.LaneStatus.FromString(payload)
        if status.code:
            raise from_lane_status(status.code, status.message)

    def has_input(self) -> bool:
        """Whether bytes (or the connection's end) wait to be read, without waiting."""
        if len(self._buffer) > self._at or (self.tls and self.sock.pending()):
            return True
        self._set_low_water(1)  # select() too honours the mark: one byte is input
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True  # a broken socket: the read will tell
        return bool(readable)

    def close(self) -> None:
        """Closes the socket (errors in closing are of no interest)."""
        try:
            self.sock.close()
        except OSError:
            pass

    def shutdown(self) -> None:
        """Wakes any read or send under way (they fail) and ends the connection."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _advance(views: List[memoryview], sent: int) -> List[memoryview]:
    """The views left after `sent` bytes of them went out."""
    first = 0
    while first < len(views) and sent >= len(views[first]):
        sent -= len(views[first])
        first += 1
    rest = views[first:]
    if rest and sent:
        rest[0] = rest[0][sent:]
    return rest
