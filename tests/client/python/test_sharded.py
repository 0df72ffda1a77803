"""kvcached.ShardedClient: rendezvous scores equal the C++ client's
(client/rendezvous.cc), the order and ownership rules, and a fleet of real
kvcached replicas (--replica_name): caches land where the C++ rule puts them,
calls about an id go to its replica, replicas that are down are passed over,
and every test leaves no cache, snapshot or page behind."""

import numpy as np
import grpc
import pytest

import kvcached
from kvcached import sharded, specs
from kvcached.dtypes import DType
from kvcached_process import Kvcached

NAMES = ["kvcached-0", "kvcached-1", "kvcached-2"]
# A port nothing listens on: a replica that is down.
DOWN = "127.0.0.1:1"

# RendezvousScore(key, name) for NAMES, from client/rendezvous.cc built
# against /usr/include/xxhash.h (keys of every length class of XXH3:
# 0, 1-16, 17-128, 129-240 and longer).
GOLDEN = [
    (b"", [13141184110383729236, 12452708050847009147, 7495584457166783602]),
    (b"key0", [6123292943745834842, 8884012721772067276, 10554463591561890319]),
    (b"cache42", [6316453472538332745, 7198136678374185938, 11660644991136980126]),
    (b"prompt:3:tok5:llama:\x01\x00\x00\x00\x02\x01\x00\x00",
     [9132173911863433504, 11444773201754290481, 14388770737212945459]),
    (b"x" * 100, [5566989197288347092, 14132850242848461429, 11220827004057710130]),
    (b"y" * 200, [18124931205656024739, 16240528272967867234, 12676246795414364263]),
    (b"z" * 1000, [5564802684542103445, 2741287158718760949, 17769005571593348733]),
]


def test_scores_equal_the_cpp_clients():
    for key, scores in GOLDEN:
        assert [sharded.rendezvous_score(key, name) for name in NAMES] == scores, key
    assert sharded.rendezvous_score("key0", "kvcached-1") == GOLDEN[1][1][1]  # str as UTF-8
    for key, scores in GOLDEN:
        expected = sorted(range(3), key=lambda i: -scores[i])
        assert sharded.rendezvous_order(key, NAMES) == expected


def test_order_is_a_permutation_by_name_not_place():
    orders = set()
    for i in range(200):
        order = sharded.rendezvous_order("key%d" % i, NAMES)
        assert sorted(order) == [0, 1, 2]
        orders.add(tuple(order))
    assert len(orders) == 6, "every order of three replicas occurs"
    shuffled = [NAMES[2], NAMES[0], NAMES[1]]
    for i in range(50):
        key = "key%d" % i
        assert (shuffled[sharded.rendezvous_order(key, shuffled)[0]]
                == NAMES[sharded.rendezvous_order(key, NAMES)[0]])
    # Ties (one name twice): the lower index first.
    assert sharded.rendezvous_order("key", ["a", "a", "a"]) == [0, 1, 2]


def test_keys_spread_and_a_lost_replica_moves_only_its_own():
    owners = [0, 0, 0]
    two = [NAMES[0], NAMES[2]]
    for i in range(3000):
        key = "cache%d" % i
        order = sharded.rendezvous_order(key, NAMES)
        owners[order[0]] += 1
        following = order[1] if order[0] == 1 else order[0]
        assert two[sharded.rendezvous_order(key, two)[0]] == NAMES[following], key
    assert all(abs(count - 1000) < 120 for count in owners), owners


def test_ids_name_their_replica():
    assert sharded.replica_of_id("kvcached-1:00ff") == "kvcached-1"
    assert sharded.replica_of_id("a:b:00ff") == "a:b"  # the last separator
    assert sharded.replica_of_id("00ff") == ""


def test_refusals_before_any_server(monkeypatch):
    with pytest.raises(kvcached.KvCacheError) as lane:
        kvcached.ShardedClient(["a=" + DOWN], kvcached.ClientOptions(data_lane="127.0.0.1:2"))
    assert lane.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for twice in (["a=" + DOWN, DOWN], [DOWN, "b=" + DOWN]):
        with pytest.raises(kvcached.KvCacheError) as refused:
            kvcached.ShardedClient(twice)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for bad in ([], ["a:b=" + DOWN], ["name="]):
        with pytest.raises(kvcached.KvCacheError) as refused:
            kvcached.ShardedClient(bad)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "replicas" in refused.value.message
    with pytest.raises(kvcached.KvCacheError) as zero:
        kvcached.ShardedClient(["a=" + DOWN], prefix_route_tokens=0)
    assert zero.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # A replica that does not answer must be named, or its ids could not be routed.
    with pytest.raises(kvcached.KvCacheError) as nameless:
        kvcached.ShardedClient([DOWN], connect_timeout=2)
    assert nameless.value.code == grpc.StatusCode.UNAVAILABLE
    # Named replicas behind one address (a proxy) that is down: fine, and passed over.
    with kvcached.ShardedClient(["a=" + DOWN, "b=" + DOWN], connect_timeout=2) as fleet:
        with pytest.raises(kvcached.KvCacheError) as down:
            fleet.create_cache(pb_spec())
        assert down.value.code == grpc.StatusCode.UNAVAILABLE
        assert "no replica took it" in down.value.message
        with pytest.raises(kvcached.KvCacheError) as unnamed_id:
            fleet.owner("00ff")
        assert unnamed_id.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(kvcached.KvCacheError) as unknown:
            fleet.owner("c:00ff")
        assert unknown.value.code == grpc.StatusCode.NOT_FOUND


def test_without_libxxhash_construction_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(sharded, "_xxh3", None)
    monkeypatch.setattr(sharded, "LIBXXHASH", "libxxhash-missing.so.0")
    with pytest.raises(ImportError, match="libxxhash0"):
        kvcached.ShardedClient(["a=" + DOWN])


def test_prompt_key_is_the_cpp_clients():
    with kvcached.ShardedClient(["a=" + DOWN], kvcached.ClientOptions(token="tok"),
                                prefix_route_tokens=2, connect_timeout=1) as fleet:
        spec = kvcached.pb.CacheSpec(model="llama")
        # Lengths first; tokens little-endian uint32; only the first two route.
        assert fleet.prompt_key(spec, [1, 258, 7]) == GOLDEN[3][0]
        assert fleet.prompt_key(spec, [1, 258]) == fleet.prompt_key(spec, [1, 258, 9, 9])
        assert fleet.prompt_key(spec, [1]) != fleet.prompt_key(spec, [1, 258])
        with pytest.raises(kvcached.KvCacheError) as negative:
            fleet.prompt_key(spec, [-1])
        assert negative.value.code == grpc.StatusCode.INVALID_ARGUMENT


# Against real replicas.

HEADS, DIM = 2, 8


def pb_spec(model="sharded-test"):
    return specs.cache_spec([specs.standard(HEADS, DIM)] * 2, dtype=DType.FLOAT16, model=model)


@pytest.fixture(scope="module")
def replicas(kvcached_path):
    started = []
    try:
        for name in NAMES:
            started.append(Kvcached(kvcached_path, ["--replica_name=" + name]))
        yield started
    finally:
        for process in started:
            assert process.stop() == 0, "".join(process.log)


def assert_nothing_held(client):
    """Every cache, snapshot and page released (what is left is cleaned up first)."""
    stats = client.get_stats()
    held = (stats.caches, stats.snapshots, stats.pages_used)
    if held != (0, 0, 0):
        for cache in client.list_caches():
            client.delete_cache(cache.cache_id)
        for snapshot in client.list_snapshots():
            client.release_snapshot(snapshot.snapshot_id)
    assert held == (0, 0, 0), "%s: caches, snapshots, pages still held" % client.options.address


@pytest.fixture
def fleet(replicas):
    """The three replicas, their names learned from each."""
    with kvcached.ShardedClient([process.address for process in replicas],
                                kvcached.ClientOptions(deadline=30, keepalive_time=0)) as made:
        yield made
        for index in range(made.size()):
            assert_nothing_held(made.client(index))


def step(rng, tokens):
    shape = (1, HEADS, tokens, DIM)
    return rng.standard_normal(shape).astype(np.float16), rng.standard_normal(shape).astype(
        np.float16)


def test_names_are_learned_and_checked(fleet, replicas):
    assert [fleet.replica(i).name for i in range(3)] == NAMES
    assert [stats.replica_name for stats in fleet.get_stats()] == NAMES
    named = ["%s=%s" % (name, process.address) for name, process in zip(NAMES, replicas)]
    with kvcached.ShardedClient(named) as given:
        assert [given.replica(i).address for i in range(3)] == [p.address for p in replicas]
    swapped = ["kvcached-1=" + replicas[0].address, "kvcached-0=" + replicas[1].address]
    with pytest.raises(kvcached.KvCacheError) as wrong:
        kvcached.ShardedClient(swapped)
    assert wrong.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(kvcached.KvCacheError) as twice:
        kvcached.ShardedClient([replicas[0].address, "kvcached-0=" + DOWN])
    assert twice.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_replica_without_a_name_is_refused(kvcached_path, replicas):
    nameless = Kvcached(kvcached_path)
    try:
        with pytest.raises(kvcached.KvCacheError) as refused:
            kvcached.ShardedClient([replicas[0].address, nameless.address])
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "--replica_name" in refused.value.message
    finally:
        assert nameless.stop() == 0, "".join(nameless.log)


def test_caches_land_where_the_cpp_rule_says(fleet):
    landed = set()
    for i in range(12):
        key = "session-%d" % i
        info = fleet.create_cache(pb_spec(), placement_key=key)
        try:
            expected = sharded.rendezvous_order(key, NAMES)[0]
            assert sharded.replica_of_id(info.cache_id) == NAMES[expected]
            assert fleet.replica_of(info.cache_id) == expected
            assert [c.cache_id for c in fleet.client(expected).list_caches()] == [info.cache_id]
            landed.add(expected)
        finally:
            fleet.owner(info.cache_id).delete_cache(info.cache_id)
    assert landed == {0, 1, 2}
    with fleet.new_cache(pb_spec()) as random_key:  # no key: a random one
        assert random_key.client is fleet.owner(random_key.id)
        assert random_key.refresh().cache_id == random_key.id


def test_calls_about_an_id_go_to_its_replica(fleet):
    rng = np.random.default_rng(3)
    with fleet.new_cache(pb_spec(), placement_key="calls") as cache:
        owner = fleet.replica_of(cache.id)
        client = fleet.owner(cache.id)
        assert client is fleet.client(owner)
        keys, values = step(rng, 5)
        client.update_many(cache.id, [kvcached.LayerUpdate(0, keys, values),
                                      kvcached.LayerUpdate(1, keys, values)])
        assert client.fetch(cache.id, 1).keys.tobytes() == keys.tobytes()
        with client.new_snapshot(cache.id) as snap:
            assert fleet.replica_of(snap.id) == owner
            client.trim(cache.id, 5)
            assert list(fleet.restore(cache.id, 5, snap.id).layer_offsets) == [5, 5]
        for other in set(range(3)) - {owner}:
            with pytest.raises(kvcached.KvCacheError) as elsewhere:
                fleet.client(other).get_cache(cache.id)
            assert elsewhere.value.code == grpc.StatusCode.NOT_FOUND


def test_restore_from_a_snapshot_of_another_replica(fleet):
    rng = np.random.default_rng(4)
    keys, values = step(rng, 6)
    keys = np.ascontiguousarray(keys)
    first = next(i for i in range(50) if sharded.rendezvous_order("r%d" % i, NAMES)[0] == 0)
    second = next(i for i in range(50) if sharded.rendezvous_order("r%d" % i, NAMES)[0] == 1)
    with fleet.new_cache(pb_spec(), placement_key="r%d" % first) as source, \
            fleet.new_cache(pb_spec(), placement_key="r%d" % second) as target:
        assert (fleet.replica_of(source.id), fleet.replica_of(target.id)) == (0, 1)
        source.client.update_many(source.id, [kvcached.LayerUpdate(0, keys, values),
                                              kvcached.LayerUpdate(1, keys, values)])
        with source.client.new_snapshot(source.id) as snap:
            restored = fleet.restore(target.id, 6, snap.id)
        assert list(restored.layer_offsets) == [6, 6]
        assert target.client.fetch(target.id, 1).values.tobytes() == values.tobytes()
        assert target.client.list_snapshots() == []  # the copy was released


def test_prompts_route_prefixes_and_caches_together(fleet):
    rng = np.random.default_rng(5)
    spec = pb_spec("prompt-routing")
    prompt = list(range(100, 180))
    home = fleet.order(fleet.prompt_key(spec, prompt))[0]
    key = fleet.prompt_key(spec, prompt)
    assert key == fleet.prompt_key(spec, prompt[:64] + [1, 2])  # the first 64 tokens route
    # A cache made elsewhere publishes on the prompt's replica (the snapshot copied there).
    elsewhere = next(i for i in range(50)
                     if sharded.rendezvous_order("p%d" % i, NAMES)[0] != home)
    with fleet.new_cache(spec, placement_key="p%d" % elsewhere) as cache:
        keys, values = step(rng, len(prompt))
        cache.client.update_many(cache.id, [kvcached.LayerUpdate(0, keys, values),
                                            kvcached.LayerUpdate(1, keys, values)])
        with cache.client.new_snapshot(cache.id) as snap:
            published = fleet.publish_prefix(spec, snap.id, prompt)
    assert fleet.replica_of(published.entry.snapshot_id) == home
    assert len(fleet.client(home).list_prefixes()) == 1
    for other in set(range(3)) - {home}:
        assert fleet.client(other).list_prefixes() == []
    info = fleet.create_cache_for_prompt(spec, prompt + [7, 8])
    try:
        assert fleet.replica_of(info.cache_id) == home
        found = fleet.lookup_prefix(spec, prompt + [7, 8])
        assert found.matched_tokens == len(prompt)
        assert fleet.replica_of(found.snapshot.snapshot_id) == home
        try:
            restored = fleet.restore(info.cache_id, len(prompt), found.snapshot.snapshot_id)
            assert list(restored.layer_offsets) == [len(prompt)] * 2
        finally:
            fleet.owner(found.snapshot.snapshot_id).release_snapshot(found.snapshot.snapshot_id)
    finally:
        fleet.owner(info.cache_id).delete_cache(info.cache_id)
    fleet.client(home).release_snapshot(published.entry.snapshot_id)  # unpublishes it
    assert fleet.client(home).list_prefixes() == []


def test_a_replica_that_is_down_is_passed_over(replicas):
    names = ["kvcached-0", "kvcached-down", "kvcached-2"]
    listed = [replicas[0].address, "kvcached-down=" + DOWN, replicas[2].address]
    with kvcached.ShardedClient(listed, kvcached.ClientOptions(deadline=30, keepalive_time=0),
                                connect_timeout=2) as fleet:
        assert [fleet.replica(i).name for i in range(3)] == names
        assert isinstance(fleet.get_stats()[1], kvcached.KvCacheError)
        keys = [k for k in ("down-%d" % i for i in range(60))
                if sharded.rendezvous_order(k, names)[0] == 1][:4]
        assert len(keys) == 4
        for key in keys:
            with fleet.new_cache(pb_spec(), placement_key=key) as cache:
                assert fleet.replica_of(cache.id) == sharded.rendezvous_order(key, names)[1]
        with pytest.raises(kvcached.KvCacheError) as unreachable:
            fleet.owner("kvcached-down:" + "0" * 32).get_cache("kvcached-down:" + "0" * 32)
        assert unreachable.value.code == grpc.StatusCode.UNAVAILABLE
        for index in (0, 2):
            assert_nothing_held(fleet.client(index))
