"""Protobuf's wire format, by hand, for the messages that carry tensors.

protobuf would copy a tensor's bytes into a message and again into its
serialised form. Here an UpdateRequest is written as small framing bytes
around views of the caller's arrays (update_encoding.py), and a
FetchResponse is read field by field so that its tensor bytes go straight
into the caller's arrays (read_token_chunk). The bytes are exactly
protobuf's encoding: tag = field << 3 | wire type, then a varint or a
varint length and that many bytes.
"""

import functools
from typing import Callable, List, NamedTuple, Optional, Protocol, Sequence, Tuple, Union

VARINT, LENGTH_DELIMITED = 0, 2
# Protobuf reads tags and lengths of at most 5 bytes, values of at most 10.
_TAG_BYTES, _VALUE_BYTES = 5, 10

# kvcache.v1.Tensor's fields and FetchResponse's (a unit test holds them to the .proto).
TENSOR_DTYPE, TENSOR_SHAPE, TENSOR_DATA = 1, 2, 3
CHUNK_LAYER, CHUNK_START, CHUNK_KEYS, CHUNK_VALUES = 1, 2, 3, 4


class WireError(ValueError):
    """Bytes that are not the message expected (the transport's DATA_LOSS)."""


def encode_varint(value: int) -> bytes:
    """A non-negative integer below 2**64 as a protobuf varint."""
    if not 0 <= value < 1 << 64:
        raise ValueError("a varint holds 0 to 2**64 - 1, not %d" % value)
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_tag(field: int, wire_type: int) -> bytes:
    """A field's tag: its number and wire type, as a varint."""
    return encode_varint(field << 3 | wire_type)


def length_prefix(field: int, length: int) -> bytes:
    """A length-delimited field's tag and length: `length` bytes follow it."""
    return encode_tag(field, LENGTH_DELIMITED) + encode_varint(length)


def tensor_prefix(field: int, dtype: int, shape: Sequence[int], data_bytes: int) -> bytes:
    """Field `field` holding a kvcache.v1.Tensor, up to its data's length prefix.

    The data's `data_bytes` bytes follow on the wire. dtype and shape come
    first (as protobuf writes them: by field number), so that a reader knows
    where the data goes before it arrives."""
    return _tensor_prefix(field, int(dtype), tuple(int(d) for d in shape), data_bytes)


# A worker sends the same few shapes step after step (one token per layer, or
# a prefill's chunk), and building a prefix cost about as much as sending
# a 64 KiB tensor: the prefixes of the shapes seen last are kept.
@functools.lru_cache(maxsize=256)
def _tensor_prefix(field: int, dtype: int, shape: Tuple[int, ...], data_bytes: int) -> bytes:
    header = bytearray()
    if dtype:
        header += encode_tag(TENSOR_DTYPE, VARINT) + encode_varint(dtype)
    if shape:
        packed = b"".join(encode_varint(d) for d in shape)
        header += length_prefix(TENSOR_SHAPE, len(packed)) + packed
    header += length_prefix(TENSOR_DATA, data_bytes)
    return length_prefix(field, len(header) + data_bytes) + bytes(header)


class ByteSource(Protocol):
    """Where a message's bytes come from: memory, or a socket (lane.py)."""

    def read_exact(self, size: int) -> bytes:
        """The next `size` bytes."""

    def read_into(self, view: memoryview) -> None:
        """The next len(view) bytes, written into `view`."""

    def read_into_many(self, views: Sequence[memoryview]) -> None:
        """read_into of each view in turn (a socket fills them in one call)."""

    def read_varint(self, max_bytes: int) -> Tuple[int, int]:
        """The next varint of at most `max_bytes` bytes: (value, bytes it took)."""

    def peek(self, size: int) -> bytes:
        """The next `size` bytes (they must exist), not consumed."""

    def consume(self, size: int) -> None:
        """Drops the next `size` bytes, which peek() returned."""


def decode_varint(data: Union[bytes, bytearray, memoryview], at: int,
                  max_bytes: int) -> Tuple[int, int]:
    """The varint at data[at:] (bytes or bytearray): (value, bytes it took).

    Raises IndexError where data ends inside it (the caller reads more),
    WireError where it runs past `max_bytes` or 64 bits. One loop over the
    bytes in hand: a chunk has some forty varints, and a call per byte
    through the readers cost more than its tensors' copies at 256 KiB."""
    value = 0
    for i in range(max_bytes):
        byte = data[at + i]
        if i == 9 and byte > 1:
            raise WireError("a varint past 64 bits")
        value |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            return value, i + 1
    raise WireError("a varint longer than %d bytes" % max_bytes)


class MemorySource:
    """A ByteSource over bytes already received (a gRPC message)."""

    def __init__(self, data: bytes) -> None:
        self._view = memoryview(data).cast("B")
        self._at = 0

    def _take(self, size: int) -> memoryview:
        if size > len(self._view) - self._at:
            missing = size - (len(self._view) - self._at)
            raise WireError("the message ends %d bytes too soon" % missing)
        piece = self._view[self._at:self._at + size]
        self._at += size
        return piece

    def read_exact(self, size: int) -> bytes:
        """The next `size` bytes (a copy: they are few)."""
        return bytes(self._take(size))

    def read_into(self, view: memoryview) -> None:
        """The next len(view) bytes, copied into `view`."""
        view[:] = self._take(len(view))

    def read_into_many(self, views: Sequence[memoryview]) -> None:
        """read_into of each view in turn."""
        for view in views:
            view[:] = self._take(len(view))

    def peek(self, size: int) -> bytes:
        """The next `size` bytes, not consumed."""
        if size > len(self._view) - self._at:
            raise WireError("the message ends %d bytes too soon"
                            % (size - (len(self._view) - self._at)))
        return bytes(self._view[self._at:self._at + size])

    def consume(self, size: int) -> None:
        """Drops the next `size` bytes."""
        self._take(size)

    def read_varint(self, max_bytes: int) -> Tuple[int, int]:
        """The next varint: (value, bytes it took)."""
        try:
            value, taken = decode_varint(self._view, self._at, max_bytes)
        except IndexError:
            raise WireError("the message ends inside a varint") from None
        self._at += taken
        return value, taken

    @property
    def remaining(self) -> int:
        return len(self._view) - self._at


class _Bounded:
    """Reads a source's next `limit` bytes (a message or a field), no further."""

    def __init__(self, source: ByteSource, limit: int) -> None:
        self._source = source
        self.left = limit

    def _claim(self, size: int) -> None:
        if size > self.left:
            raise WireError("a field runs %d bytes past its message" % (size - self.left))
        self.left -= size

    def read_exact(self, size: int) -> bytes:
        self._claim(size)
        return self._source.read_exact(size)

    def read_into(self, view: memoryview) -> None:
        self._claim(len(view))
        self._source.read_into(view)

    def read_into_many(self, views: Sequence[memoryview]) -> None:
        self._claim(sum(len(view) for view in views))
        self._source.read_into_many(views)

    def peek(self, size: int) -> bytes:
        """Up to `size` of the next bytes (no further than this field), not consumed."""
        return self._source.peek(min(size, self.left))

    def skip(self, size: int) -> None:
        """Consumes `size` bytes peek() returned."""
        self._claim(size)
        self._source.consume(size)

    def varint(self, max_bytes: int = _VALUE_BYTES) -> int:
        # Claimed after the read: a varint running past the field is refused
        # all the same, and the bytes read beyond it belong to a failed call.
        value, taken = self._source.read_varint(min(max_bytes, self.left) or 1)
        self._claim(taken)
        return value

    def tag(self) -> Tuple[int, int]:
        tag = self.varint(_TAG_BYTES)
        return tag >> 3, tag & 7

    def sub(self) -> "_Bounded":
        """The next length-delimited field's body, as a reader of its own."""
        length = self.varint(_TAG_BYTES)
        self._claim(length)
        return _Bounded(self._source, length)


class TensorHeader(NamedTuple):
    """A Tensor's dtype and shape, and how many data bytes it has."""

    dtype: int
    shape: Tuple[int, ...]
    data_bytes: int


# Where a chunk's tensor data goes: given (layer, start, field, header), the
# views to fill in order (their lengths sum to header.data_bytes).
Placer = Callable[[int, int, int, TensorHeader], List[memoryview]]


class NotATokenChunk(WireError):
    """A chunk with fields beyond layer, start, keys and values (a recurrent
    state or packed quantized tensors): `field` is the first such field."""

    def __init__(self, field: int) -> None:
        super().__init__("a Fetch chunk with field %d: not a [B, H, L, D] keys/values chunk"
                         % field)
        self.field = field


# The most bytes a Tensor's fields before its data take, as the server writes
# them (dtype, a packed 4-D shape, the data's tag and length): about 20.
_TENSOR_HEAD_BYTES = 64
_DTYPE_TAG = TENSOR_DTYPE << 3 | VARINT
_SHAPE_TAG = TENSOR_SHAPE << 3 | LENGTH_DELIMITED
_DATA_TAG = TENSOR_DATA << 3 | LENGTH_DELIMITED


def _tensor_head(head: bytes) -> Optional[Tuple[TensorHeader, int]]:
    """The header of a Tensor whose fields up to its data's length all lie in
    `head`, in the order protobuf writes them (dtype, packed shape, data),
    and how many bytes they took; None for any other layout, which the
    general reader then takes field by field."""
    try:
        dtype, dims, at = 0, [], 0
        tag, taken = decode_varint(head, at, _TAG_BYTES)
        at += taken
        if tag == _DTYPE_TAG:
            dtype, taken = decode_varint(head, at, _VALUE_BYTES)
            tag, more = decode_varint(head, at + taken, _TAG_BYTES)
            at += taken + more
        if tag == _SHAPE_TAG:
            packed, taken = decode_varint(head, at, _TAG_BYTES)
            at += taken
            end = at + packed
            while at < end:
                dim, taken = decode_varint(head, at, _VALUE_BYTES)
                dims.append(dim)
                at += taken
            tag, taken = decode_varint(head, at, _TAG_BYTES)
            at += taken
            if at - taken != end:
                return None
        if tag != _DATA_TAG:
            return None
        data_bytes, taken = decode_varint(head, at, _TAG_BYTES)
        return TensorHeader(dtype, tuple(dims), data_bytes), at + taken
    except (IndexError, WireError):
        return None


def _read_tensor(body: _Bounded, layer: int, start: int, field: int, place: Placer) -> None:
    """A Tensor field's body: its data into the views `place` gives.

    Its small fields are first parsed in one go from a peek at the bytes in
    hand (a call per varint through the readers cost as much as a 256 KiB
    chunk's copy); where they are not laid out as expected, one by one."""
    fast = _tensor_head(body.peek(_TENSOR_HEAD_BYTES))
    if fast is not None and fast[1] + fast[0].data_bytes == body.left:
        header, head_bytes = fast
        body.skip(head_bytes)
        _fill(body, place(layer, start, field, header))
        return
    dtype, shape, placed = 0, [], False
    while body.left:
        number, wire = body.tag()
        if placed:
            raise WireError("a Tensor field after its data")
        if number == TENSOR_DTYPE and wire == VARINT:
            dtype = body.varint()
        elif number == TENSOR_SHAPE and wire == VARINT:
            shape.append(body.varint())
        elif number == TENSOR_SHAPE and wire == LENGTH_DELIMITED:
            packed = body.sub()
            while packed.left:
                shape.append(packed.varint())
        elif number == TENSOR_DATA and wire == LENGTH_DELIMITED:
            data = body.sub()
            _fill(data, place(layer, start, field, TensorHeader(dtype, tuple(shape), data.left)))
            placed = True
        else:
            raise WireError("an unexpected Tensor field %d (wire type %d)" % (number, wire))
    if not placed:  # proto3 leaves empty data out
        _fill(body, place(layer, start, field, TensorHeader(dtype, tuple(shape), 0)))


def _fill(data: _Bounded, views: List[memoryview]) -> None:
    if sum(len(view) for view in views) != data.left:
        raise WireError("a tensor's %d data bytes do not match where they go" % data.left)
    data.read_into_many(views)


def read_token_chunk(source: ByteSource, length: int, place: Placer) -> Tuple[int, int]:
    """Reads one FetchResponse of `length` bytes holding keys and values.

    Tensor data goes where `place` says, as it arrives. Returns (layer, start).
    Raises NotATokenChunk for a state or packed chunk, WireError for bytes
    that are not a FetchResponse. layer and start must precede the tensors,
    as protobuf writes them: they say where the data goes."""
    message = _Bounded(source, length)
    layer = start = 0
    seen: List[int] = []
    while message.left:
        number, wire = message.tag()
        if number in (CHUNK_LAYER, CHUNK_START) and wire == VARINT:
            if seen:
                raise WireError("a Fetch chunk's layer or start after its tensors")
            value = message.varint()
            layer, start = (value, start) if number == CHUNK_LAYER else (layer, value)
        elif number in (CHUNK_KEYS, CHUNK_VALUES) and wire == LENGTH_DELIMITED:
            if number in seen:
                raise WireError("a Fetch chunk with field %d twice" % number)
            seen.append(number)
            _read_tensor(message.sub(), layer, start, number, place)
        else:
            raise NotATokenChunk(number)
    if sorted(seen) != [CHUNK_KEYS, CHUNK_VALUES]:
        raise WireError("a Fetch chunk without both keys and values")
    return layer, start


def skip(source: ByteSource, size: int, block: int = 1 << 16) -> None:
    """Reads and drops `size` bytes (a frame nobody wants)."""
    scratch = memoryview(bytearray(min(size, block)))
    while size:
        step = min(size, len(scratch))
        source.read_into(scratch[:step])
        size -= step

