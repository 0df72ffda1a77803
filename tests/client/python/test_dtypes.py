"""Element types between the proto, numpy and torch."""

import numpy as np
import pytest

from kvcached import dtypes
from kvcached.proto import pb


def test_dtype_values_match_the_proto():
    for dtype in dtypes.DType:
        assert pb.DType.Value("DTYPE_" + dtype.name) == dtype.value
    assert len(dtypes.DType) == len(pb.DType.values())


@pytest.mark.parametrize("array_dtype, expected", [
    (np.float32, dtypes.DType.FLOAT32), (np.float16, dtypes.DType.FLOAT16),
    (np.uint16, dtypes.DType.BFLOAT16), (np.int16, dtypes.DType.BFLOAT16),
    (">f4", dtypes.DType.FLOAT32)])
def test_numpy_types(array_dtype, expected):
    assert dtypes.dtype_of(np.zeros(2, dtype=array_dtype)) is expected


@pytest.mark.parametrize("array_dtype", [np.float64, np.int32, np.uint8, np.bool_])
def test_other_numpy_types_are_refused(array_dtype):
    with pytest.raises(TypeError):
        dtypes.dtype_of(np.zeros(2, dtype=array_dtype))


def test_fetched_types_and_sizes():
    assert dtypes.numpy_dtype(dtypes.DType.FLOAT32) == np.dtype("<f4")
    assert dtypes.numpy_dtype(dtypes.DType.FLOAT16) == np.dtype("<f2")
    assert dtypes.numpy_dtype(dtypes.DType.BFLOAT16) == np.dtype("<u2")
    for dtype in (dtypes.DType.FLOAT32, dtypes.DType.FLOAT16, dtypes.DType.BFLOAT16):
        assert dtypes.ELEMENT_BYTES[dtype] == dtypes.numpy_dtype(dtype).itemsize
    with pytest.raises(ValueError):
        dtypes.numpy_dtype(0)


def test_byte_view_shares_contiguous_memory():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    dtype, shape, data = dtypes.byte_view(array)
    assert (dtype, shape, len(data)) == (dtypes.DType.FLOAT32, (2, 3), 24)
    array[1, 2] = -1
    assert bytes(data[20:]) == np.float32(-1).tobytes()


def test_byte_view_of_an_empty_tensor_is_empty():
    dtype, shape, data = dtypes.byte_view(np.zeros((1, 2, 0, 8), np.float16))
    assert (dtype, shape, len(data)) == (dtypes.DType.FLOAT16, (1, 2, 0, 8), 0)


def test_writable_array_refuses_views_it_cannot_fill():
    with pytest.raises(ValueError):
        dtypes.writable_array(np.zeros((2, 4), np.float16)[:, ::2])
    frozen = np.zeros(4, np.float16)
    frozen.flags.writeable = False
    with pytest.raises(ValueError):
        dtypes.writable_array(frozen)


def test_torch_tensors_share_memory_both_ways():
    torch = pytest.importorskip("torch")
    for torch_dtype, expected in ((torch.float32, dtypes.DType.FLOAT32),
                                  (torch.float16, dtypes.DType.FLOAT16),
                                  (torch.bfloat16, dtypes.DType.BFLOAT16)):
        tensor = torch.arange(8, dtype=torch_dtype).reshape(2, 4)
        dtype, shape, data = dtypes.byte_view(tensor)
        assert (dtype, shape) == (expected, (2, 4))
        assert bytes(data) == tensor.view(torch.uint8).numpy().tobytes()
        out = torch.zeros(2, 4, dtype=torch_dtype)
        dtypes.writable_array(out)[...] = dtypes.writable_array(tensor)
        assert torch.equal(out, tensor)
    bits = np.array([0x3F80, 0xC000], dtype=np.uint16)  # 1.0 and -2.0 in bf16
    assert dtypes.as_torch(bits, dtypes.DType.BFLOAT16).tolist() == [1.0, -2.0]
