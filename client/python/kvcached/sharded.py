"""kvcached.ShardedClient: one client of a fleet of kvcached replicas, over a
static list of addresses (kvcache::ShardedClient, client/sharded_client.h).

    with kvcached.ShardedClient(["kvcached-0=10.0.0.1:50051", "10.0.0.2:50051"]) as fleet:
        info = fleet.create_cache(spec, placement_key="session-17")
        fleet.owner(info.cache_id).update(info.cache_id, 0, keys, values)

Each cache is placed by rendezvous hashing of a placement key: the score of
(key, replica) is XXH3-64 of the key seeded with XXH3-64 of the replica's
name (its --replica_name), so this client ranks replicas exactly as the C++
one does. A replica names itself in every id it makes ("<name>:<hex>"), so
every later call about an id goes to that replica (`owner`), with no lookup.
A replica that is down (or full, for creates) is passed over for the next of
the key's order. Prefixes are routed by (token, model, the first
prefix_route_tokens tokens), so a cache created for a prompt lives beside the
prefixes it restores from.

XXH3-64 comes from the system's libxxhash (Debian: libxxhash0) through
ctypes; where it does not load, constructing a ShardedClient raises
XxhashUnavailable (an ImportError). etcd discovery is the C++ client's only.
"""

import ctypes
import dataclasses
import random
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar, Union

import grpc

from .client import Client
from .errors import KvCacheError
from .handles import Cache
from .options import ClientOptions
from .proto import pb

T = TypeVar("T")

# As protos/wire/ids/replica_id.h.
REPLICA_SEPARATOR = ":"
MAX_REPLICA_NAME_BYTES = 63
# The lease of a snapshot copied only to restore or publish from, released
# right after: if this client dies in between, the copy goes within a minute.
TRANSIENT_COPY_TTL_SECONDS = 60
LIBXXHASH = "libxxhash.so.0"


class XxhashUnavailable(ImportError):
    """The system's libxxhash (Debian: libxxhash0) could not be loaded."""


class _Xxh3:
    """XXH3_64bits and XXH3_64bits_withSeed of libxxhash, through ctypes."""

    def __init__(self) -> None:
        try:
            library = ctypes.CDLL(LIBXXHASH)
            self.plain = library.XXH3_64bits
            self.seeded = library.XXH3_64bits_withSeed
        except (OSError, AttributeError) as error:
            raise XxhashUnavailable(
                "kvcached.ShardedClient needs XXH3-64 from %s (Debian: apt install libxxhash0): %s"
                % (LIBXXHASH, error)) from None
        self.plain.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self.plain.restype = ctypes.c_uint64
        self.seeded.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
        self.seeded.restype = ctypes.c_uint64


_xxh3: Optional[_Xxh3] = None
_xxh3_lock = threading.Lock()


def load_xxhash() -> None:
    """Loads libxxhash once; XxhashUnavailable where it cannot be."""
    global _xxh3
    with _xxh3_lock:
        if _xxh3 is None:
            _xxh3 = _Xxh3()


def _as_bytes(text: Union[str, bytes]) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)


def rendezvous_score(key: Union[str, bytes], replica_name: Union[str, bytes]) -> int:
    """XXH3-64 of `key` seeded with XXH3-64 of `replica_name` (str as UTF-8):
    RendezvousScore of client/rendezvous.h, an unsigned 64-bit integer."""
    load_xxhash()
    assert _xxh3 is not None
    key, name = _as_bytes(key), _as_bytes(replica_name)
    return _xxh3.seeded(key, len(key), _xxh3.plain(name, len(name)))


def rendezvous_order(key: Union[str, bytes], replica_names: Sequence[str]) -> List[int]:
    """Indexes into `replica_names`, highest score first (ties: lower index first)."""
    scores = [rendezvous_score(key, name) for name in replica_names]
    return sorted(range(len(scores)), key=lambda index: -scores[index])  # stable


def replica_of_id(handle: str) -> str:
    """The replica an id names: the text before its last separator; "" where
    it has none (an id of a server run without --replica_name)."""
    at = handle.rfind(REPLICA_SEPARATOR)
    return "" if at < 0 else handle[:at]


def check_replica_name(name: str, field: str) -> None:
    """KvCacheError(INVALID_ARGUMENT) unless `name` can name a replica: 1 to 63
    letters, digits, '-', '_' or '.'."""
    if not 1 <= len(name.encode("utf-8")) <= MAX_REPLICA_NAME_BYTES:
        raise KvCacheError(grpc.StatusCode.INVALID_ARGUMENT,
                           "%s: a replica name has 1 to %d characters, not %d"
                           % (field, MAX_REPLICA_NAME_BYTES, len(name)))
    if not all(c.isascii() and (c.isalnum() or c in "-_.") for c in name):
        raise KvCacheError(grpc.StatusCode.INVALID_ARGUMENT,
                           "%s: a replica name has only letters, digits, '-', '_' and '.'"
                           % field)


@dataclass
class Replica:
    """One replica of the fleet: `name` its --replica_name ("": asked of the
    server when the client is made), `address` host:port of its gRPC port."""

    name: str = ""
    address: str = ""


def parse_replica(entry: Union[str, Replica]) -> Replica:
    """A Replica from "name=host:port" or "host:port" (kvcachectl --peers'
    entries, without dns:); a Replica is returned as a copy."""
    if isinstance(entry, Replica):
        return dataclasses.replace(entry)
    text = entry.strip()
    name, address = "", text
    if "=" in text:
        name, address = text.split("=", 1)
        check_replica_name(name, "replicas")
    if not address:
        raise KvCacheError(grpc.StatusCode.INVALID_ARGUMENT,
                           "replicas: an entry without an address")
    return Replica(name, address)


def _passes_over(error: KvCacheError, also_full: bool) -> bool:
    """Whether a create (or a prompt's lookup) goes on to the next replica."""
    return error.code == grpc.StatusCode.UNAVAILABLE or (
        also_full and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED)


def _cannot_pull(error: KvCacheError) -> bool:
    """Whether a PullSnapshot failed because the replica cannot pull at all (no
    peer list, the owner not in it, an older server): then the bytes go
    through this client instead."""
    return error.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED,
                          grpc.StatusCode.UNAVAILABLE) or (
        error.code == grpc.StatusCode.NOT_FOUND
        and error.message.startswith("snapshot_id: replica"))


def _ask_name(options: ClientOptions) -> str:
    """The replica's own name (GetStats.replica_name), asked of it."""
    with Client(options) as probe:
        stats = probe.get_stats()
    if not stats.replica_name:
        raise KvCacheError(grpc.StatusCode.FAILED_PRECONDITION,
                           "replica at %s runs without --replica_name: its ids do not say where "
                           "they live" % options.address)
    return stats.replica_name


class ShardedClient:
    """A client of a static fleet of kvcached replicas; routes as the C++
    ShardedClient does (same scores, same order, same id-to-replica rule).
    Nothing changes after construction, so threads may share it as they
    share a Client."""

    def __init__(self, replicas: Sequence[Union[str, Replica]],
                 options: Optional[ClientOptions] = None, *, prefix_route_tokens: int = 64,
                 connect_timeout: float = 5.0) -> None:
        """Connects to every replica and learns the names not given.

        replicas: "name=host:port", "host:port" or Replica entries.
        options: everything but `address` (and `replica`) for each replica's
            Client; data_lane "" or "auto" (each replica's own lane).
            max_reconnect_backoff 0 becomes 2 s, and first_connect_wait is 0
            (a replica that is down fails fast, and creates go on).
        prefix_route_tokens: how many leading tokens route a prompt.
        connect_timeout: how long each replica has to tell its name (all are
            asked at once).

        Raises XxhashUnavailable without libxxhash; KvCacheError where a
        replica without a given name does not answer, where one runs without
        --replica_name or under another name than given, or where two share
        a name. A named replica that is down is fine: it is passed over."""
        load_xxhash()
        listed = [parse_replica(entry) for entry in replicas]
        options = options or ClientOptions()
        if not listed:
            raise KvCacheError(grpc.StatusCode.INVALID_ARGUMENT,
                               "replicas: a fleet needs at least one")
        if options.data_lane not in ("", "auto"):
            raise KvCacheError(grpc.StatusCode.INVALID_ARGUMENT,
                               'options.data_lane: "" or "auto" for a fleet (each replica names '
                               "its own lane)")
        if prefix_route_tokens < 1:
            raise KvCacheError(grpc.StatusCode.INVALID_ARGUMENT,
                               "prefix_route_tokens: must be at least 1")
        options = dataclasses.replace(
            options, first_connect_wait=0.0,
            max_reconnect_backoff=options.max_reconnect_backoff or 2.0)
        self.options: ClientOptions = options
        self.prefix_route_tokens: int = prefix_route_tokens
        # One address for several replicas is a proxy's: only named ones may share it.
        unnamed_at = {}
        entries_at = {}
        for replica in listed:
            entries_at[replica.address] = entries_at.get(replica.address, 0) + 1
            unnamed_at[replica.address] = unnamed_at.get(replica.address, False) or not replica.name
            if entries_at[replica.address] > 1 and unnamed_at[replica.address]:
                raise KvCacheError(grpc.StatusCode.INVALID_ARGUMENT,
                                   "replicas: %s is listed twice (name each replica behind a "
                                   "proxy)" % replica.address)
        self._learn_names(listed, connect_timeout)
        self._replicas: List[Replica] = listed
        self._names: List[str] = [replica.name for replica in listed]
        self._clients: List[Client] = [
            Client(dataclasses.replace(options, address=replica.address, replica=replica.name))
            for replica in listed]

    def _learn_names(self, listed: List[Replica], timeout: float) -> None:
        """Asks every replica its name at once; fills in the missing ones and
        checks the given ones."""
        learned: List[Union[str, BaseException, None]] = [None] * len(listed)

        def ask(index: int) -> None:
            probe = dataclasses.replace(self.options, address=listed[index].address,
                                        replica=listed[index].name, deadline=timeout)
            try:
                learned[index] = _ask_name(probe)
            except BaseException as error:  # noqa: B036 - raised again below, on this thread
                learned[index] = error

        askers = [threading.Thread(target=ask, args=(i,), daemon=True)
                  for i in range(len(listed))]
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join()
        names = set()
        for replica, name in zip(listed, learned):
            if name is None or (isinstance(name, BaseException)
                                and not isinstance(name, KvCacheError)):
                raise name or RuntimeError("replica at %s: no answer" % replica.address)
            if isinstance(name, KvCacheError):
                down = name.code in (grpc.StatusCode.UNAVAILABLE,
                                     grpc.StatusCode.DEADLINE_EXCEEDED)
                if not down or not replica.name:
                    raise KvCacheError(name.code, "replica at %s: cannot learn its name: %s"
                                       % (replica.address, name.message))
            else:
                if not replica.name:
                    replica.name = name
                if name != replica.name:
                    raise KvCacheError(grpc.StatusCode.FAILED_PRECONDITION,
                                       'replica at %s is "%s", not "%s"'
                                       % (replica.address, name, replica.name))
            if replica.name in names:
                raise KvCacheError(grpc.StatusCode.INVALID_ARGUMENT,
                                   'replicas: two are named "%s"' % replica.name)
            names.add(replica.name)

    def __enter__(self) -> "ShardedClient":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Closes every replica's Client."""
        for client in self._clients:
            client.close()

    # The fleet.

    def size(self) -> int:
        """How many replicas the fleet has."""
        return len(self._replicas)

    def replica(self, index: int) -> Replica:
        """Replica `index` (its name learned where it was not given)."""
        return dataclasses.replace(self._replicas[index])

    def client(self, index: int) -> Client:
        """Replica `index`'s Client."""
        return self._clients[index]

    def members(self) -> List[int]:
        """The replicas new caches may go to: all of a static fleet."""
        return list(range(len(self._replicas)))

    def replica_of(self, handle: str) -> int:
        """The index of the replica that made `handle` (a cache, snapshot or
        speculation id): INVALID_ARGUMENT where the id names none, NOT_FOUND
        where no replica of this fleet has that name."""
        name = replica_of_id(handle)
        if not name:
            raise KvCacheError(grpc.StatusCode.INVALID_ARGUMENT,
                               'id: it names no replica ("<replica>:<hex>")')
        try:
            return self._names.index(name)
        except ValueError:
            raise KvCacheError(grpc.StatusCode.NOT_FOUND,
                               'id: no replica of this fleet is named "%s"'
                               % name[:MAX_REPLICA_NAME_BYTES]) from None

    def owner(self, handle: str) -> Client:
        """The Client of the replica that made `handle`: every call about it goes there."""
        return self._clients[self.replica_of(handle)]

    def order(self, key: Union[str, bytes]) -> List[int]:
        """The replicas in the order `key` tries them (str keys as UTF-8)."""
        return rendezvous_order(key, self._names)

    def prompt_key(self, spec: pb.CacheSpec, tokens: Sequence[int]) -> bytes:
        """The key prompts are routed by: the token, the model and the first
        prefix_route_tokens tokens (little-endian uint32), lengths first."""
        token = self.options.token.encode("utf-8")
        model = spec.model.encode("utf-8")
        routed = [int(t) for t in list(tokens)[:self.prefix_route_tokens]]
        try:
            packed = struct.pack("<%dI" % len(routed), *routed)
        except struct.error:
            raise KvCacheError(grpc.StatusCode.INVALID_ARGUMENT,
                               "tokens: each is a uint32") from None
        return b"prompt:%d:%s%d:%s:" % (len(token), token, len(model), model) + packed

    def _first_that_takes(self, key: Union[str, bytes], also_full: bool,
                          call: Callable[[Client], T]) -> Tuple[T, int]:
        """call() on the replicas of `key`'s order until one does not answer
        UNAVAILABLE (or, where `also_full`, RESOURCE_EXHAUSTED): its answer
        and its index."""
        last: Optional[KvCacheError] = None
        for index in self.order(key):
            try:
                return call(self._clients[index]), index
            except KvCacheError as error:
                if not _passes_over(error, also_full):
                    raise
                last = KvCacheError(error.code,
                                    "replica %s: %s" % (self._names[index], error.message))
        assert last is not None
        raise KvCacheError(last.code, "no replica took it; the last: %s" % last.message)

    def _check_made_by(self, handle: str, index: int, what: str) -> None:
        """FAILED_PRECONDITION unless replica `index` made `handle`: later calls
        would route it elsewhere (a replica restarted under another
        --replica_name, or listed at the wrong address)."""
        name = replica_of_id(handle)
        if name and name in self._names and self._names.index(name) == index:
            return
        raise KvCacheError(grpc.StatusCode.FAILED_PRECONDITION,
                           'replica %s answered with %s id "%s", which names another replica or '
                           "none of this fleet (restarted under another --replica_name, or "
                           "listed at the wrong address?)" % (self._names[index], what,
                                                              handle[:80]))

    # Caches.

    def create_cache(self, spec: pb.CacheSpec, *, ttl_seconds: int = 0,
                     placement_key: Union[str, bytes] = "") -> pb.CacheInfo:
        """Creates the cache on the first replica of the placement key's order
        that takes it (one down or full is passed over); an empty key spreads
        caches evenly (a random key each)."""
        key = placement_key or "random:%d%d" % (random.getrandbits(64), random.getrandbits(64))
        info, index = self._first_that_takes(
            key, True, lambda client: client.create_cache(spec, ttl_seconds=ttl_seconds))
        try:
            self._check_made_by(info.cache_id, index, "cache")
        except KvCacheError:
            try:  # so it does not sit unreachable (a lease, if any, ends it otherwise)
                self._clients[index].delete_cache(info.cache_id)
            except KvCacheError:
                pass
            raise
        return info

    def new_cache(self, spec: pb.CacheSpec, *, ttl_seconds: int = 0,
                  placement_key: Union[str, bytes] = "") -> Cache:
        """create_cache as a handle on its replica's Client; as a context
        manager, deletes the cache on the way out."""
        info = self.create_cache(spec, ttl_seconds=ttl_seconds, placement_key=placement_key)
        return Cache(self.owner(info.cache_id), info)

    def create_cache_for_prompt(self, spec: pb.CacheSpec, tokens: Sequence[int], *,
                                ttl_seconds: int = 0) -> pb.CacheInfo:
        """Creates the cache on the replica that prefix lookups of `tokens` go to."""
        return self.create_cache(spec, ttl_seconds=ttl_seconds,
                                 placement_key=self.prompt_key(spec, tokens))

    # Prefixes.

    def lookup_prefix(self, spec: pb.CacheSpec, tokens: Sequence[int], *,
                      ttl_seconds: int = 0) -> pb.LookupPrefixResponse:
        """The longest cached prefix of `tokens`, asked of the prompt's replica
        (or the next one up)."""
        found, index = self._first_that_takes(
            self.prompt_key(spec, tokens), False,
            lambda client: client.lookup_prefix(tokens, spec=spec, ttl_seconds=ttl_seconds))
        if found.HasField("snapshot"):
            handle = found.snapshot.snapshot_id
            try:
                self._check_made_by(handle, index, "snapshot")
            except KvCacheError:
                try:  # its lease ends it otherwise
                    self._clients[index].release_snapshot(handle)
                except KvCacheError:
                    pass
                raise
        return found

    def publish_prefix(self, spec: pb.CacheSpec, snapshot_id: str, tokens: Sequence[int], *,
                       ttl_seconds: int = 0) -> pb.PublishPrefixResponse:
        """Publishes on the prompt's replica (or the next one up); a snapshot
        that lives elsewhere is copied there first, and the copy released once
        published (the index keeps its own handle)."""
        owner = self.replica_of(snapshot_id)
        last: Optional[KvCacheError] = None
        for index in self.order(self.prompt_key(spec, tokens)):
            client = self._clients[index]
            if index == owner:
                try:
                    return client.publish_prefix(snapshot_id, tokens, ttl_seconds=ttl_seconds)
                except KvCacheError as error:
                    if error.code != grpc.StatusCode.UNAVAILABLE:
                        raise
                    last = error
                    continue
            try:
                copy = self.copy_snapshot_to(snapshot_id, index,
                                             ttl_seconds=TRANSIENT_COPY_TTL_SECONDS)
            except KvCacheError as error:
                if error.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                last = error
                continue
            try:
                return client.publish_prefix(copy.snapshot_id, tokens, ttl_seconds=ttl_seconds)
            finally:
                _release_quietly(client, copy.snapshot_id)
        assert last is not None
        raise KvCacheError(last.code, "no replica took it; the last: %s" % last.message)

    # Snapshots across replicas.

    def restore(self, cache_id: str, target_offset: int,
                snapshot_id: str = "") -> pb.CacheInfo:
        """Client.restore on the cache's replica; a snapshot of another replica
        is copied to it first, and the copy released afterwards."""
        cache_owner = self.replica_of(cache_id)
        client = self._clients[cache_owner]
        if not snapshot_id or self.replica_of(snapshot_id) == cache_owner:
            return client.restore(cache_id, target_offset, snapshot_id)
        copy = self.copy_snapshot_to(snapshot_id, cache_owner,
                                     ttl_seconds=TRANSIENT_COPY_TTL_SECONDS)
        try:
            return client.restore(cache_id, target_offset, copy.snapshot_id)
        finally:  # the cache shares the copy's pages; the handle can go
            _release_quietly(client, copy.snapshot_id)

    def copy_snapshot_to(self, snapshot_id: str, to: int, *, pinned: bool = False,
                         ttl_seconds: int = 0) -> pb.SnapshotInfo:
        """Copies a snapshot (from offset 0) to replica `to`: a new snapshot
        there, with that replica's id; the original stays. Replica `to` pulls
        it (PullSnapshot); where it cannot (no --peers, an older server), the
        file passes through this client, held in memory on the way
        (ExportSnapshot, ImportSnapshot)."""
        if not 0 <= to < len(self._clients):
            raise KvCacheError(grpc.StatusCode.INVALID_ARGUMENT,
                               "to: the fleet has %d replicas, not %d" % (len(self._clients),
                                                                          to + 1))
        source = self.owner(snapshot_id)
        target = self._clients[to]
        copied: Optional[pb.LoadSnapshotResponse] = None
        if source is not target:
            try:
                copied = target.pull_snapshot(snapshot_id, pinned=pinned, ttl_seconds=ttl_seconds)
            except KvCacheError as error:
                if not _cannot_pull(error):
                    raise
        if copied is None:
            data = source.export_snapshot(snapshot_id=snapshot_id)
            copied = target.import_snapshot(data, pinned=pinned, ttl_seconds=ttl_seconds)
        handle = copied.snapshot.snapshot_id
        try:
            self._check_made_by(handle, to, "snapshot")
        except KvCacheError:
            _release_quietly(target, handle)  # its lease, if any, ends it otherwise
            raise
        return copied.snapshot

    def get_stats(self) -> List[Union[pb.Stats, KvCacheError]]:
        """Each replica's GetStats, in replica order (one that failed: its error)."""
        stats: List[Union[pb.Stats, KvCacheError]] = []
        for client in self._clients:
            try:
                stats.append(client.get_stats())
            except KvCacheError as error:
                stats.append(error)
        return stats


def _release_quietly(client: Client, snapshot_id: str) -> None:
    """Releases a transient copy; where that fails, its lease ends it."""
    try:
        client.release_snapshot(snapshot_id)
    except KvCacheError:
        pass
