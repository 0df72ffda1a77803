"""Hand-written protobuf encoding and chunk parsing, held to protobuf's own."""

import numpy as np
import pytest

from kvcached import wire
from kvcached.proto import pb


@pytest.mark.parametrize("value, expected", [
    (0, b"\x00"), (1, b"\x01"), (127, b"\x7f"), (128, b"\x80\x01"), (300, b"\xac\x02"),
    ((1 << 64) - 1, b"\xff" * 9 + b"\x01"),
])
def test_varints(value, expected):
    assert wire.encode_varint(value) == expected
    # protobuf agrees: UpdateResponse.offset is field 2, a varint.
    assert pb.UpdateResponse(offset=value).SerializeToString() == (b"\x10" + expected
                                                                    if value else b"")


@pytest.mark.parametrize("value", [-1, 1 << 64])
def test_varints_out_of_range(value):
    with pytest.raises(ValueError):
        wire.encode_varint(value)


def test_field_numbers_match_the_proto():
    tensor = pb.Tensor.DESCRIPTOR.fields_by_name
    assert (tensor["dtype"].number, tensor["shape"].number, tensor["data"].number) == (
        wire.TENSOR_DTYPE, wire.TENSOR_SHAPE, wire.TENSOR_DATA)
    chunk = pb.FetchResponse.DESCRIPTOR.fields_by_name
    assert [chunk[name].number for name in ("layer", "start", "keys", "values")] == [
        wire.CHUNK_LAYER, wire.CHUNK_START, wire.CHUNK_KEYS, wire.CHUNK_VALUES]


@pytest.mark.parametrize("dtype, shape", [(pb.DTYPE_FLOAT16, [1, 2, 3, 4]),
                                          (pb.DTYPE_BFLOAT16, [2, 8, 300, 128]),
                                          (pb.DTYPE_FLOAT32, [1])])
def test_tensor_prefix_is_protobufs_encoding(dtype, shape):
    data = bytes(range(7)) * 3
    expected = pb.FetchResponse(keys=pb.Tensor(dtype=dtype, shape=shape, data=data))
    ours = wire.tensor_prefix(wire.CHUNK_KEYS, dtype, shape, len(data)) + data
    assert ours == expected.SerializeToString()


def random_chunk(rng, layer, start, shape, dtype=pb.DTYPE_FLOAT16):
    size = int(np.prod(shape)) * (4 if dtype == pb.DTYPE_FLOAT32 else 2)
    keys, values = rng.bytes(size), rng.bytes(size)
    return pb.FetchResponse(layer=layer, start=start,
                            keys=pb.Tensor(dtype=dtype, shape=shape, data=keys),
                            values=pb.Tensor(dtype=dtype, shape=shape, data=values))


class Collect:
    """A placer that gives each tensor a fresh buffer and records its header."""

    def __init__(self):
        self.placed = {}

    def __call__(self, layer, start, field, header):
        buffer = bytearray(header.data_bytes)
        self.placed[field] = (layer, start, header, buffer)
        return [memoryview(buffer)]


def test_a_chunk_parses_into_the_placed_buffers():
    chunk = random_chunk(np.random.default_rng(1), 3, 1000, [1, 2, 5, 8])
    payload = chunk.SerializeToString()
    collect = Collect()
    assert wire.read_token_chunk(wire.MemorySource(payload), len(payload), collect) == (3, 1000)
    for field, tensor in ((wire.CHUNK_KEYS, chunk.keys), (wire.CHUNK_VALUES, chunk.values)):
        layer, start, header, buffer = collect.placed[field]
        assert (layer, start) == (3, 1000)
        assert header == (pb.DTYPE_FLOAT16, (1, 2, 5, 8), len(tensor.data))
        assert bytes(buffer) == tensor.data


def test_data_can_be_scattered_over_several_views():
    chunk = random_chunk(np.random.default_rng(2), 0, 0, [1, 3, 2, 4])
    payload = chunk.SerializeToString()
    parts = {}

    def place(layer, start, field, header):
        third = header.data_bytes // 3
        parts[field] = [bytearray(third) for _ in range(3)]
        return [memoryview(part) for part in parts[field]]

    wire.read_token_chunk(wire.MemorySource(payload), len(payload), place)
    assert b"".join(parts[wire.CHUNK_KEYS]) == chunk.keys.data
    assert b"".join(parts[wire.CHUNK_VALUES]) == chunk.values.data


def test_unpacked_shapes_are_read_too():
    # [1, 1, 1, 2] as four separate varint fields (proto2 style), then 4 bytes.
    tensor = (b"\x08\x02" + b"\x10\x01\x10\x01\x10\x01\x10\x02" + b"\x1a\x04" + b"abcd")
    payload = b"\x08\x07" + b"\x1a" + bytes([len(tensor)]) + tensor + b"\x22" + bytes(
        [len(tensor)]) + tensor
    collect = Collect()
    assert wire.read_token_chunk(wire.MemorySource(payload), len(payload), collect) == (7, 0)
    assert collect.placed[wire.CHUNK_KEYS][2].shape == (1, 1, 1, 2)
    assert bytes(collect.placed[wire.CHUNK_VALUES][3]) == b"abcd"


def test_state_and_packed_chunks_are_not_token_chunks():
    state = pb.FetchResponse(layer=1, state=pb.RecurrentState(advance=3)).SerializeToString()
    with pytest.raises(wire.NotATokenChunk) as refused:
        wire.read_token_chunk(wire.MemorySource(state), len(state), Collect())
    assert refused.value.field == 7


@pytest.mark.parametrize("cut", [1, 5, 30, -1])
def test_truncated_chunks_are_refused(cut):
    payload = random_chunk(np.random.default_rng(3), 1, 2, [1, 1, 4, 4]).SerializeToString()
    short = payload[:cut] if cut > 0 else payload[:-1]
    with pytest.raises(wire.WireError):
        wire.read_token_chunk(wire.MemorySource(short), len(payload), Collect())


def test_a_field_may_not_run_past_its_message():
    payload = random_chunk(np.random.default_rng(4), 1, 2, [1, 1, 4, 4]).SerializeToString()
    with pytest.raises(wire.WireError):  # a length that says less than the bytes hold
        wire.read_token_chunk(wire.MemorySource(payload), len(payload) - 3, Collect())


def test_layer_after_the_tensors_is_refused():
    chunk = random_chunk(np.random.default_rng(5), 0, 0, [1, 1, 1, 2])
    payload = chunk.SerializeToString() + b"\x08\x05"  # layer = 5, after keys and values
    with pytest.raises(wire.WireError):
        wire.read_token_chunk(wire.MemorySource(payload), len(payload), Collect())


def test_a_chunk_without_values_is_refused():
    payload = pb.FetchResponse(keys=pb.Tensor(dtype=1, shape=[1], data=b"1234")).SerializeToString()
    with pytest.raises(wire.WireError):
        wire.read_token_chunk(wire.MemorySource(payload), len(payload), Collect())


def test_overlong_varints_are_refused():
    payload = b"\x08" + b"\xff" * 10 + b"\x01"
    with pytest.raises(wire.WireError):
        wire.read_token_chunk(wire.MemorySource(payload), len(payload), Collect())


def test_a_placer_that_gives_the_wrong_size_is_refused():
    payload = random_chunk(np.random.default_rng(6), 0, 0, [1, 1, 2, 2]).SerializeToString()
    with pytest.raises(wire.WireError):
        wire.read_token_chunk(wire.MemorySource(payload), len(payload),
                              lambda *args: [memoryview(bytearray(3))])


def test_tensor_fields_in_another_order_are_read_field_by_field():
    # shape before dtype: not the order the fast path expects, still a Tensor.
    tensor = b"\x12\x04\x01\x01\x01\x02" + b"\x08\x02" + b"\x1a\x04" + b"abcd"
    payload = (b"\x08\x02" + b"\x1a" + bytes([len(tensor)]) + tensor
               + b"\x22" + bytes([len(tensor)]) + tensor)
    collect = Collect()
    assert wire.read_token_chunk(wire.MemorySource(payload), len(payload), collect) == (2, 0)
    assert collect.placed[wire.CHUNK_KEYS][2] == (pb.DTYPE_FLOAT16, (1, 1, 1, 2), 4)


def test_a_tensor_field_after_the_data_is_refused():
    tensor = b"\x08\x02" + b"\x12\x01\x04" + b"\x1a\x04" + b"abcd" + b"\x08\x02"
    payload = b"\x1a" + bytes([len(tensor)]) + tensor + b"\x22" + bytes([len(tensor)]) + tensor
    with pytest.raises(wire.WireError):
        wire.read_token_chunk(wire.MemorySource(payload), len(payload), Collect())


def test_a_chunk_arriving_a_few_bytes_at_a_time_parses_from_a_socket():
    import socket
    import threading
    import time
    from kvcached.lane_socket import LaneSocket
    chunk = random_chunk(np.random.default_rng(7), 300, 70000, [1, 2, 3, 8])
    payload = chunk.SerializeToString()
    ours, theirs = socket.socketpair()

    def dribble():  # varints and tensor heads split across reads
        for at in range(0, len(payload), 3):
            theirs.sendall(payload[at:at + 3])
            time.sleep(0.0005)

    sender = threading.Thread(target=dribble)
    sender.start()
    try:
        collect = Collect()
        source = LaneSocket(ours)
        assert wire.read_token_chunk(source, len(payload), collect) == (300, 70000)
        sender.join()
        assert bytes(collect.placed[wire.CHUNK_VALUES][3]) == chunk.values.data
    finally:
        sender.join()
        ours.close()
        theirs.close()
