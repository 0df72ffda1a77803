"""UpdateRequests as protobuf bytes around the caller's own tensor buffers.

An encoded request is a list of pieces: small framing bytes built here and
memoryviews of the caller's arrays. Their concatenation is protobuf's
encoding of kvcache.v1.UpdateRequest, so the data lane sends the pieces as
they are (socket.sendmsg) and gRPC joins them once. The scalar fields go
through protobuf (a few bytes); the tensors never do.

    UpdateRequest = [cache_id, layer, speculation_id, expected_offset]   (protobuf)
                    [keys prefix][keys bytes][values prefix][values bytes]
                    [state prefix, advance, conv prefix][conv bytes][delta prefix][delta bytes]
"""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

from . import wire
from .dtypes import DType, byte_view
from .proto import pb

# UpdateRequest's and RecurrentState's tensor fields (a unit test holds them to the .proto).
UPDATE_KEYS, UPDATE_VALUES, UPDATE_STATE = 3, 4, 5
STATE_CONV, STATE_DELTA, STATE_ADVANCE = 1, 2, 3

Piece = Union[bytes, memoryview]


@dataclass
class RecurrentStateUpdate:
    """A recurrent layer's new state: conv [B, conv_tail, conv_dim] and delta
    [B, num_v_heads, head_v_dim, head_k_dim]; the layer's offset moves up by
    `advance` (0 replaces the state in place)."""

    conv: Any
    delta: Any
    advance: int = 0


@dataclass
class LayerUpdate:
    """One layer's step: keys [B, H, L, Dk] and values [B, H, L, Dv] (numpy
    arrays or torch tensors of one dtype), or a recurrent layer's `state`.

    expected_offset: applied only if the layer is at this offset.
    speculation_id: drafted in that open speculation instead."""

    layer: int
    keys: Any = None
    values: Any = None
    state: Optional[RecurrentStateUpdate] = None
    expected_offset: Optional[int] = None
    speculation_id: str = ""


def _tensor_pieces(field: int, tensor: Any, dtype: Optional[DType]) -> Tuple[DType, List[Piece]]:
    """A tensor field's dtype, prefix and bytes; its dtype must be `dtype` if set."""
    tensor_dtype, shape, data = byte_view(tensor)
    if dtype is not None and tensor_dtype != dtype:
        raise TypeError("an update mixes %s and %s tensors" % (dtype.name, tensor_dtype.name))
    return tensor_dtype, [wire.tensor_prefix(field, tensor_dtype, shape, len(data)), data]


def _state_pieces(state: RecurrentStateUpdate, dtype: Optional[DType]) -> List[Piece]:
    dtype, conv = _tensor_pieces(STATE_CONV, state.conv, dtype)
    _, delta = _tensor_pieces(STATE_DELTA, state.delta, dtype)
    advance = b""
    if state.advance:
        advance = wire.encode_tag(STATE_ADVANCE, wire.VARINT) + wire.encode_varint(state.advance)
    body_bytes = len(advance) + encoded_bytes(conv + delta)
    return [wire.length_prefix(UPDATE_STATE, body_bytes) + advance] + conv + delta


def _scalars(cache_id: str, update: LayerUpdate) -> bytes:
    request = pb.UpdateRequest(cache_id=cache_id, layer=update.layer,
                               speculation_id=update.speculation_id)
    if update.expected_offset is not None:
        request.expected_offset = update.expected_offset
    return request.SerializeToString()


def encode_update(cache_id: str, update: LayerUpdate) -> List[Piece]:
    """The pieces of `update`'s UpdateRequest for cache `cache_id`.

    Keys and values are sent when given; a state-only update sends neither,
    so the server sees exactly what was meant (K/V for a recurrent layer is
    refused, as it should be)."""
    pieces: List[Piece] = [_scalars(cache_id, update)]
    dtype: Optional[DType] = None
    if update.keys is not None or update.values is not None:
        if update.keys is None or update.values is None:
            raise ValueError("layer %d: keys and values go together" % update.layer)
        dtype, keys = _tensor_pieces(UPDATE_KEYS, update.keys, None)
        _, values = _tensor_pieces(UPDATE_VALUES, update.values, dtype)
        pieces += keys + values
    if update.state is not None:
        pieces += _state_pieces(update.state, dtype)
    return pieces


def encoded_bytes(pieces: Sequence[Piece]) -> int:
    """The length of an encoded request."""
    return sum(len(piece) for piece in pieces)


def join(pieces: Sequence[Piece]) -> bytes:
    """An encoded request as one bytes object (gRPC's message): one copy."""
    return b"".join(pieces)
