"""Faults: a worker process SIGKILLed in the middle of a step (one layer's
Update acknowledged, the next in flight) leaves its cache with layers out of
step; another process attaches to it and resumes every layer from where it
is (expected_offset set), ending with exactly the bytes of an uninterrupted
run; the dead worker's leased snapshot expires and frees its pages."""

import os
import signal

import pytest
import torch

from kvcached.adapters import KvcachedCache
from kvcached.models import LocalCache, greedy
from adapter_support import server  # noqa: F401 (a fixture of its tests)
from adapter_support import client_fixture
from adapter_support import held, layer_history, read_event, spawn_worker, wait_until
from adapter_worker import system_prompt, worker_model, worker_spec

DIE_AT = 8  # the worker hangs in the step of prompt tokens [8, 12)


client = client_fixture("lane")


def test_a_worker_killed_mid_update_is_resumed_by_another(server, client):
    worker = spawn_worker(server.address, "die-mid-update", DIE_AT)
    snapshot = read_event(worker)["snapshot"]
    cache_id = read_event(worker)["cache"]
    os.kill(worker.pid, signal.SIGKILL)
    assert worker.wait(timeout=60) == -signal.SIGKILL
    worker.stdout.close()
    worker.stderr.close()
    info = client.get_cache(cache_id)
    offsets = list(info.layer_offsets)
    assert not info.in_step and offsets[0] == DIE_AT + 4 and offsets[2] == DIE_AT
    assert offsets[1] in (DIE_AT, DIE_AT + 4), "the in-flight write: applied whole or not"
    model = worker_model(layers=3)
    local = LocalCache.for_model(model.config, torch.float16)
    prompt = torch.tensor([system_prompt(16)])
    with KvcachedCache.attach(client, worker_spec(model), [cache_id]) as cache:
        for start in range(0, 16, 4):  # the dead worker's chunks, from the start
            model(prompt[:, start:start + 4], cache, last_only=True)
            model(prompt[:, start:start + 4], local, last_only=True)
        cache.flush()
        assert list(client.get_cache(cache_id).layer_offsets) == [16, 16, 16]
        for layer in range(3):
            positions, keys, values = layer_history(client, cache_id, layer)
            assert positions == local.key_positions(layer).tolist()
            want_keys, want_values = local.keys_values(layer)
            assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
        got = greedy(model, [3, 1, 4], cache, 5, return_logits=True)
        want = greedy(model, [3, 1, 4], local, 5, return_logits=True)
        assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    # The dead worker's snapshot: its lease (1 s) runs out and its pages go.
    assert wait_until(lambda: held(client)[:3] == (0, 0, 0)), \
        "snapshot %s still held: %s" % (snapshot, held(client))
