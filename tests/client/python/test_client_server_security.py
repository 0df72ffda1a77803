"""Client against kvcached with bearer tokens, with TLS, and with a data dir:
the same calls over gRPC and the data lane, refused where they must be."""

import os
import subprocess

import grpc
import numpy as np
import pytest

import kvcached
from kvcached import specs
from kvcached_process import Kvcached

SPEC = specs.cache_spec([specs.standard(2, 8)])
TOKEN = "a-tenant-secret-of-32-characters"  # the server wants 16 bytes or more


def round_trip(client):
    """An update and its fetch, byte for byte; the cache deleted after."""
    rng = np.random.default_rng(11)
    keys = rng.standard_normal((1, 2, 5, 8)).astype(np.float16)
    with client.new_cache(SPEC) as cache:
        client.update(cache.id, 0, keys, keys[:, ::-1].copy())
        got = client.fetch(cache.id, 0)
        assert got.keys.tobytes() == keys.tobytes()
        assert got.values.tobytes() == keys[:, ::-1].tobytes()


@pytest.fixture(scope="module")
def token_server(kvcached_path, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text("tenant=alpha token=%s admin\n" % TOKEN)
    os.chmod(tokens, 0o600)
    process = Kvcached(kvcached_path, ["--tokens_file=%s" % tokens])
    yield process
    assert process.stop() == 0, "".join(process.log)


@pytest.mark.parametrize("lane", [False, True])
def test_a_token_opens_both_transports(token_server, lane):
    with kvcached.Client(address=token_server.address, token=TOKEN, keepalive_time=0,
                         data_lane="auto" if lane else "", deadline=30) as client:
        assert client.uses_data_lane() == lane
        round_trip(client)
        assert client.get_stats().tenant == "alpha"


def test_a_wrong_token_is_unauthenticated_on_both(token_server):
    with kvcached.Client(address=token_server.address, token=TOKEN, data_lane="",
                         keepalive_time=0) as admin:
        lane_address = admin.get_stats().data_lane_address
    with kvcached.Client(address=token_server.address, token="a-wrong-token-also-long-enough",
                         keepalive_time=0, data_lane=lane_address, deadline=30) as client:
        for call in (client.get_stats, lambda: client.fetch("0" * 32, 0)):
            with pytest.raises(kvcached.KvCacheError) as refused:
                call()
            assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED


def make_certificates(directory):
    """A CA and a certificate for IP 127.0.0.1 it signed; another CA beside."""
    script = """set -e
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out $1; }
for ca in ca other_ca; do key $ca.key
  openssl req -x509 -new -key $ca.key -days 1 -subj /CN=$ca -out $ca.pem; done
key server.key; openssl req -new -key server.key -subj /CN=kvcached -out server.csr
printf 'subjectAltName=IP:127.0.0.1\\n' > server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \\
  -extfile server.ext -out server.pem
"""
    subprocess.run(["bash", "-c", script], cwd=directory, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def tls_server(kvcached_path, tmp_path_factory):
    certs = tmp_path_factory.mktemp("certs")
    make_certificates(certs)
    process = Kvcached(kvcached_path, ["--tls_cert=%s" % (certs / "server.pem"),
                                       "--tls_key=%s" % (certs / "server.key")])
    process.certs = certs
    yield process
    assert process.stop() == 0, "".join(process.log)


@pytest.mark.parametrize("lane", [False, True])
def test_tls_carries_both_transports(tls_server, lane):
    roots = (tls_server.certs / "ca.pem").read_text()
    with kvcached.Client(address=tls_server.address, tls=True, tls_root_certs_pem=roots,
                         data_lane="auto" if lane else "", keepalive_time=0,
                         deadline=30) as client:
        assert client.uses_data_lane() == lane
        round_trip(client)


def test_tls_refuses_a_server_another_ca_signed(tls_server):
    stranger = (tls_server.certs / "other_ca.pem").read_text()
    roots = (tls_server.certs / "ca.pem").read_text()
    with kvcached.Client(address=tls_server.address, tls=True, tls_root_certs_pem=roots,
                         data_lane="", keepalive_time=0) as trusting:
        lane_address = trusting.get_stats().data_lane_address
    with kvcached.Client(address=tls_server.address, tls=True, tls_root_certs_pem=stranger,
                         data_lane=lane_address, keepalive_time=0, deadline=5,
                         first_connect_wait=0) as client:
        for call in (client.get_stats, lambda: client.fetch("0" * 32, 0)):
            with pytest.raises(kvcached.KvCacheError) as refused:
                call()
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def files_server(kvcached_path, tmp_path_factory):
    process = Kvcached(kvcached_path, ["--data_dir=%s" % tmp_path_factory.mktemp("data")])
    yield process
    assert process.stop() == 0, "".join(process.log)


def test_saved_files_save_load_export_import(files_server):
    rng = np.random.default_rng(12)
    keys = rng.standard_normal((1, 2, 9, 8)).astype(np.float16)
    with kvcached.Client(address=files_server.address, keepalive_time=0, deadline=30) as client:
        with client.new_cache(SPEC) as cache:
            client.update(cache.id, 0, keys, keys)
            with client.new_snapshot(cache.id) as snapshot:
                saved = client.save_snapshot(snapshot.id, "prompt", {"model": "test"})
                exported = client.export_snapshot(snapshot_id=snapshot.id)
        assert saved.name == "prompt" and saved.size_bytes > 0
        assert [f.name for f in client.list_saved()] == ["prompt"]
        loaded = client.load_snapshot("prompt")
        assert loaded.metadata["model"] == "test" and loaded.checksum_verified
        imported = client.import_snapshot(exported)
        assert imported.snapshot.to_offset == 9
        for answer in (loaded, imported):
            with kvcached.Snapshot(client, answer.snapshot), \
                    client.new_cache(answer.spec) as restored:
                client.restore(restored.id, 9, snapshot_id=answer.snapshot.snapshot_id)
                assert client.fetch(restored.id, 0).keys.tobytes() == keys.tobytes()
        client.delete_saved("prompt")
        assert client.list_saved() == []
        stats = client.get_stats()
        assert (stats.caches, stats.snapshots, stats.pages_used) == (0, 0, 0)
