"""The data lane's framing (kvcache.proto, LaneFrameKind; protos/wire/lane/frame.h).

A connection opens with the client's 8 bytes b"KVLANE02", which the server
answers with the same 8 bytes. Every frame after that is an 8-byte header and
a payload (a protobuf message of the kind's type):

    byte  0       4      5          8
          +-------+------+----------+----------------
          |length | kind | 0  0  0  | payload (length bytes)
          +-------+------+----------+----------------
           uint32 little-endian, uint8; the three reserved bytes are zero

A header whose reserved bytes are not zero has no known kind (-1 here, as the
server's DecodeHeader has it), so it is refused rather than half-read.
"""

import enum
import struct
from typing import NamedTuple

# The preamble of a connection, and the server's answer.
MAGIC = b"KVLANE02"
HEADER_BYTES = 8
# The longest AUTH frame the server reads (one bearer token).
MAX_AUTH_FRAME_BYTES = 8 << 10
# The longest payload a header can announce.
MAX_PAYLOAD_BYTES = 0xFFFFFFFF
# A header's kind when its reserved bytes are set.
UNKNOWN_KIND = -1

_HEADER = struct.Struct("<IB3s")


class FrameKind(enum.IntEnum):
    """kvcache.v1.LaneFrameKind, by value (a unit test holds them to the .proto)."""

    UNSPECIFIED = 0
    UPDATE = 1          # client: an UpdateRequest
    UPDATE_END = 2      # client, empty: the Update call ends
    FETCH = 3           # client: a FetchRequest
    AUTH = 4            # client, first frame: a LaneAuth
    UPDATE_ACK = 16     # server: an UpdateResponse
    FETCH_CHUNK = 17    # server: a FetchResponse
    STATUS = 18         # server: a LaneStatus, the end of a call
    FETCH_LENGTH = 19   # server: a LaneFetchLength, before a Fetch's chunks


class FrameHeader(NamedTuple):
    """A decoded header: payload bytes and kind (an int: unknown kinds stay as read)."""

    length: int
    kind: int


def encode_header(length: int, kind: int) -> bytes:
    """The 8 header bytes of a frame of `length` payload bytes and `kind`."""
    if not 0 <= length <= MAX_PAYLOAD_BYTES:
        raise ValueError("a frame's payload is 0 to 4 GiB - 1 bytes, not %d" % length)
    if not 0 <= kind <= 0xFF:
        raise ValueError("a frame's kind is one byte, not %d" % kind)
    return _HEADER.pack(length, kind, b"\0\0\0")


def decode_header(data: bytes) -> FrameHeader:
    """A header from its 8 bytes; kind UNKNOWN_KIND where reserved bytes are set."""
    if len(data) != HEADER_BYTES:
        raise ValueError("a frame header is %d bytes, not %d" % (HEADER_BYTES, len(data)))
    length, kind, reserved = _HEADER.unpack(data)
    return FrameHeader(length, UNKNOWN_KIND if reserved != b"\0\0\0" else kind)
