"""The safetensors format, read and written by hand (no safetensors package):

    | u64 little-endian n | n bytes of JSON header | raw tensor bytes ........ |

The header maps each tensor name to {"dtype": "F32", "shape": [..],
"data_offsets": [begin, end]} (offsets into the raw bytes, which the tensors
cover back to back, no holes), plus an optional "__metadata__" of string to
string. Tensors are little-endian and row-major.

Reading maps the file (copy-on-write, so torch gets a writable buffer and
nothing is copied until someone writes) and makes each tensor with
torch.frombuffer over its bytes. Every header is validated first; a bad one
raises ValueError naming the tensor and the field.
"""

import json
import math
import mmap
import os
import struct
import sys
from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch

# safetensors dtype names and the torch types they hold.
DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
NAMES: Dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

# A header larger than this is refused before it is parsed (safetensors' own
# limit is 100 MB): a corrupt length must not make us allocate gigabytes.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"

Buffer = Union[bytes, bytearray, memoryview, mmap.mmap]


class TensorEntry:
    """One tensor of a header: its dtype, shape and byte range in the data."""

    def __init__(self, name: str, dtype: torch.dtype, shape: Tuple[int, ...],
                 begin: int, end: int) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.begin = begin
        self.end = end

    def __repr__(self) -> str:
        return "TensorEntry(%r, %s, %s, [%d, %d])" % (self.name, self.dtype, self.shape,
                                                       self.begin, self.end)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _field_error(name: str, field: str, why: str) -> ValueError:
    return ValueError("safetensors header: tensor %r, field %r: %s" % (name, field, why))


def _parse_entry(name: str, entry: object) -> TensorEntry:
    """One tensor's header entry, checked on its own (offsets within the
    data and contiguity are checked over all entries by _check_layout)."""
    if not isinstance(entry, dict):
        raise _field_error(name, "(entry)", "is %s, not an object" % type(entry).__name__)
    dtype_name = entry.get("dtype")
    if dtype_name not in DTYPES:
        raise _field_error(name, "dtype", "%r is not one of %s" % (dtype_name, sorted(DTYPES)))
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise _field_error(name, "shape", "%r is not a list of non-negative integers" % (shape,))
    offsets = entry.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(
            isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets):
        raise _field_error(name, "data_offsets", "%r is not [begin, end]" % (offsets,))
    begin, end = offsets
    if end < begin:
        raise _field_error(name, "data_offsets", "end %d is before begin %d" % (end, begin))
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * _itemsize(dtype)
    if end - begin != expected:
        raise _field_error(name, "data_offsets", "%d bytes, but shape %s of %s needs %d"
                           % (end - begin, shape, dtype_name, expected))
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _check_layout(entries: Dict[str, TensorEntry], data_bytes: int) -> None:
    """The tensors must cover the data back to back: no gap, no overlap,
    nothing past its end (as the safetensors library demands)."""
    position = 0
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != position:
            raise _field_error(entry.name, "data_offsets", "begins at %d, but the previous "
                               "tensor ends at %d (tensors must be contiguous)"
                               % (entry.begin, position))
        if entry.end > data_bytes:
            raise _field_error(entry.name, "data_offsets", "ends at %d, past the %d bytes of "
                               "data" % (entry.end, data_bytes))
        position = entry.end
    if position != data_bytes:
        raise ValueError("safetensors: the tensors cover %d bytes of data, the file has %d"
                         % (position, data_bytes))


def _parse_metadata(raw: object) -> Dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise ValueError("safetensors header: %r must map strings to strings" % METADATA_KEY)
    return dict(raw)


def parse_header(buffer: Buffer) -> Tuple[Dict[str, TensorEntry], Dict[str, str], int]:
    """Reads and validates the header of a safetensors buffer.

    Returns (entries by name, metadata, where the data begins in the buffer).
    Raises ValueError on anything malformed.
    """
    view = memoryview(buffer)
    if len(view) < 8:
        raise ValueError("safetensors: %d bytes, too short for the header length" % len(view))
    (header_bytes,) = struct.unpack("<Q", view[:8])
    if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > len(view):
        raise ValueError("safetensors: header length %d does not fit the %d bytes"
                         % (header_bytes, len(view)))
    try:
        header = json.loads(bytes(view[8:8 + header_bytes]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError("safetensors: the header is no JSON: %s" % error) from error
    if not isinstance(header, dict):
        raise ValueError("safetensors: the header is %s, not an object" % type(header).__name__)
    metadata = _parse_metadata(header.pop(METADATA_KEY, None))
    entries = {name: _parse_entry(name, entry) for name, entry in header.items()}
    data_start = 8 + header_bytes
    _check_layout(entries, len(view) - data_start)
    return entries, metadata, data_start


def _tensor_at(buffer: Buffer, entry: TensorEntry, data_start: int) -> torch.Tensor:
    """The entry's tensor over the buffer's own bytes (torch.frombuffer: no
    copy; the tensor keeps the buffer alive)."""
    count = math.prod(entry.shape)
    if count == 0:
        return torch.zeros(entry.shape, dtype=entry.dtype)
    flat = torch.frombuffer(buffer, dtype=entry.dtype, count=count,
                            offset=data_start + entry.begin)
    if sys.byteorder != "little" and _itemsize(entry.dtype) > 1:
        flat = _byteswapped(flat)
    return flat.view(entry.shape)


def _byteswapped(tensor: torch.Tensor) -> torch.Tensor:
    """A big-endian host's copy of little-endian data (bytes reversed per element)."""
    size = _itemsize(tensor.dtype)
    as_bytes = tensor.view(torch.uint8).view(-1, size).flip(1).contiguous()
    return as_bytes.view(tensor.dtype).view(-1)


def load_buffer(buffer: Buffer) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """The tensors (sharing the buffer's memory) and metadata of a safetensors
    buffer. A read-only buffer (bytes) is copied once, since torch.frombuffer
    needs a writable one."""
    if isinstance(buffer, bytes) or (isinstance(buffer, memoryview) and buffer.readonly):
        buffer = bytearray(buffer)
    entries, metadata, data_start = parse_header(buffer)
    tensors = {name: _tensor_at(buffer, entry, data_start) for name, entry in entries.items()}
    return tensors, metadata


def load_file_with_metadata(path: Union[str, os.PathLike]
                            ) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """load_file, and the file's __metadata__."""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size == 0:
            raise ValueError("safetensors: %s is empty" % os.fspath(path))
        # Copy-on-write: writable for torch.frombuffer, pages read lazily, the
        # file never written. The map outlives the file object.
        mapped = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        return load_buffer(mapped)
    except ValueError as error:
        raise ValueError("%s: %s" % (os.fspath(path), error)) from error


def load_file(path: Union[str, os.PathLike]) -> Dict[str, torch.Tensor]:
    """The tensors of a .safetensors file, by name, over a private map of
    the file (no copy is made until a tensor is written)."""
    return load_file_with_metadata(path)[0]


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The little-endian bytes of a CPU tensor, row-major."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype not in NAMES:
        raise ValueError("safetensors cannot store %s" % tensor.dtype)
    if tensor.numel() == 0:
        return memoryview(b"")
    if sys.byteorder != "little" and tensor.element_size() > 1:
        tensor = _byteswapped(tensor.reshape(-1))
    # uint8 view of the same memory: numpy lacks bfloat16, but not bytes.
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _layout(tensors: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]]
            ) -> Tuple[bytes, List[memoryview]]:
    """The length-prefixed header and the tensors' bytes, in name order."""
    header: Dict[str, object] = {}
    if metadata:
        header[METADATA_KEY] = _parse_metadata(dict(metadata))
    pieces = []
    position = 0
    for name in sorted(tensors):
        if name == METADATA_KEY:
            raise ValueError("safetensors: %r cannot name a tensor" % METADATA_KEY)
        data = _tensor_bytes(tensors[name])
        header[name] = {"dtype": NAMES[tensors[name].dtype],
                        "shape": list(tensors[name].shape),
                        "data_offsets": [position, position + len(data)]}
        pieces.append(data)
        position += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Padded with spaces to 8 bytes, as the safetensors library writes it, so
    # the data (and every 8-byte-aligned tensor in it) starts aligned.
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded, pieces


def serialize(tensors: Mapping[str, torch.Tensor],
              metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """A safetensors buffer holding `tensors` (in name order) and `metadata`."""
    header, pieces = _layout(tensors, metadata)
    return b"".join([header] + pieces)


def save_file(tensors: Mapping[str, torch.Tensor], path: Union[str, os.PathLike],
              metadata: Optional[Mapping[str, str]] = None) -> None:
    """Writes `tensors` and `metadata` to a .safetensors file, each tensor
    from its own memory, via a temporary file renamed into place (a reader
    never sees half of it)."""
    header, pieces = _layout(tensors, metadata)
    temporary = os.fspath(path) + ".tmp"
    with open(temporary, "wb") as file:
        file.write(header)
        for piece in pieces:
            file.write(piece)
    os.replace(temporary, path)
