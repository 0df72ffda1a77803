"""The lane's frame headers against the layout frame.h and kvcache.proto document."""

import pytest

from kvcached import frames
from kvcached.proto import pb


def test_preamble_and_limits_are_the_documented_ones():
    assert frames.MAGIC == b"KVLANE02"
    assert frames.HEADER_BYTES == 8
    assert frames.MAX_AUTH_FRAME_BYTES == 8192


def test_frame_kinds_match_the_proto():
    for kind in frames.FrameKind:
        assert pb.LaneFrameKind.Value("LANE_FRAME_" + kind.name) == kind.value
    assert len(frames.FrameKind) == len(pb.LaneFrameKind.values())


@pytest.mark.parametrize("length, kind, expected", [
    (0, frames.FrameKind.UPDATE_END, b"\x00\x00\x00\x00\x02\x00\x00\x00"),
    (5, frames.FrameKind.UPDATE, b"\x05\x00\x00\x00\x01\x00\x00\x00"),
    (0x01020304, frames.FrameKind.FETCH_CHUNK, b"\x04\x03\x02\x01\x11\x00\x00\x00"),
    (0xFFFFFFFF, frames.FrameKind.STATUS, b"\xff\xff\xff\xff\x12\x00\x00\x00"),
])
def test_header_is_little_endian_length_kind_and_three_zero_bytes(length, kind, expected):
    assert frames.encode_header(length, kind) == expected
    assert frames.decode_header(expected) == (length, kind)


def test_reserved_bytes_make_the_kind_unknown():
    for reserved in (b"\x01\x00\x00", b"\x00\x00\x80"):
        header = frames.decode_header(b"\x07\x00\x00\x00\x12" + reserved)
        assert header.length == 7
        assert header.kind == frames.UNKNOWN_KIND


def test_unknown_kinds_decode_as_read():
    assert frames.decode_header(b"\x00\x00\x00\x00\xfe\x00\x00\x00").kind == 0xFE


@pytest.mark.parametrize("length, kind", [(-1, 1), (1 << 32, 1), (0, 256), (0, -1)])
def test_headers_out_of_range_are_refused(length, kind):
    with pytest.raises(ValueError):
        frames.encode_header(length, kind)


def test_a_header_is_exactly_eight_bytes():
    with pytest.raises(ValueError):
        frames.decode_header(b"\x00" * 7)
