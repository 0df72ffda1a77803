"""What bench/python's scripts share: the kvcached package from the source
tree (its stubs generated first), a kvcached server on loopback, and the
machine's description for the results files.

    import bench_support
    bench_support.use_source_package()          # before `import kvcached`
    with bench_support.Server(binary, ["--pool_bytes=1073741824"]) as server:
        ... server.address ...                  # gRPC host:port; its lane is advertised

This file imports nothing of kvcached's: it runs before the package can be.
"""

import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence

REPO_ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
# The package's source: this checkout's, or another tree's (a before/after run:
# `git archive OLD client/python | tar -x -C /tmp/old`, then
# KVCACHED_PACKAGE_ROOT=/tmp/old/client/python).
PACKAGE_ROOT = os.environ.get("KVCACHED_PACKAGE_ROOT") or os.path.join(REPO_ROOT, "client",
                                                                      "python")
DEFAULT_STUBS_DIR = os.path.join(REPO_ROOT, "build-python", "stubs")
# Where a server binary is looked for when none is named: this checkout's
# builds, Release first (the benchmarks' build), then the default build.
DEFAULT_SERVERS = ("build-bench/server/kvcached", "build/server/kvcached")


def use_source_package(stubs_dir: Optional[str] = None) -> None:
    """Makes `import kvcached` load client/python, its stubs generated into
    `stubs_dir` (default build-python/stubs; $KVCACHED_STUBS_DIR where set)."""
    stubs_dir = os.path.abspath(stubs_dir or os.environ.get("KVCACHED_STUBS_DIR")
                                or DEFAULT_STUBS_DIR)
    generator = os.path.join(PACKAGE_ROOT, "generate_stubs.py")
    if not os.path.exists(os.path.join(stubs_dir, "kvcache", "v1", "kvcache_pb2.py")):
        subprocess.run([sys.executable, generator, stubs_dir], check=True)
    os.environ["KVCACHED_STUBS_DIR"] = stubs_dir
    if PACKAGE_ROOT not in sys.path:
        sys.path.insert(0, PACKAGE_ROOT)


def find_binary(given: Optional[str], candidates: Sequence[str], what: str) -> str:
    """`given` if set, else the first of `candidates` (relative to the
    repository root) that exists; SystemExit naming them otherwise."""
    if given:
        if not os.access(given, os.X_OK):
            raise SystemExit("%s: %s is no executable" % (what, given))
        return given
    for candidate in candidates:
        path = os.path.join(REPO_ROOT, candidate)
        if os.access(path, os.X_OK):
            return path
    raise SystemExit("no %s found (looked for %s); name one" % (what, ", ".join(candidates)))


class Server:
    """A kvcached on free loopback ports (gRPC and the data lane), its log
    kept in memory, stopped with SIGTERM when the `with` block ends."""

    def __init__(self, binary: str, flags: Sequence[str] = ()) -> None:
        self.binary = binary
        self.flags = ["--listen=127.0.0.1:0", "--data_lane_listen=127.0.0.1:0", *flags]
        self.log: List[str] = []
        self.address = ""
        self.process: Optional[subprocess.Popen] = None
        self._listening = threading.Event()

    def __enter__(self) -> "Server":
        self.process = subprocess.Popen([self.binary, *self.flags], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read_log, daemon=True).start()
        if not self._listening.wait(60) or not self.address:
            self.process.kill()
            raise RuntimeError("kvcached did not start:\n" + "".join(self.log))
        return self

    def _read_log(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            found = re.search(r"listening on (\S+)", line)
            if found and not self.address:
                self.address = found.group(1)
                self._listening.set()
        self._listening.set()  # it exited before listening

    def device(self) -> str:
        """The device line of its log ("llvmpipe (...) (cpu), transfers: direct")."""
        for line in self.log:
            found = re.search(r"device: (.*)$", line)
            if found:
                return found.group(1).strip()
        return "unknown"

    def __exit__(self, *exc_info) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def git_commit() -> str:
    """This checkout's commit (short), with "+changes" where the tree differs from it."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", REPO_ROOT, *args], capture_output=True, text=True)
        return done.stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine_lines() -> List[str]:
    """The machine, as the results files describe it (CPU, cores, kernel, load)."""
    model = "unknown CPU"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/loadavg") as loadavg:
        load = " ".join(loadavg.read().split()[:3])
    return ["CPU: %s, %d cores" % (model, os.cpu_count() or 0),
            "kernel %s, %s" % (os.uname().release, time.strftime("%Y-%m-%d %H:%M UTC",
                                                                 time.gmtime())),
            "load average now: %s" % load]


def median(values: Sequence[float]) -> float:
    """The median (the lower middle one of an even count, as run_service_bench.sh's)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def spread(values: Sequence[float]) -> str:
    """min-max of `values`, two decimals."""
    return "%.2f-%.2f" % (min(values), max(values)) if values else "-"


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean (0 for none)."""
    return statistics.fmean(values) if values else 0.0
