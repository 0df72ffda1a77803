"""python -m kvcached.worker: prompts in, greedy tokens and time to first
token out as JSON lines; a second worker process restores the first's system
prompt from kvcached and generates exactly what a local-cache run does."""

import argparse
import io
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from kvcached.worker import cli, model_source  # noqa: E402 (torch first, or skip)
from kvcached.worker.tokenizer import ByteTokenizer, parse_ids  # noqa: E402
from kvcached_process import Kvcached  # noqa: E402

PACKAGE_ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "client", "python")

SYSTEM = "You are a terse assistant of a bookshop. " * 4
TINY = json.dumps({"num_hidden_layers": 2, "hidden_size": 64})


@pytest.fixture(scope="module")
def server(kvcached_path):
    process = Kvcached(kvcached_path)
    yield process
    assert process.stop() == 0, "".join(process.log)


def args_for(*extra: str) -> argparse.Namespace:
    return cli.parser().parse_args(["--tiny-config", TINY, "--seed", "3", "--system", SYSTEM,
                                    "--max-new-tokens", "6", *extra])


def run_in_process(*extra: str):
    out = io.StringIO()
    results = cli.run(args_for(*extra), out)
    return results, [json.loads(line) for line in out.getvalue().splitlines()]


def run_process(*extra: str):
    """A worker in a process of its own, as a second worker would be."""
    environment = dict(os.environ, PYTHONPATH=PACKAGE_ROOT)
    done = subprocess.run([sys.executable, "-m", "kvcached.worker", "--tiny-config", TINY,
                           "--seed", "3", "--system", SYSTEM, "--max-new-tokens", "6", *extra],
                          env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_the_byte_tokenizer_maps_bytes_to_ids_modulo_the_vocabulary():
    assert ByteTokenizer(256).encode("hé") == [104, 0xC3, 0xA9]
    assert ByteTokenizer(100).encode("hé") == [4, 0xC3 % 100, 0xA9 % 100]
    assert ByteTokenizer(512).decode([104, 0xC3, 0xA9]) == "hé"
    assert ByteTokenizer(512).decode([104, 300, 105]) == "h\ufffdi"
    assert parse_ids("1, 2 3") == [1, 2, 3] and parse_ids("") == []


def test_prefix_names_differ_with_seed_and_shape():
    config = model_source.tiny_config()
    assert model_source.tiny_name(config, 1) != model_source.tiny_name(config, 2)
    wider = model_source.tiny_config(hidden_size=128)
    assert model_source.tiny_name(config, 1) != model_source.tiny_name(wider, 1)


def test_a_local_run_needs_no_server_and_prints_one_json_line():
    results, lines = run_in_process("--cache", "local", "--prompt", "Hello?")
    assert len(lines) == 1 and lines[0]["mode"] == "local" and not lines[0]["prefix_hit"]
    assert lines[0]["tokens"] == results[0].tokens and len(results[0].tokens) == 6
    assert lines[0]["prefilled_tokens"] == len(SYSTEM.encode()) + len("Hello?")
    assert lines[0]["ttft_s"] > 0


@pytest.mark.parametrize("mode", ["write_through", "authoritative"])
def test_a_second_process_restores_the_system_prompt_and_matches_a_local_run(server, mode):
    reference = run_in_process("--cache", "local", "--prompt", "Where are the maps?")[1][0]
    name = "test-worker-" + mode  # each test its own prefixes
    first = run_process("--address", server.address, "--cache", mode, "--model-name", name,
                        "--prompt", "Do you sell poetry?")[0]
    second = run_process("--address", server.address, "--cache", mode, "--model-name", name,
                         "--prompt", "Where are the maps?")[0]
    assert not first["prefix_hit"] and first["published"]
    assert second["prefix_hit"] and not second["published"]
    assert second["matched_tokens"] == len(SYSTEM.encode())
    assert second["prefilled_tokens"] == len("Where are the maps?")
    assert second["tokens"] == reference["tokens"]


def test_compare_runs_without_then_with_the_lookup(server):
    _, lines = run_in_process("--address", server.address, "--model-name", "test-compare",
                              "--prompt", "Hi", "--compare")
    assert [line["prefix_hit"] for line in lines] == [False, True]
    assert lines[0]["tokens"] == lines[1]["tokens"]


def test_bad_arguments_exit_nonzero_with_a_message(capsys):
    assert cli.main(["--cache", "local", "--system", "x", "--prompt-ids", "",
                     "--tiny-config", TINY]) == 1
    assert "user prompt is empty" in capsys.readouterr().err

