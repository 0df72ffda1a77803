"""Status codes from either transport become one exception type."""

import pickle

import grpc
import pytest

from kvcached import errors


class FakeRpcError(grpc.RpcError):
    """What grpcio raises: an RpcError that is also a Call with a status."""

    def __init__(self, code, details):
        super().__init__()
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_lane_codes_map_to_the_same_grpc_code(code):
    error = errors.from_lane_status(code.value[0], "layer: out of range")
    assert error.code is code
    assert error.message == "layer: out of range"


def test_a_code_grpc_lacks_is_unknown():
    assert errors.from_lane_status(99, "?").code is grpc.StatusCode.UNKNOWN


def test_rpc_errors_keep_code_and_message():
    error = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.NOT_FOUND, "cache_id: unknown"))
    assert isinstance(error, errors.KvCacheError)
    assert error.code is grpc.StatusCode.NOT_FOUND
    assert error.message == "cache_id: unknown"
    assert "NOT_FOUND" in str(error) and "cache_id: unknown" in str(error)


def test_rpc_errors_without_a_status_are_unknown():
    error = errors.from_rpc_error(grpc.RpcError("channel closed"))
    assert error.code is grpc.StatusCode.UNKNOWN


def test_errors_pickle():
    error = errors.KvCacheError(grpc.StatusCode.INVALID_ARGUMENT, "keys: shape")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.code, copy.message) == (error.code, error.message)
