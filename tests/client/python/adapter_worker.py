"""A model worker in a process of its own, for the adapters' cross-process
tests: a seeded tiny Llama whose cache lives in kvcached. It prints one JSON
line per event (flushed) and, where its role says so, hangs there so the
test can SIGKILL it at that point.

    adapter_worker.py ADDRESS publish N           prefill N prompt tokens, publish them, exit
    adapter_worker.py ADDRESS publish-hang N      the same, then hang (SIGKILL right after)
    adapter_worker.py ADDRESS die-mid-update N    prefill in chunks of 4; in the chunk at N,
                                                  layer 0 acknowledged, layer 1 in flight, hang
"""

import json
import sys
import time

import torch

import kvcached
from kvcached.adapters import KvcachedCache, cache_spec_from_config, publish_prefix
from kvcached.dtypes import DType
from kvcached.models import random_model, tiny_config
from kvcached.models.generate import prefill

# A full and a sliding layer (window 64, 4 sinks): restores only whole entries.
CONFIG = dict(num_hidden_layers=2, sliding_window=64, attention_sinks=4,
              layer_types=["full_attention", "sliding_attention"])
MODEL_NAME = "adapter-worker"
PREFILL_CHUNK = 256
HANG_S = 600


def worker_model(layers: int = 2):
    """The model every worker (and the tests' reference) runs."""
    config = dict(CONFIG, num_hidden_layers=layers,
                  layer_types=(["full_attention", "sliding_attention", "full_attention"]
                               [:layers]))
    return random_model(tiny_config(**config), seed=21)


def worker_spec(model):
    return cache_spec_from_config(model.config, dtype=DType.FLOAT16, model=MODEL_NAME)


def system_prompt(tokens: int):
    """A deterministic prompt of `tokens` ids."""
    return [(31 * i + 7) % 256 for i in range(tokens)]


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def publish(client, tokens: int, hang: bool) -> None:
    model = worker_model()
    prompt = system_prompt(tokens)
    # A lease: a worker killed before it deletes its cache leaves nothing for ever.
    cache = KvcachedCache(client, worker_spec(model), ttl_seconds=2)
    prefill(model, cache, prompt, prefill_chunk=PREFILL_CHUNK)
    published = publish_prefix(cache, prompt)
    say(entry=published.entry.snapshot_id, cache=cache.cache_ids()[0],
        shared=int(published.shared_tokens), tokens=tokens)
    if hang:
        time.sleep(HANG_S)
    cache.close()


class DyingCache(KvcachedCache):
    """Hangs in the step that starts at `die_at`: layer 0's write is
    acknowledged, layer 1's sent but not waited for."""

    die_at = 0

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if layer_idx == 1 and self.get_seq_length(1) == self.die_at:
            self.flush()
            returned = super().update(key_states, value_states, layer_idx, cache_kwargs)
            say(cache=self.cache_ids()[0], die_at=self.die_at)
            time.sleep(HANG_S)
            return returned
        return super().update(key_states, value_states, layer_idx, cache_kwargs)


def die_mid_update(client, die_at: int) -> None:
    model = worker_model(layers=3)
    cache = DyingCache(client, worker_spec(model), ttl_seconds=5)
    cache.die_at = die_at
    prompt = torch.tensor([system_prompt(16)])
    for start in range(0, 16, 4):
        model(prompt[:, start:start + 4], cache, last_only=True)
        if start == 0:  # a leased snapshot that only this worker knows of
            cache.flush()
            snapshot = client.snapshot(cache.cache_ids()[0], ttl_seconds=1)
            say(snapshot=snapshot.snapshot_id)


def main(argv) -> int:
    address, role, count = argv[1], argv[2], int(argv[3])
    with kvcached.Client(address=address, data_lane="auto", deadline=30) as client:
        if role in ("publish", "publish-hang"):
            publish(client, count, hang=role == "publish-hang")
        elif role == "die-mid-update":
            die_mid_update(client, count)
        else:
            raise SystemExit("unknown role %r" % role)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
