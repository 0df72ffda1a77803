"""Fetch chunks assembled per layer, into the caller's arrays or new ones."""

import numpy as np
import pytest

from kvcached import wire
from kvcached.dtypes import DType
from kvcached.fetch import FetchAssembler
from kvcached.proto import pb


def history(rng, shape, dtype=np.float16):
    """Keys and values [B, H, T, D] of random bits."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    other = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return bits.view(dtype), other.view(dtype)


def chunks_of(layer, keys, values, starts_and_lengths, dtype=pb.DTYPE_FLOAT16):
    """FetchResponse bytes cutting [B, H, T, D] into the given (start, L) pieces."""
    at, out = 0, []
    for start, length in starts_and_lengths:
        piece = [np.ascontiguousarray(t[:, :, at:at + length]) for t in (keys, values)]
        out.append(pb.FetchResponse(
            layer=layer, start=start,
            keys=pb.Tensor(dtype=dtype, shape=piece[0].shape, data=piece[0].tobytes()),
            values=pb.Tensor(dtype=dtype, shape=piece[1].shape, data=piece[1].tobytes()),
        ).SerializeToString())
        at += length
    return out


def feed(assembler, payloads):
    for payload in payloads:
        wire.read_token_chunk(wire.MemorySource(payload), len(payload), assembler)


PIECES = [(0, 3), (3, 1), (4, 5)]


def test_chunks_join_into_new_arrays():
    keys, values = history(np.random.default_rng(1), (2, 3, 9, 4))
    assembler = FetchAssembler()
    feed(assembler, chunks_of(5, keys, values, PIECES))
    got = assembler.results()[5]
    assert got.keys.tobytes() == keys.tobytes() and got.values.tobytes() == values.tobytes()
    assert got.keys.dtype == np.float16 and got.dtype is DType.FLOAT16
    assert got.ranges == [(0, 9)] and got.tokens == 9


def test_chunks_land_in_the_callers_arrays():
    keys, values = history(np.random.default_rng(2), (1, 4, 9, 8))
    out_keys = np.full((1, 4, 12, 8), 7, dtype=np.float16)
    out_values = np.full((1, 4, 12, 8), 7, dtype=np.float16)
    assembler = FetchAssembler({0: (out_keys, out_values)})
    feed(assembler, chunks_of(0, keys, values, PIECES))
    got = assembler.results()[0]
    assert got.keys.base is out_keys or np.shares_memory(got.keys, out_keys)
    assert got.keys.shape == (1, 4, 9, 8)
    assert out_keys[:, :, :9].tobytes() == keys.tobytes()
    assert out_values[:, :, :9].tobytes() == values.tobytes()
    assert (out_keys[:, :, 9:] == 7).all()  # nothing written past the history


def test_a_rotating_layers_ranges_are_its_sinks_then_its_window():
    keys, values = history(np.random.default_rng(3), (1, 1, 8, 2))
    assembler = FetchAssembler()
    feed(assembler, chunks_of(2, keys, values, [(0, 4), (11, 2), (13, 2)]))
    assert assembler.results()[2].ranges == [(0, 4), (11, 15)]


def test_layers_are_kept_apart():
    rng = np.random.default_rng(4)
    first, second = history(rng, (1, 2, 3, 4)), history(rng, (1, 2, 5, 4))
    assembler = FetchAssembler()
    feed(assembler, chunks_of(0, *first, [(0, 3)]) + chunks_of(1, *second, [(0, 2), (2, 3)]))
    results = assembler.results()
    assert results[0].keys.tobytes() == first[0].tobytes()
    assert results[1].values.tobytes() == second[1].tobytes()


def test_bf16_lands_as_uint16_and_f32_as_float32():
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 1 << 16, size=(1, 1, 2, 4), dtype=np.uint16)
    assembler = FetchAssembler()
    feed(assembler, chunks_of(0, bits, bits, [(0, 2)], dtype=pb.DTYPE_BFLOAT16))
    got = assembler.results()[0]
    assert got.keys.dtype == np.uint16 and (got.keys == bits).all()
    floats = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    assembler = FetchAssembler()
    feed(assembler, chunks_of(0, floats, floats, [(0, 3)], dtype=pb.DTYPE_FLOAT32))
    assert (assembler.results()[0].values == floats).all()


def test_an_out_array_too_small_or_of_another_type_is_refused():
    keys, values = history(np.random.default_rng(6), (1, 2, 9, 4))
    small = (np.empty((1, 2, 8, 4), np.float16), np.empty((1, 2, 8, 4), np.float16))
    with pytest.raises(ValueError, match="holds 8 tokens"):
        feed(FetchAssembler({0: small}), chunks_of(0, keys, values, PIECES))
    wrong = (np.empty((1, 2, 9, 4), np.float32), np.empty((1, 2, 9, 4), np.float32))
    with pytest.raises(ValueError, match="FLOAT16"):
        feed(FetchAssembler({0: wrong}), chunks_of(0, keys, values, PIECES))
    heads = (np.empty((1, 3, 9, 4), np.float16), np.empty((1, 3, 9, 4), np.float16))
    with pytest.raises(ValueError):
        feed(FetchAssembler({0: heads}), chunks_of(0, keys, values, PIECES))


def test_a_chunk_whose_bytes_do_not_fill_its_shape_is_refused():
    bad = pb.FetchResponse(keys=pb.Tensor(dtype=2, shape=[1, 1, 2, 2], data=b"\0" * 6),
                           values=pb.Tensor(dtype=2, shape=[1, 1, 2, 2], data=b"\0" * 6))
    payload = bad.SerializeToString()
    with pytest.raises(wire.WireError):
        feed(FetchAssembler(), [payload])


def test_keys_and_values_of_different_lengths_are_refused():
    keys = pb.Tensor(dtype=2, shape=[1, 1, 2, 2], data=b"\0" * 8)
    values = pb.Tensor(dtype=2, shape=[1, 1, 1, 2], data=b"\0" * 4)
    payload = pb.FetchResponse(keys=keys, values=values).SerializeToString()
    with pytest.raises(wire.WireError):
        feed(FetchAssembler(), [payload])


def test_torch_out_tensors_are_filled_in_place():
    torch = pytest.importorskip("torch")
    keys, values = history(np.random.default_rng(7), (1, 2, 9, 4), dtype=np.uint16)
    out = (torch.zeros(1, 2, 9, 4, dtype=torch.bfloat16),
           torch.zeros(1, 2, 9, 4, dtype=torch.bfloat16))
    assembler = FetchAssembler({0: out})
    feed(assembler, chunks_of(0, keys, values, PIECES, dtype=pb.DTYPE_BFLOAT16))
    got = assembler.results()[0]
    assert got.keys.dtype == torch.bfloat16
    assert out[0].view(torch.int16).numpy().view(np.uint16).tobytes() == keys.tobytes()
