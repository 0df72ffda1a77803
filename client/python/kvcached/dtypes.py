"""Element types: kvcache.v1.DType, numpy and torch, and the byte views of arrays.

Tensors travel as row-major little-endian bytes. f32 and f16 are numpy's own
float32 and float16; bf16, which numpy lacks, is torch.bfloat16 or, in numpy,
a uint16 (or int16) array holding the same 16 bits. Arrays are sent from
their own buffers (`byte_view`) and fetched into arrays of the caller's
(`writable_array`), so these views share memory with the caller's tensors.
"""

import enum
import sys
from typing import Any, Tuple

import numpy as np

try:  # torch is optional: numpy arrays work without it
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None


class DType(enum.IntEnum):
    """kvcache.v1.DType, by value (a unit test holds them to the .proto)."""

    UNSPECIFIED = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3


# Bytes per element of each type.
ELEMENT_BYTES = {DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2}

# The numpy type a fetched tensor of each DType is returned as (little-endian).
_NUMPY_OF = {DType.FLOAT32: np.dtype("<f4"), DType.FLOAT16: np.dtype("<f2"),
             DType.BFLOAT16: np.dtype("<u2")}

# Byte orders an array may have to be sent as it is: little-endian, native on
# a little-endian machine, or none (single bytes).
_NATIVE_OR_LITTLE = ("<", "|") + (("=",) if sys.byteorder == "little" else ())

# numpy kinds that stand for each DType when sent. A 16-bit integer array
# can only mean bf16 here: the service stores no integer tensors.
_DTYPE_OF_NUMPY = {("f", 4): DType.FLOAT32, ("f", 2): DType.FLOAT16,
                   ("u", 2): DType.BFLOAT16, ("i", 2): DType.BFLOAT16}


def numpy_dtype(dtype: DType) -> np.dtype:
    """The numpy type fetched tensors of `dtype` have (bf16: uint16)."""
    try:
        return _NUMPY_OF[DType(dtype)]
    except (KeyError, ValueError):
        raise ValueError("no element type for DType %r" % (dtype,)) from None


def is_torch_tensor(value: Any) -> bool:
    """Whether `value` is a torch.Tensor (False where torch is absent)."""
    return torch is not None and isinstance(value, torch.Tensor)


def _torch_dtype_map():
    return {torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT16,
            torch.bfloat16: DType.BFLOAT16}


def dtype_of_torch(torch_dtype: Any) -> DType:
    """The DType of a torch dtype; ValueError for any but f32, f16 and bf16."""
    found = _torch_dtype_map().get(torch_dtype)
    if found is None:
        raise ValueError("kvcached stores float32, float16 or bfloat16, not %s" % torch_dtype)
    return found


def dtype_of(tensor: Any) -> DType:
    """The DType of a numpy array or torch tensor; TypeError for other types."""
    if is_torch_tensor(tensor):
        found = _torch_dtype_map().get(tensor.dtype)
        if found is None:
            raise TypeError("torch dtype %s is not f32, f16 or bf16" % tensor.dtype)
        return found
    array = np.asarray(tensor)
    found = _DTYPE_OF_NUMPY.get((array.dtype.kind, array.dtype.itemsize))
    if found is None:
        raise TypeError("numpy dtype %s is not float32, float16 or a 16-bit bf16 view"
                        % array.dtype)
    return found


def _as_numpy(tensor: Any) -> np.ndarray:
    """A numpy array sharing the tensor's memory (a CPU copy for device tensors)."""
    if not is_torch_tensor(tensor):
        return np.asarray(tensor)
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()  # the bytes must reach host memory to be sent
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)  # numpy has no bf16: the same 16 bits
    return tensor.numpy()


def _little_endian_contiguous(array: np.ndarray) -> np.ndarray:
    """The array itself where it is C-contiguous little-endian, else a copy that is.

    A transposed view ([B, L, H, D] -> [B, H, L, D]) must be copied anyway:
    the wire wants row-major bytes."""
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    return np.ascontiguousarray(array)


def byte_view(tensor: Any) -> Tuple[DType, Tuple[int, ...], memoryview]:
    """(dtype, shape, bytes) of a tensor, the bytes a view of its own buffer.

    The view stays valid while the caller keeps the tensor alive; it is copied
    only where the tensor is not row-major little-endian in host memory."""
    if type(tensor) is np.ndarray and tensor.flags.c_contiguous and tensor.size:
        # The common case, an array ready to send, without the general
        # path's conversions (a few microseconds on every update).
        found = _DTYPE_OF_NUMPY.get((tensor.dtype.kind, tensor.dtype.itemsize))
        if found is not None and tensor.dtype.byteorder in _NATIVE_OR_LITTLE:
            return found, tensor.shape, memoryview(tensor).cast("B")
    dtype = dtype_of(tensor)
    array = _little_endian_contiguous(_as_numpy(tensor))
    # Flattened to bytes through numpy: memoryview.cast refuses empty shapes.
    data = memoryview(array.reshape(-1).view(np.uint8))
    return dtype, tuple(int(d) for d in array.shape), data


def writable_array(tensor: Any) -> np.ndarray:
    """A numpy array sharing a caller's output tensor's memory, to fetch into.

    The tensor must be C-contiguous and in host memory: fetched bytes land in
    it with no copy in between, so there is nowhere else for them to go."""
    if is_torch_tensor(tensor) and tensor.device.type != "cpu":
        raise ValueError("fetch output tensors must be in CPU memory, not %s" % tensor.device)
    array = _as_numpy(tensor)
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError("fetch output arrays must be C-contiguous and writable")
    if array.dtype.byteorder == ">":
        raise ValueError("fetch output arrays must be little-endian")
    return array


def as_torch(array: np.ndarray, dtype: DType) -> Any:
    """A torch tensor sharing a fetched array's memory (bf16 as torch.bfloat16)."""
    if torch is None:
        raise ImportError("torch is not installed")
    if dtype == DType.BFLOAT16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
