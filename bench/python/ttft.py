#!/usr/bin/python3
"""A worker's time to first token with its prompt's prefix cached in
kvcached against recomputing it, and the per-token decode cost of the
kvcached caches (write-through, authoritative) over a local one (issue 49).

    /usr/bin/python3 bench/python/ttft.py [--kvcached BIN] [--part ttft,decode] \\
        [--layers 16 --hidden 2048 --heads 16 --kv-heads 8 --intermediate 5632] \\
        [--prefix 4096 --suffix 32] [--contexts 1024,8192 --decode-tokens 8]

The model: kvcached.models' Llama with seeded random weights (float32
compute; the cache stores f16), the shape given (default: 16 layers,
d_model 2048, 16 query heads and 8 KV heads of 128, SwiGLU 5632, vocab 32000).

ttft: one request of a `prefix`-token system prompt and a `suffix`-token
question, served as kvcached.worker serves it (worker/session.py): first
with the lookup off (the prefix computed, streamed to kvcached and
published), then `--repeats` times with it on (LookupPrefix, Restore, the
prefix's K/V fetched into the write-through mirror, only the question
prefilled), and once more in authoritative mode (no mirror: the first
forward fetches what it attends over). The first token's logits must be
equal in every run.

decode: caches filled with `context` random tokens per layer (no prefill:
the cost of a step does not depend on the values), then `--decode-tokens`
greedy steps; per token the median time, and the part of it spent inside
the cache's update() (sending, fetching, waiting for acknowledgements): the
rest is the model's own compute.
"""

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List

import bench_support

# kvcached and torch are imported after main() has had bench_support generate
# the package's stubs (kvcached's imports need them).


def model_config(args: argparse.Namespace) -> Any:
    """The benchmark model's LlamaConfig."""
    from kvcached.models.config import LlamaConfig
    return LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                       max_position_embeddings=max(args.prefix + args.suffix,
                                                   max(args.contexts)) + 64)


class TimedCache:
    """A cache whose update() calls are timed (the model's other calls pass through)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.update_seconds = 0.0

    def update(self, key_states: Any, value_states: Any, layer_idx: int,
               cache_kwargs: Any = None) -> Any:
        """The wrapped cache's update, its time added up."""
        start = time.perf_counter()
        try:
            return self.cache.update(key_states, value_states, layer_idx, cache_kwargs)
        finally:
            self.update_seconds += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)


class FetchClock:
    """Times a client's fetch_layers calls (the adapters' fetches), by
    shadowing the method on that one client object."""

    def __init__(self, client: Any) -> None:
        self.seconds = 0.0
        self.bytes = 0
        fetch_layers = client.fetch_layers

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                histories = fetch_layers(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
            self.bytes += sum(h.keys.nbytes + h.values.nbytes for h in histories.values())
            return histories

        client.fetch_layers = timed


# Time to first token.

def ttft_rows(args: argparse.Namespace, model: Any, client: Any) -> List[Dict[str, Any]]:
    """The recompute run, the cached runs and the authoritative one."""
    from kvcached.worker import session
    import torch
    generator = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, args.vocab, (args.prefix + args.suffix,), generator=generator)
    system, user = prompt[:args.prefix].tolist(), prompt[args.prefix:].tolist()
    name = "ttft-bench-%d" % int(time.time())  # a fresh prefix namespace per run
    plan = [("recompute", session.WRITE_THROUGH, False)]
    plan += [("cached", session.WRITE_THROUGH, True)] * args.repeats
    plan += [("cached", session.AUTHORITATIVE, True)]
    rows = []
    for label, mode, reuse in plan:
        clock = FetchClock(client)
        with session.open_cache(mode, model.config, client=client, model_name=name) as cache:
            result = session.serve(model, cache, system, user, 1, reuse=reuse)
        del client.fetch_layers
        rows.append({"run": label, "mode": mode, "ttft_s": result.ttft_s,
                     "lookup_s": result.lookup_s, "publish_s": result.publish_s,
                     "fetch_s": clock.seconds, "fetched_mib": clock.bytes / 2**20,
                     "matched": result.matched_tokens, "prefilled": result.prefilled_tokens,
                     "token": result.tokens[0]})
        print("ROW ttft %s" % rows[-1], file=sys.stderr, flush=True)
    if len({row["token"] for row in rows}) != 1:
        raise RuntimeError("the first token differs between runs: %s" % rows)
    return rows


def print_ttft(rows: List[Dict[str, Any]], args: argparse.Namespace) -> None:
    recompute = rows[0]["ttft_s"]
    cached = [row["ttft_s"] for row in rows if row["run"] == "cached"
              and row["mode"] == "write_through"]
    print("| run | cache mode | prefix tokens restored | tokens prefilled | TTFT s | "
          "lookup + restore (+ mirror) s | fetch_layers s (MiB) | publish s | "
          "recompute / this |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| %s | %s | %d | %d | %.3f | %.3f | %.3f (%.0f) | %.3f | %.1f |" % (
            row["run"], row["mode"], row["matched"], row["prefilled"], row["ttft_s"],
            row["lookup_s"], row["fetch_s"], row["fetched_mib"], row["publish_s"],
            recompute / row["ttft_s"]))
    print("\nCached (write-through, median of %d) vs recomputed: **%.1fx** faster to the first "
          "token." % (len(cached), recompute / bench_support.median(cached)))


# Per-token decode.

def filled_cache(mode: str, model: Any, client: Any, context: int) -> Any:
    """A cache of `mode` holding `context` random tokens in every layer."""
    from kvcached.worker import session
    import torch
    config = model.config
    cache = session.open_cache(mode, config, client=client, model_name="decode-bench")
    inner = cache.cache if mode == session.LOCAL else cache
    generator = torch.Generator().manual_seed(context)
    shape = (1, config.num_key_value_heads, context, config.head_dim)
    for layer in range(config.num_hidden_layers):
        keys = torch.randn(shape, generator=generator)
        inner.update(keys, -keys, layer)
    if mode != session.LOCAL:
        inner.flush()
    return cache


def decode_row(mode: str, model: Any, client: Any, context: int,
               tokens: int) -> Dict[str, Any]:
    """Median seconds per decoded token, and the median part inside update()."""
    import torch
    cache = filled_cache(mode, model, client, context)
    clock = FetchClock(client)
    with cache as inner:
        timed = TimedCache(inner)
        step, in_cache, fetching = [], [], []
        token = torch.zeros((1, 1), dtype=torch.long)
        for _ in range(tokens):
            timed.update_seconds, clock.seconds = 0.0, 0.0
            start = time.perf_counter()
            token = model(token, timed, last_only=True)[:, -1].argmax(-1, keepdim=True)
            step.append(time.perf_counter() - start)
            in_cache.append(timed.update_seconds)
            fetching.append(clock.seconds)
    del client.fetch_layers  # the method again
    row = {"mode": mode, "context": context, "token_s": statistics.median(step),
           "cache_s": statistics.median(in_cache), "fetch_s": statistics.median(fetching),
           "fetched_mib": clock.bytes / tokens / 2**20}
    print("ROW decode %s" % row, file=sys.stderr, flush=True)
    return row


def decode_rows(args: argparse.Namespace, model: Any, client: Any) -> List[Dict[str, Any]]:
    """Every (context, mode) row: local, write-through, authoritative per context."""
    from kvcached.worker import session
    rows = []
    for context in args.contexts:
        for mode in (session.LOCAL, session.WRITE_THROUGH, session.AUTHORITATIVE):
            rows.append(decode_row(mode, model, client, context, args.decode_tokens))
    return rows


def print_decode(rows: List[Dict[str, Any]], token_bytes: int) -> None:
    local = {row["context"]: row["token_s"] for row in rows if row["mode"] == "local"}
    print("| context | cache mode | ms / token | in the cache's update() ms | of which "
          "fetch_layers ms | MiB fetched / token | overhead over local ms | / local |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        base = local[row["context"]]
        print("| %d | %s | %.1f | %.1f | %.1f | %.0f | %+.1f | %.2f |" % (
            row["context"], row["mode"], row["token_s"] * 1e3, row["cache_s"] * 1e3,
            row["fetch_s"] * 1e3, row["fetched_mib"], (row["token_s"] - base) * 1e3,
            row["token_s"] / base))
    print("\n(authoritative fetches every layer's whole history per token: %s)" % ", ".join(
        "%d tokens = %.0f MiB" % (context, context * token_bytes / 2**20)
        for context in sorted(local)))


def parse_args(argv: List[str]) -> argparse.Namespace:
    parse = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parse.add_argument("--kvcached", default=None, help="the server binary")
    parse.add_argument("--stubs-dir", default=None)
    parse.add_argument("--part", default="ttft,decode", type=lambda s: s.split(","))
    for name, default in (("layers", 16), ("hidden", 2048), ("heads", 16), ("kv-heads", 8),
                          ("intermediate", 5632), ("vocab", 32000), ("prefix", 4096),
                          ("suffix", 32), ("repeats", 3), ("decode-tokens", 8)):
        parse.add_argument("--" + name, type=int, default=default)
    parse.add_argument("--contexts", default="1024,8192",
                       type=lambda s: [int(c) for c in s.split(",")])
    parse.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    return parse.parse_args(argv)


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    bench_support.use_source_package(args.stubs_dir)
    import kvcached
    import torch
    from kvcached.models.checkpoint import random_model
    from kvcached.worker import session
    if args.threads:
        torch.set_num_threads(args.threads)
    server_binary = bench_support.find_binary(args.kvcached, bench_support.DEFAULT_SERVERS,
                                              "kvcached")
    started = time.perf_counter()
    model = random_model(model_config(args), seed=5).eval()
    made = time.perf_counter() - started
    session.warm_up(model)
    config = model.config
    token_bytes = 2 * config.num_key_value_heads * config.head_dim * 2 * config.num_hidden_layers
    pool = max(1 << 30, 3 * token_bytes * max(args.prefix + args.suffix, max(args.contexts)))
    flags = ["--pool_bytes=%d" % pool, "--max_message_bytes=%d" % (1 << 30)]
    with bench_support.Server(server_binary, flags) as server, \
            kvcached.Client(address=server.address, deadline=600.0) as client:
        print("### Machine\n")
        for line in bench_support.machine_lines():
            print("- " + line)
        print("- device: %s; server %s; client at %s; torch %s, %d threads" % (
            server.device(), server_binary, bench_support.git_commit(), torch.__version__,
            torch.get_num_threads()))
        print("- model: %d layers, d_model %d, %d query / %d KV heads of %d, SwiGLU %d, vocab "
              "%d; float32 weights (random, seeded; made in %.0f s), f16 cache (%d KiB of K+V "
              "per token over all layers)\n" % (
                  config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                  config.num_key_value_heads, config.head_dim, config.intermediate_size,
                  config.vocab_size, made, token_bytes // 1024))
        if "ttft" in args.part:
            print("### Time to first token: a %d-token prefix + %d-token question\n"
                  % (args.prefix, args.suffix))
            print_ttft(ttft_rows(args, model, client), args)
            print()
        if "decode" in args.part:
            print("### Decode: per token, median of %d steps\n" % args.decode_tokens)
            print_decode(decode_rows(args, model, client), token_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
