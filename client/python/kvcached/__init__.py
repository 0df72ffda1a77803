"""kvcached's Python client: caches, snapshots, speculation, prefixes and
files of a kvcached server, with K/V tensors moved without extra copies.

    import kvcached
    with kvcached.Client(address="127.0.0.1:50051") as client:
        spec = kvcached.specs.cache_spec([kvcached.specs.standard(8, 128)] * 32)
        with client.new_cache(spec) as cache:
            client.update(cache.id, 0, keys, values)
            history = client.fetch(cache.id, 0)

Every failed call raises KvCacheError (its `code` a grpc.StatusCode).
ShardedClient is a client of a fleet of replicas (needs the system's libxxhash).
"""

from . import specs
from .client import Client, new_request_id
from .dtypes import DType
from .errors import KvCacheError
from .fetch import LayerHistory
from .handles import Cache, Snapshot, Speculation
from .options import ClientOptions
from .proto import pb
from .sharded import Replica, ShardedClient, XxhashUnavailable
from .update_encoding import LayerUpdate, RecurrentStateUpdate

__all__ = ["Cache", "Client", "ClientOptions", "DType", "KvCacheError", "LayerHistory",
           "LayerUpdate", "RecurrentStateUpdate", "Replica", "ShardedClient", "Snapshot",
           "Speculation", "XxhashUnavailable", "new_request_id", "pb", "specs"]
