"""The one exception every failed call raises, whichever transport carried it.

The server answers each failure with a gRPC status code and a message naming
the field or the reason (kvcache.proto: INVALID_ARGUMENT naming the field,
NOT_FOUND for an unknown id, ...). Over gRPC it arrives as a grpc.RpcError,
over the data lane as a LaneStatus frame; both become a KvCacheError, so a
caller handles one type and reads `code` the same way everywhere.
"""

from typing import Dict

import grpc

# grpc.StatusCode by its integer value (a LaneStatus carries the integer).
_CODES_BY_VALUE: Dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


class KvCacheError(Exception):
    """A call that failed: the status `code` and the server's `message`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__("%s: %s" % (code.name, message))
        self.code: grpc.StatusCode = code
        self.message: str = message

    def __reduce__(self):  # picklable across processes, as exceptions should be
        return (KvCacheError, (self.code, self.message))


def status_code_of(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode of an integer code; UNKNOWN for one gRPC lacks."""
    return _CODES_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def from_rpc_error(error: grpc.RpcError) -> KvCacheError:
    """A grpc.RpcError (whose call ended with a status) as a KvCacheError."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else None
    if not isinstance(code, grpc.StatusCode):
        return KvCacheError(grpc.StatusCode.UNKNOWN, str(error))
    return KvCacheError(code, details or "")


def from_lane_status(code: int, message: str) -> KvCacheError:
    """A data lane's LaneStatus (a non-zero code) as a KvCacheError."""
    return KvCacheError(status_code_of(code), message)
