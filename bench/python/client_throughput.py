#!/usr/bin/python3
"""The Python client's Update and Fetch GB/s over the data lane beside the
C++ client's, on the same rows, the same server, in one run (issue 49).

    /usr/bin/python3 bench/python/client_throughput.py \\
        [--kvcached BIN] [--service-bench BIN] [--chunks 262144,1048576] \\
        [--rounds 3] [--seconds 2] [--profile update|fetch]

The rows are service_bench's (bench/service/service_bench.cc), one stream:
one connection and one cache, 8 KV heads x head dim 128 in f16 (4 KiB of
K+V per token), a chunk being the K+V bytes of one message.

- Update: a rotating layer of 16,384 tokens (a 64 MiB working set); the same
  chunk written again and again on one Update call over the lane
  (Client.open_update, write() per message: each one encoded anew from the
  arrays' buffers, as the C++ row's WriteShared does), acknowledgements
  counted as they come back. At the end the layer's last tokens must be the
  chunk's bytes, or the row fails.
- Fetch: a standard layer of 16,384 tokens fetched whole again and again,
  max_chunk_tokens = chunk / 4 KiB, into preallocated [1, 8, 16384, 128]
  arrays (recv_into: the bytes land in place). The C++ row reads each chunk
  as views of its receive buffer (Client::FetchViews), copying nothing more.
- Fetch-views: the same fetches, every chunk's tensors received into one
  reused chunk-sized buffer, as the C++ row does (no layer-sized destination
  in memory): the like-for-like row. Its C++ figures are measured again.

The C++ rows run service_bench --streams=1 --data_lane=auto as a separate
process against the same server, alternating with the Python rows (C++
first in odd rounds, Python first in even ones) so that both see the same
background load. Medians over the rounds; ratio = Python / C++.
--profile runs one Python row of each chunk under cProfile instead and
prints where its time goes.
"""

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import numpy as np

import bench_support

# kvcached itself is imported inside the functions: its stubs exist only once
# main() has had bench_support generate them.

HEADS, HEAD_DIM = 8, 128
TOKEN_BYTES = 2 * HEADS * HEAD_DIM * 2  # K + V, f16
WORKING_SET_TOKENS = (64 << 20) // TOKEN_BYTES
# Where service_bench is looked for (this checkout's builds, the bench build first).
SERVICE_BENCH_CANDIDATES = ("build-bench-py/bench/service/service_bench",
                            "build-bench/bench/service/service_bench",
                            "build/bench/service/service_bench")
SERVER_FLAGS = ("--pool_bytes=%d" % (1 << 30), "--max_message_bytes=%d" % (256 << 20))


@dataclass
class Timing:
    """How long a row warms up, then measures (seconds)."""

    warmup: float
    seconds: float


def pattern(nbytes: int):
    """service_bench's PatternBytes: byte i is (i * 131 + 7) mod 256 (never
    all zero, so nothing can skip zero pages)."""
    return ((np.arange(nbytes, dtype=np.uint64) * 131 + 7) % 256).astype(np.uint8)


def chunk_tensors(chunk: int):
    """The chunk's bytes as f16 keys and values [1, 8, L, 128] (keys the first half)."""
    tokens = chunk // TOKEN_BYTES
    data = pattern(chunk).view(np.float16)
    half = data.size // 2
    shape = (1, HEADS, tokens, HEAD_DIM)
    return data[:half].reshape(shape), data[half:].reshape(shape)


# The Python rows.

def connect(address: str):
    """A client of its own connection, over the lane (as ConnectOwn in service_bench)."""
    import kvcached
    client = kvcached.Client(address=address, deadline=600.0, dedicated_connection=True,
                             max_message_bytes=256 << 20, data_lane="auto")
    client.wait_for_ready(30)
    if not client.uses_data_lane():
        raise RuntimeError("the server at %s has no data lane that answers" % address)
    return client


def python_update(address: str, chunk: int, timing: Timing) -> float:
    """GB/s of one Update call writing `chunk` bytes per message over the lane."""
    import kvcached
    from kvcached import specs
    keys, values = chunk_tensors(chunk)
    update = kvcached.LayerUpdate(0, keys, values)
    with connect(address) as client:
        spec = specs.cache_spec([specs.rotating(HEADS, HEAD_DIM, WORKING_SET_TOKENS, keep=0)],
                                model="client_throughput")
        with client.new_cache(spec) as cache:
            stream = client.open_update(cache.id)
            counted = _pump(stream, update, timing)
            stream.finish()
            _check_tail(client, cache.id, keys, values)
    return counted * chunk / timing.seconds / 1e9


def _pump(stream, update, timing: Timing) -> int:
    """Writes `update` until warm-up and measurement are over; the
    acknowledgements that arrived during the measurement."""
    start = time.monotonic()
    warm_end, end = start + timing.warmup, start + timing.warmup + timing.seconds
    acked_at_warm = None
    while True:
        stream.write(update)
        now = time.monotonic()
        if acked_at_warm is None and now >= warm_end:
            acked_at_warm = len(stream.acknowledged)
            warm_end = now
        if now >= end:
            # Scaled to the seconds asked for: the loop ends a write late.
            acked = len(stream.acknowledged) - acked_at_warm
            return int(acked * timing.seconds / (now - warm_end))


def _check_tail(client, cache_id: str, keys, values) -> None:
    """The layer's last tokens must be the chunk's (the bytes arrived whole)."""
    history = client.fetch(cache_id, 0)
    tokens = keys.shape[2]
    # Compared as bits: the pattern's bytes read as f16 include NaNs.
    if not (np.array_equal(history.keys[:, :, -tokens:].view(np.uint16), keys.view(np.uint16))
            and np.array_equal(history.values[:, :, -tokens:].view(np.uint16),
                               values.view(np.uint16))):
        raise RuntimeError("Update: the cache's last tokens are not the bytes sent")


def python_fetch(address: str, chunk: int, timing: Timing) -> float:
    """GB/s of whole-layer fetches of `chunk`-byte chunks into preallocated arrays."""
    from kvcached import specs
    with connect(address) as client:
        spec = specs.cache_spec([specs.standard(HEADS, HEAD_DIM)], model="client_throughput")
        with client.new_cache(spec) as cache:
            filled_keys, filled_values = _fill(client, cache.id)
            out = tuple(np.empty((1, HEADS, WORKING_SET_TOKENS, HEAD_DIM), np.float16)
                        for _ in range(2))
            fetches, elapsed = _fetch_loop(
                lambda: client.fetch(cache.id, 0, out=out,
                                     max_chunk_tokens=chunk // TOKEN_BYTES), timing)
            if not (np.array_equal(out[0], filled_keys) and np.array_equal(out[1], filled_values)):
                raise RuntimeError("Fetch: the bytes fetched are not those written")
    return fetches * WORKING_SET_TOKENS * TOKEN_BYTES / elapsed / 1e9


def _fill(client, cache_id: str):
    """WORKING_SET_TOKENS tokens into layer 0 in 4 MiB messages; what was written."""
    import kvcached
    step = (4 << 20) // TOKEN_BYTES
    keys = np.random.default_rng(7).standard_normal(
        (1, HEADS, WORKING_SET_TOKENS, HEAD_DIM)).astype(np.float16)
    values = -keys
    client.update_many(cache_id, [
        kvcached.LayerUpdate(0, np.ascontiguousarray(keys[:, :, at:at + step]),
                             np.ascontiguousarray(values[:, :, at:at + step]))
        for at in range(0, WORKING_SET_TOKENS, step)])
    return keys, values


def _fetch_loop(fetch: Callable[[], object], timing: Timing) -> Tuple[int, float]:
    """Fetches during warm-up, then whole fetches until `seconds` have passed:
    (fetches measured, seconds they took)."""
    end = time.monotonic() + timing.warmup
    while time.monotonic() < end:
        fetch()
    start = time.monotonic()
    fetches = 0
    while fetches == 0 or time.monotonic() - start < timing.seconds:
        fetch()
        fetches += 1
    return fetches, time.monotonic() - start


def python_fetch_views(address: str, chunk: int, timing: Timing) -> float:
    """GB/s of whole-layer fetches whose chunks all land in one reused
    chunk-sized buffer: what the C++ row does (FetchViews hands out views of
    its receive buffer; nothing lands in a layer-sized array)."""
    from kvcached import lane, specs
    with connect(address) as client:
        spec = specs.cache_spec([specs.standard(HEADS, HEAD_DIM)], model="client_throughput")
        with client.new_cache(spec) as cache:
            _fill(client, cache.id)
            scratch = memoryview(bytearray(chunk // 2))
            request = kvcached_fetch_request(cache.id, chunk)
            reader = lane.placing_chunks(lambda *_: [scratch])
            fetches, elapsed = _fetch_loop(
                lambda: lane.lane_fetch(client._lanes, request, reader), timing)
    return fetches * WORKING_SET_TOKENS * TOKEN_BYTES / elapsed / 1e9


def kvcached_fetch_request(cache_id: str, chunk: int):
    """The FetchRequest of a whole layer 0 in chunks of `chunk` bytes."""
    from kvcached import pb
    return pb.FetchRequest(cache_id=cache_id, layers=[0], max_chunk_tokens=chunk // TOKEN_BYTES)


PYTHON_ROWS: Dict[str, Callable[[str, int, Timing], float]] = {
    "update": python_update, "fetch": python_fetch, "fetch-views": python_fetch_views}


# The C++ rows.

def cpp_row(service_bench: str, address: str, op: str, chunk: int, timing: Timing) -> float:
    """service_bench's GB/s for one row over the lane (one stream)."""
    done = subprocess.run([service_bench, "--address=" + address, "--ops=" + op, "--streams=1",
                           "--chunks=%d" % chunk, "--data_lane=auto",
                           "--warmup=%g" % timing.warmup, "--seconds=%g" % timing.seconds],
                          capture_output=True, text=True, timeout=120)
    for line in done.stdout.splitlines():
        words = line.split()
        if words[:2] == ["ROW", "kvcached-lane"]:
            if "error:" in line:
                raise RuntimeError("service_bench: " + line)
            return float(words[5])
    raise RuntimeError("service_bench printed no row:\n" + done.stdout + done.stderr)


# The run.

@dataclass
class Results:
    """GB/s per (op, chunk) and client, one value per round."""

    rates: Dict[Tuple[str, int, str], List[float]] = field(default_factory=dict)

    def add(self, op: str, chunk: int, client: str, gbps: float) -> None:
        self.rates.setdefault((op, chunk, client), []).append(gbps)
        print("ROW %s %s %d %.3f" % (client, op, chunk, gbps), file=sys.stderr, flush=True)

    def table(self, ops: List[str], chunks: List[int]) -> List[str]:
        lines = ["| op | chunk | C++ GB/s | Python GB/s | Python / C++ | C++ spread | "
                 "Python spread |", "|---|---:|---:|---:|---:|---|---|"]
        for op in ops:
            for chunk in chunks:
                cpp, py = self.rates[(op, chunk, "cpp")], self.rates[(op, chunk, "python")]
                ratio = bench_support.median(py) / max(bench_support.median(cpp), 1e-9)
                lines.append("| %s | %d KiB | %.2f | %.2f | **%.2f** | %s | %s |" % (
                    op.capitalize(), chunk // 1024, bench_support.median(cpp),
                    bench_support.median(py), ratio, bench_support.spread(cpp),
                    bench_support.spread(py)))
        return lines


def run_rounds(args, address: str, service_bench: str) -> Results:
    """Every row, `args.rounds` times, C++ and Python alternating first."""
    timing = Timing(args.warmup, args.seconds)
    results = Results()
    for round_number in range(1, args.rounds + 1):
        print("round %d of %d" % (round_number, args.rounds), file=sys.stderr, flush=True)
        for op in args.ops:
            for chunk in args.chunks:
                order = ["cpp", "python"] if round_number % 2 else ["python", "cpp"]
                for client in order:
                    if client == "cpp":
                        gbps = cpp_row(service_bench, address, op.split("-")[0], chunk, timing)
                    else:
                        gbps = PYTHON_ROWS[op](address, chunk, timing)
                    results.add(op, chunk, client, gbps)
    return results


def profile_rows(args, address: str) -> None:
    """One Python row per (op, chunk) under cProfile: the top functions by own time."""
    timing = Timing(args.warmup, args.seconds)
    for op in args.ops:
        for chunk in args.chunks:
            profiler = cProfile.Profile()
            gbps = profiler.runcall(PYTHON_ROWS[op], address, chunk, timing)
            print("## %s, %d KiB: %.2f GB/s under cProfile" % (op, chunk // 1024, gbps))
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvcached", default=os.environ.get("KVCACHED"),
                        help="the server binary (default: build-bench/, then build/)")
    parser.add_argument("--service-bench", default=os.environ.get("SERVICE_BENCH"),
                        help="the C++ rows' service_bench (default: build-bench-py/, "
                             "build-bench/, then build/)")
    parser.add_argument("--stubs-dir", default=None, help="where the stubs are generated")
    parser.add_argument("--ops", default="update,fetch,fetch-views",
                        type=lambda s: s.split(","))
    parser.add_argument("--chunks", default="262144,1048576",
                        type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--profile", action="store_true",
                        help="profile one Python row per chunk instead of the comparison")
    return parser.parse_args(argv)


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    bench_support.use_source_package(args.stubs_dir)
    server_binary = bench_support.find_binary(args.kvcached, bench_support.DEFAULT_SERVERS,
                                              "kvcached")
    with bench_support.Server(server_binary, SERVER_FLAGS) as server:
        if args.profile:
            profile_rows(args, server.address)
            return 0
        service_bench = bench_support.find_binary(args.service_bench, SERVICE_BENCH_CANDIDATES,
                                                  "service_bench")
        load_before = open("/proc/loadavg").read().split()[:3]
        results = run_rounds(args, server.address, service_bench)
        print("### Machine\n")
        for line in bench_support.machine_lines():
            print("- " + line)
        print("- load average before: %s" % " ".join(load_before))
        print("- device: %s" % server.device())
        print("- server %s; C++ client %s; Python client %s (this checkout at %s)" % (
            server_binary, service_bench, bench_support.PACKAGE_ROOT, bench_support.git_commit()))
        print("- %d rounds of %g s per row after %g s of warm-up; medians\n" % (
            args.rounds, args.seconds, args.warmup))
        print("\n".join(results.table(args.ops, args.chunks)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
