"""`python -m kvcached.worker`: one worker process serving one request (or
the same request twice with --compare) with its KV cache in kvcached.

    python -m kvcached.worker --address 127.0.0.1:50051 \\
        --system "You are a terse assistant." --prompt "Name a prime." --max-new-tokens 8
    {"mode": "write_through", "prefix_hit": false, "ttft_s": 0.041, "tokens": [...], ...}

Prompts are text (the byte-level tokenizer: each UTF-8 byte is an id,
modulo the vocabulary; see tokenizer.py) or ids (--system-ids 1,2,3).
The model is a checkpoint directory (--model-dir) or a tiny seeded one
(--seed, --tiny-config '{"num_hidden_layers": 4}'). Each run prints one
JSON line (session.ServeResult's fields, plus the model's name and the
tokens as text); --compare first runs without looking the prefix up
(recomputing it, and publishing it), then with: two lines, the second
beside the first. --cache local runs with no server at all (the reference
a kvcached run must equal). The server's token and TLS CA come from
--token / --tls-ca or $KVCACHE_TOKEN / $KVCACHE_TLS_CA, as kvcachectl's.
"""

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from ..client import Client
from ..errors import KvCacheError
from ..options import ClientOptions
from . import model_source, session
from .tokenizer import ByteTokenizer, parse_ids


def parser() -> argparse.ArgumentParser:
    """The command line's options."""
    parse = argparse.ArgumentParser(prog="python -m kvcached.worker",
                                    description=__doc__.split("\n\n")[0])
    parse.add_argument("--address", default="127.0.0.1:50051", help="kvcached's gRPC address")
    parse.add_argument("--token", default=os.environ.get("KVCACHE_TOKEN", ""),
                       help="bearer token (default $KVCACHE_TOKEN)")
    parse.add_argument("--tls-ca", default=os.environ.get("KVCACHE_TLS_CA", ""),
                       help="PEM CA file: the server runs TLS (default $KVCACHE_TLS_CA)")
    parse.add_argument("--data-lane", default="auto", help='ClientOptions.data_lane ("": gRPC)')
    parse.add_argument("--cache", default=session.WRITE_THROUGH, choices=session.MODES,
                       help="where the K/V live (local: no server)")
    parse.add_argument("--cache-dtype", default="f16", choices=sorted(session.CACHE_DTYPES))
    parse.add_argument("--model-dir", default="", help="config.json + model.safetensors")
    parse.add_argument("--seed", type=int, default=0, help="the tiny model's seed")
    parse.add_argument("--tiny-config", default="{}",
                       help="JSON overrides of the tiny model's config")
    parse.add_argument("--model-name", default="", help="the name prefixes are shared under")
    for name in ("system", "prompt"):
        group = parse.add_mutually_exclusive_group(required=name == "prompt")
        group.add_argument("--" + name, help="%s prompt as text (byte ids)" % name)
        group.add_argument("--%s-ids" % name, help="%s prompt as token ids, 1,2,3" % name)
    parse.add_argument("--max-new-tokens", type=int, default=16)
    parse.add_argument("--no-reuse", action="store_true",
                       help="do not look the prefix up (still publish it)")
    parse.add_argument("--compare", action="store_true",
                       help="run without the lookup, then with it: two JSON lines")
    return parse


def _ids(text: Optional[str], ids: Optional[str], tokenizer: ByteTokenizer) -> List[int]:
    if ids is not None:
        return parse_ids(ids)
    return tokenizer.encode(text or "")


def _client(args: argparse.Namespace) -> Client:
    options = ClientOptions(address=args.address, token=args.token, data_lane=args.data_lane)
    if args.tls_ca:
        with open(args.tls_ca, "rb") as file:
            options = dataclasses.replace(options, tls=True, tls_root_certs_pem=file.read())
    return Client(options)


def _line(result: session.ServeResult, model_name: str, tokenizer: ByteTokenizer) -> str:
    fields: Dict[str, Any] = dataclasses.asdict(result)
    fields["model"] = model_name
    fields["text"] = tokenizer.decode(result.tokens)
    for key in ("ttft_s", "lookup_s", "publish_s", "decode_s"):
        fields[key] = round(fields[key], 6)
    return json.dumps(fields, sort_keys=True)


def run(args: argparse.Namespace, out: Any = sys.stdout) -> List[session.ServeResult]:
    """Loads the model, serves the request (twice with --compare), prints a
    JSON line per run to `out`; returns the results."""
    model, name = model_source.load_model(args.model_dir, args.seed, json.loads(args.tiny_config))
    name = args.model_name or name
    tokenizer = ByteTokenizer(model.config.vocab_size)
    system = _ids(args.system, args.system_ids, tokenizer)
    user = _ids(args.prompt, args.prompt_ids, tokenizer)
    session.warm_up(model)
    client = None if args.cache == session.LOCAL else _client(args)
    reuses = [False, True] if args.compare else [not args.no_reuse]
    results = []
    try:
        for reuse in reuses:
            with session.open_cache(args.cache, model.config, client=client, model_name=name,
                                    dtype=session.CACHE_DTYPES[args.cache_dtype]) as cache:
                result = session.serve(model, cache, system, user, args.max_new_tokens,
                                       reuse=reuse)
            print(_line(result, name, tokenizer), file=out, flush=True)
            results.append(result)
    finally:
        if client is not None:
            client.close()
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command: 0 on success, 2 for bad arguments, 1 when a call fails."""
    args = parser().parse_args(argv)
    try:
        run(args)
    except (KvCacheError, ValueError, OSError) as error:
        print("kvcached.worker: %s" % error, file=sys.stderr)
        return 1
    return 0
