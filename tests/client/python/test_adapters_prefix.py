"""Prefix reuse across processes (adapters/prefixes.py): a worker process
publishes a 1k-token system prompt and exits, or is SIGKILLed right after
the publish is acknowledged; this process finds it, restores it taking no
new pages, prefills only its own suffix and generates exactly what a local
prefill gives. Bad prefix input gets the C++ client's statuses."""

import os
import signal

import grpc
import pytest
import torch

import kvcached
from kvcached.adapters import KvcachedCache, publish_prefix, restore_prefix
from kvcached.models import LocalCache, greedy
from kvcached.models.generate import prefill
from adapter_support import server  # noqa: F401 (a fixture of its tests)
from adapter_support import client_fixture
from adapter_support import held, kv, read_event, spawn_worker, spec_of, wait_until
from adapter_worker import PREFILL_CHUNK, system_prompt, worker_model, worker_spec

SYSTEM_TOKENS = 1024
SUFFIX = [5, 17, 99, 3, 250, 1, 42, 8, 77, 123, 9, 64]


client = client_fixture("lane")


@pytest.fixture(scope="module")
def model():
    return worker_model()


@pytest.fixture(scope="module")
def full_local_prefill(model):
    """A full local prefill of system prompt + suffix in the worker's chunks
    (256 tokens: the last one is the suffix alone), then 8 greedy tokens."""
    prompt = system_prompt(SYSTEM_TOKENS) + SUFFIX
    return greedy(model, prompt, LocalCache.for_model(model.config, torch.float16), 8,
                  prefill_chunk=PREFILL_CHUNK, return_logits=True)


def published_by_a_worker(server, client, how):
    """The entry id a worker process published, once the worker is gone and
    its leased cache with it."""
    worker = spawn_worker(server.address, "publish-hang" if how == "sigkill" else "publish",
                          SYSTEM_TOKENS)
    event = read_event(worker)
    if how == "sigkill":
        os.kill(worker.pid, signal.SIGKILL)
    assert worker.wait(timeout=60) == (-signal.SIGKILL if how == "sigkill" else 0), \
        worker.stderr.read()
    worker.stderr.close()
    worker.stdout.close()
    assert event["tokens"] == SYSTEM_TOKENS
    assert wait_until(lambda: held(client)[0] == 0), "the worker's cache outlived its lease"
    return event["entry"]


@pytest.mark.parametrize("how", ["exits", "sigkill"])
def test_a_prefix_from_another_process_restores_without_new_pages(server, client, model, how,
                                                                   full_local_prefill):
    entry = published_by_a_worker(server, client, how)
    prompt = system_prompt(SYSTEM_TOKENS) + SUFFIX
    pages = held(client)[2]
    assert pages > 0, "the entry holds the prompt's pages"
    with KvcachedCache(client, worker_spec(model)) as cache:
        assert restore_prefix(cache, prompt) == SYSTEM_TOKENS
        assert held(client)[2] == pages, "a restore shares the entry's pages"
        assert cache.get_seq_length() == SYSTEM_TOKENS
        got = greedy(model, SUFFIX, cache, 8, return_logits=True)  # the suffix alone
    want = full_local_prefill
    assert SYSTEM_TOKENS % PREFILL_CHUNK == 0  # so its last chunk is the suffix alone
    assert torch.equal(got.tokens, want.tokens)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    client.release_snapshot(entry)  # unpublishes it


def test_a_miss_restores_nothing_and_a_short_prefix_is_served(client, model):
    spec = spec_of([(0, 0)], 2, 4, kvcached.DType.FLOAT16, model="short-prefix")
    with KvcachedCache(client, spec) as cache:
        assert restore_prefix(cache, [1, 2, 3, 4]) == 0
        cache.update(*kv(torch.Generator().manual_seed(1), 1, 2, 3, 4), 0)
        entry = publish_prefix(cache, [1, 2, 3]).entry.snapshot_id
    with KvcachedCache(client, spec) as cache:
        assert restore_prefix(cache, [1, 2, 9, 9]) == 2  # standard layers: any length
        assert cache.get_seq_length() == 2
    client.release_snapshot(entry)


def test_bad_prefix_input_gets_the_cpp_clients_statuses(client, model):
    spec = worker_spec(model)
    cases = {
        (grpc.StatusCode.INVALID_ARGUMENT, "snapshot_id"):
            lambda: client.publish_prefix("", [1, 2]),
        (grpc.StatusCode.NOT_FOUND, "snapshot_id"):
            lambda: client.publish_prefix("0" * 32, [1, 2]),
        (grpc.StatusCode.INVALID_ARGUMENT, "tokens"):
            lambda: client.lookup_prefix([], spec=spec),
        (grpc.StatusCode.INVALID_ARGUMENT, "spec, cache_id"):
            lambda: client.lookup_prefix([1]),
        (grpc.StatusCode.NOT_FOUND, "cache_id"):
            lambda: client.lookup_prefix([1], cache_id="0" * 32),
    }
    for (code, field), call in cases.items():
        with pytest.raises(kvcached.KvCacheError) as refused:
            call()
        assert refused.value.code == code and field in refused.value.message, refused.value
    with KvcachedCache(client, spec) as cache:
        prefill(model, cache, system_prompt(10))
        # A sliding layer restores only where a snapshot ends: publish all 10.
        with pytest.raises(kvcached.KvCacheError) as refused:
            publish_prefix(cache, system_prompt(8))
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.message.startswith("tokens")
        assert held(client)[1] == 0, "the publish's snapshot released on failure too"
