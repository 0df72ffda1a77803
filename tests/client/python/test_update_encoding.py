"""UpdateRequests built around the caller's buffers are protobuf's own bytes."""

import numpy as np
import pytest

from kvcached import update_encoding as enc
from kvcached.proto import pb


def kv(rng, shape, dtype=np.float16):
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))


def test_field_numbers_match_the_proto():
    update = pb.UpdateRequest.DESCRIPTOR.fields_by_name
    assert (update["keys"].number, update["values"].number, update["state"].number) == (
        enc.UPDATE_KEYS, enc.UPDATE_VALUES, enc.UPDATE_STATE)
    state = pb.RecurrentState.DESCRIPTOR.fields_by_name
    assert (state["conv_state"].number, state["delta_state"].number,
            state["advance"].number) == (enc.STATE_CONV, enc.STATE_DELTA, enc.STATE_ADVANCE)


@pytest.mark.parametrize("dtype, wire_dtype", [(np.float16, pb.DTYPE_FLOAT16),
                                               (np.float32, pb.DTYPE_FLOAT32)])
def test_a_plain_update_is_byte_for_byte_protobufs(dtype, wire_dtype):
    keys, values = kv(np.random.default_rng(1), (1, 4, 3, 16), dtype)
    pieces = enc.encode_update("ab" * 16, enc.LayerUpdate(layer=2, keys=keys, values=values))
    expected = pb.UpdateRequest(
        cache_id="ab" * 16, layer=2,
        keys=pb.Tensor(dtype=wire_dtype, shape=[1, 4, 3, 16], data=keys.tobytes()),
        values=pb.Tensor(dtype=wire_dtype, shape=[1, 4, 3, 16], data=values.tobytes()))
    assert enc.join(pieces) == expected.SerializeToString()
    assert enc.encoded_bytes(pieces) == expected.ByteSize()


def test_optional_fields_parse_as_protobuf_reads_them():
    keys, values = kv(np.random.default_rng(2), (2, 1, 1, 8))
    update = enc.LayerUpdate(layer=0, keys=keys, values=values, expected_offset=0,
                             speculation_id="spec")
    parsed = pb.UpdateRequest.FromString(enc.join(enc.encode_update("", update)))
    assert parsed.HasField("expected_offset") and parsed.expected_offset == 0
    assert parsed.speculation_id == "spec" and parsed.cache_id == ""
    assert parsed.keys.data == keys.tobytes() and parsed.values.data == values.tobytes()
    unset = pb.UpdateRequest.FromString(enc.join(enc.encode_update(
        "c", enc.LayerUpdate(layer=0, keys=keys, values=values))))
    assert not unset.HasField("expected_offset")


def test_tensor_bytes_are_the_arrays_own_memory():
    keys, values = kv(np.random.default_rng(3), (1, 2, 4, 8))
    pieces = enc.encode_update("c", enc.LayerUpdate(layer=0, keys=keys, values=values))
    views = [piece for piece in pieces if isinstance(piece, memoryview)]
    assert len(views) == 2
    keys[0, 0, 0, 0] = 42.0  # seen through the view: nothing was copied
    assert bytes(views[0][:2]) == np.float16(42.0).tobytes()


def test_transposed_arrays_are_sent_row_major():
    rng = np.random.default_rng(4)
    blh = rng.standard_normal((1, 5, 2, 8)).astype(np.float16)  # [B, L, H, D]
    keys = blh.transpose(0, 2, 1, 3)  # a [B, H, L, D] view, not contiguous
    parsed = pb.UpdateRequest.FromString(enc.join(enc.encode_update(
        "c", enc.LayerUpdate(layer=0, keys=keys, values=keys))))
    assert list(parsed.keys.shape) == [1, 2, 5, 8]
    assert parsed.keys.data == np.ascontiguousarray(keys).tobytes()


def test_bf16_as_uint16_and_big_endian_input():
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 1 << 16, size=(1, 1, 2, 4), dtype=np.uint16)
    parsed = pb.UpdateRequest.FromString(enc.join(enc.encode_update(
        "c", enc.LayerUpdate(layer=0, keys=bits, values=bits))))
    assert parsed.keys.dtype == pb.DTYPE_BFLOAT16
    assert parsed.keys.data == bits.astype("<u2").tobytes()
    big = rng.standard_normal((1, 1, 2, 4)).astype(">f4")
    parsed = pb.UpdateRequest.FromString(enc.join(enc.encode_update(
        "c", enc.LayerUpdate(layer=0, keys=big, values=big))))
    assert parsed.keys.data == big.astype("<f4").tobytes()


def test_a_recurrent_state_is_protobufs_encoding():
    rng = np.random.default_rng(6)
    conv = rng.standard_normal((1, 3, 16)).astype(np.float32)
    delta = rng.standard_normal((1, 2, 4, 4)).astype(np.float32)
    update = enc.LayerUpdate(layer=1, state=enc.RecurrentStateUpdate(conv, delta, advance=5))
    expected = pb.UpdateRequest(cache_id="c", layer=1, state=pb.RecurrentState(
        conv_state=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 3, 16], data=conv.tobytes()),
        delta_state=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 2, 4, 4], data=delta.tobytes()),
        advance=5))
    assert pb.UpdateRequest.FromString(enc.join(enc.encode_update("c", update))) == expected
    assert not pb.UpdateRequest.FromString(enc.join(enc.encode_update("c", update))).HasField(
        "keys")


def test_mixed_or_missing_tensors_are_refused():
    keys, _ = kv(np.random.default_rng(7), (1, 1, 1, 4))
    with pytest.raises(TypeError):
        enc.encode_update("c", enc.LayerUpdate(layer=0, keys=keys, values=keys.astype(np.float32)))
    with pytest.raises(ValueError):
        enc.encode_update("c", enc.LayerUpdate(layer=0, keys=keys))
    with pytest.raises(TypeError):
        enc.encode_update("c", enc.LayerUpdate(layer=0, keys=keys.astype(np.float64),
                                               values=keys.astype(np.float64)))
