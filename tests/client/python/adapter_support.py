"""Shared by the adapters' tests: a kvcached per module, clients on both
transports, the no-leak check, random K/V, and a reference of what a layer
holds, written over positions (independently of adapters/layer_state.py)."""

import json
import os
import select
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import grpc
import pytest
import torch

import kvcached
from kvcached import specs
from kvcached.dtypes import DType
from kvcached_process import Kvcached

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_OF = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16,
            DType.BFLOAT16: torch.bfloat16}


def start_server(binary: str, flags: Sequence[str] = ()) -> Kvcached:
    """A kvcached on loopback (kvcached_process.BASE_FLAGS: 16-token pages)."""
    return Kvcached(binary, flags)


def connect(address: str, lane: bool) -> kvcached.Client:
    """A client over the data lane (lane) or gRPC only."""
    return kvcached.Client(address=address, data_lane="auto" if lane else "", deadline=30,
                           keepalive_time=0)


def held(client: kvcached.Client) -> Tuple[int, int, int, int]:
    """(caches, snapshots, pages used, prefix entries) on the server."""
    stats = client.get_stats()
    return stats.caches, stats.snapshots, stats.pages_used, stats.prefix_entries


def assert_nothing_held(client: kvcached.Client) -> None:
    """Every cache, snapshot, prefix and page released; what is left is
    cleaned up (so one failing test does not fail the next) and reported."""
    found = held(client)
    if found != (0, 0, 0, 0):
        for cache in client.list_caches():
            client.delete_cache(cache.cache_id)
        for snapshot in client.list_snapshots():
            try:
                client.release_snapshot(snapshot.snapshot_id)
            except kvcached.KvCacheError as error:
                assert error.code == grpc.StatusCode.NOT_FOUND
    assert found == (0, 0, 0, 0), "caches, snapshots, pages, prefixes still held"


def kv(generator: torch.Generator, batch: int, heads: int, tokens: int,
       dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random float32 keys and values [B, H, L, D]."""
    shape = (batch, heads, tokens, dim)
    return (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))


class ReferenceLayer:
    """What a layer holds, by position: standard keeps all, rotating keeps
    the sinks and evicts the oldest others to max_size - 1 before each update."""

    def __init__(self, max_size: int = 0, keep: int = 0) -> None:
        self.max_size, self.keep = max_size, keep
        self.tokens: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # position -> [B,H,D]
        self.held: List[int] = []
        self.offset = 0

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.max_size:
            sinks = [p for p in self.held if p < self.keep]
            rest = [p for p in self.held if p >= self.keep]
            evict = max(0, len(self.held) + 1 - self.max_size)
            self.held = sinks + rest[evict:]
        for i in range(keys.shape[2]):
            self.tokens[self.offset] = (keys[:, :, i].clone(), values[:, :, i].clone())
            self.held.append(self.offset)
            self.offset += 1

    def cut(self, n: int) -> None:
        self.offset -= n
        self.held = [p for p in self.held if p < self.offset]

    def rows(self, index: torch.Tensor) -> None:
        self.tokens = {p: (k.index_select(0, index), v.index_select(0, index))
                       for p, (k, v) in self.tokens.items()}

    def tensors(self, positions: Optional[Sequence[int]] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        chosen = self.held if positions is None else positions
        return (torch.stack([self.tokens[p][0] for p in chosen], dim=2),
                torch.stack([self.tokens[p][1] for p in chosen], dim=2))


def layer_history(client: kvcached.Client, cache_id: str, layer: int
                  ) -> Tuple[List[int], torch.Tensor, torch.Tensor]:
    """A layer's fetched positions, keys and values (torch, bf16 as bfloat16)."""
    got = client.fetch(cache_id, layer, max_chunk_tokens=5)
    positions = [p for begin, end in got.ranges for p in range(begin, end)]
    return (positions, kvcached.dtypes.as_torch(got.keys, got.dtype),
            kvcached.dtypes.as_torch(got.values, got.dtype))


def spec_of(layers: Sequence[Tuple[int, int]], heads: int, dim: int, dtype: DType,
            model: str = "adapter-test"):
    """A one-row spec of (max_size, keep) layers (max_size 0: standard)."""
    return specs.cache_spec([specs.rotating(heads, dim, max_size=m, keep=k) if m
                             else specs.standard(heads, dim) for m, k in layers],
                            dtype=dtype, model=model)


def python_env() -> Dict[str, str]:
    """The environment a worker subprocess needs to import kvcached and these helpers."""
    env = dict(os.environ)
    paths = [p for p in sys.path if p]
    env["PYTHONPATH"] = os.pathsep.join([HERE] + paths)
    return env


def spawn_worker(address: str, role: str, count: int) -> subprocess.Popen:
    """adapter_worker.py in a process of its own (see its docstring for roles)."""
    return subprocess.Popen([sys.executable, os.path.join(HERE, "adapter_worker.py"), address,
                             role, str(count)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=python_env())


def read_event(process: subprocess.Popen, timeout: float = 60) -> Dict:
    """The worker's next JSON line; fails with its stderr if none comes in time."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else ""
    if not line:
        process.kill()
        raise AssertionError("the worker said nothing:\n" + process.stderr.read())
    return json.loads(line)


def wait_until(condition, timeout: float = 10.0) -> bool:
    """Polls `condition` every 50 ms until it holds or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture(scope="module")
def server(kvcached_path: str):
    """A kvcached for the module's tests, stopped cleanly at the end (import it
    into a test module to use it)."""
    process = start_server(kvcached_path)
    yield process
    assert process.stop() == 0, "".join(process.log)


def client_fixture(*transports: str):
    """A `client` fixture on each of `transports` ("lane", "grpc") to `server`,
    checking at the end of each test that the server holds nothing."""
    @pytest.fixture(params=list(transports))
    def client(request, server):
        with connect(server.address, request.param == "lane") as connected:
            yield connected
            assert_nothing_held(connected)
    return client
