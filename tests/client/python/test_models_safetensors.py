"""kvcached.models.safetensors: the format read and written by hand, round
trips of every dtype without copies, and refusals that name the tensor and
the field at fault."""

import json
import struct

import pytest

torch = pytest.importorskip("torch")

from kvcached.models import safetensors  # noqa: E402 (after the torch check)


def sample_tensors():
    generator = torch.Generator().manual_seed(7)
    return {
        "f32": torch.randn((3, 5), generator=generator),
        "f16": torch.randn((2, 3, 4), generator=generator).half(),
        "bf16": torch.randn((4, 2), generator=generator).to(torch.bfloat16),
        "i64": torch.arange(-3, 9, dtype=torch.int64).view(3, 4),
        "i32": torch.arange(5, dtype=torch.int32),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros((0, 4)),
    }


def test_round_trip_of_every_dtype_through_a_file(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "t.safetensors"
    safetensors.save_file(tensors, path, metadata={"format": "pt", "note": "x"})
    loaded, metadata = safetensors.load_file_with_metadata(path)
    assert metadata == {"format": "pt", "note": "x"}
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def test_the_layout_is_the_libraries(tmp_path):
    """u64 length, a JSON header padded with spaces to 8 bytes, then the
    tensors back to back in name order."""
    data = safetensors.serialize({"b": torch.ones(2), "a": torch.zeros(3, dtype=torch.float16)})
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0
    header = json.loads(data[8:8 + length])
    assert header == {"a": {"dtype": "F16", "shape": [3], "data_offsets": [0, 6]},
                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [6, 14]}}
    assert data[8 + length:] == bytes(6) + struct.pack("<2f", 1.0, 1.0)


def test_loaded_tensors_share_the_buffer():
    """No copy: the tensors are views of the buffer's own bytes."""
    buffer = bytearray(safetensors.serialize({"x": torch.zeros(4)}))
    tensors, _ = safetensors.load_buffer(buffer)
    buffer[-4:] = struct.pack("<f", 3.0)
    assert tensors["x"].tolist() == [0.0, 0.0, 0.0, 3.0]


def test_a_file_is_mapped_copy_on_write(tmp_path):
    """Writing a loaded tensor changes neither the file nor another load."""
    path = tmp_path / "t.safetensors"
    safetensors.save_file({"x": torch.ones(3)}, path)
    first = safetensors.load_file(path)["x"]
    first.fill_(5.0)
    assert torch.equal(safetensors.load_file(path)["x"], torch.ones(3))


def corrupt(header, data=b"", raw_header=None):
    """A safetensors buffer with this header (a dict, or raw bytes) and data."""
    encoded = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize("header, data, message", [
    ({"w": entry(dtype="F8")}, bytes(8), r"tensor 'w', field 'dtype'"),
    ({"w": entry(shape=(2, -1))}, bytes(8), r"tensor 'w', field 'shape'"),
    ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), r"tensor 'w', field 'data_offsets'"),
    ({"w": entry(offsets=(8, 0))}, bytes(8), r"tensor 'w', field 'data_offsets'.*before"),
    ({"w": entry(offsets=(0, 12))}, bytes(12), r"tensor 'w', field 'data_offsets'.*needs 8"),
    ({"w": entry(offsets=(0, 8))}, bytes(4), r"tensor 'w', field 'data_offsets'.*past"),
    ({"w": entry(offsets=(4, 12))}, bytes(12), r"tensor 'w'.*contiguous"),
    ({"a": entry(offsets=(0, 8)), "b": entry(offsets=(4, 12))}, bytes(12),
     r"tensor 'b'.*contiguous"),
    ({"w": entry()}, bytes(12), r"cover 8 bytes of data, the file has 12"),
    ({"w": "F32"}, bytes(8), r"tensor 'w', field '\(entry\)'"),
    ({"__metadata__": {"k": 1}, "w": entry()}, bytes(8), r"__metadata__"),
    ([1, 2], b"", r"not an object"),
])
def test_bad_headers_are_refused_by_name(header, data, message):
    with pytest.raises(ValueError, match=message):
        safetensors.load_buffer(corrupt(header, data))


def test_bad_lengths_and_json_are_refused():
    with pytest.raises(ValueError, match="too short"):
        safetensors.load_buffer(b"\x01\x00")
    with pytest.raises(ValueError, match="does not fit"):
        safetensors.load_buffer(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(ValueError, match="no JSON"):
        safetensors.load_buffer(corrupt(None, raw_header=b"{not json"))


def test_a_bad_file_names_its_path(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(corrupt({"w": entry(dtype="Q4")}, bytes(8)))
    with pytest.raises(ValueError, match="bad.safetensors.*'w'.*'dtype'"):
        safetensors.load_file(path)
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        safetensors.load_file(empty)


def test_writing_refuses_what_the_format_cannot_hold():
    with pytest.raises(ValueError, match="cannot store"):
        safetensors.serialize({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="__metadata__"):
        safetensors.serialize({"__metadata__": torch.zeros(1)})
