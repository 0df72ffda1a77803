"""The kvcache.v1 messages and stub, generated from protos/ (see _stubs).

`pb` is kvcache.v1's module of messages and enums (pb.CacheSpec, pb.DTYPE_FLOAT16,
pb.LANE_FRAME_UPDATE...); `pb_grpc` holds KvCacheServiceStub; `health_pb` and
`health_pb_grpc` the standard gRPC health check.
"""

try:
    from ._stubs.kvcache.v1 import kvcache_pb2 as pb
    from ._stubs.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
    from ._stubs.grpc.health.v1 import health_pb2 as health_pb
    from ._stubs.grpc.health.v1 import health_pb2_grpc as health_pb_grpc
except ImportError as missing:  # a source tree whose stubs were not generated
    raise ImportError(
        "kvcached's generated stubs are missing: install the package (pip install "
        "./client/python), or run client/python/generate_stubs.py OUT_DIR and set "
        "KVCACHED_STUBS_DIR=OUT_DIR") from missing

__all__ = ["pb", "pb_grpc", "health_pb", "health_pb_grpc"]
