#!/usr/bin/python3
"""Interop: a Python client generated from protos/kvcache/v1/kvcache.proto
talks to the real kvcached binary over loopback.

The test starts kvcached itself (a free port, the Vulkan validation layer on),
streams updates, snapshots, restores and fetches, checks every byte against a
plain Python mirror, then stops the server with SIGTERM and expects exit code 0
and no validation message in its log. Everything runs twice: in plaintext, and
with TLS (certificates made by openssl for the run) through grpcio's TLS and
Python's own ssl module on the data lane, which must refuse plaintext and a
client that trusts another CA. A router's side of the KV events, written the
way vLLM's example subscriber is (pyzmq, msgpack), reads a published prefix's
blocks, live and replayed.

The stubs are generated with protoc and grpc_python_plugin: the protoc bundled
in Debian's python3-grpc-tools (1.14) predates proto3 `optional` fields.

  /usr/bin/python3 interop_test.py --kvcached build/server/kvcached \\
      --proto_dir protos --protoc /usr/bin/protoc \\
      --grpc_python_plugin /usr/bin/grpc_python_plugin
"""

import argparse
import os
import random
import re
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import msgpack
import zmq

ARGS = None
pb = None  # kvcache.v1.kvcache_pb2, once generated
pb_grpc = None
grpc = None

HEADS, DIM, ELEM = 2, 8, 2  # float16 K and V of [1, 2, L, 8]
ROW = DIM * ELEM
WINDOW, SINKS = 8, 4  # the rotating layer


def generate_stubs(out_dir):
    """Generates kvcache_pb2 / kvcache_pb2_grpc into out_dir and imports them."""
    global pb, pb_grpc, grpc
    proto = os.path.join(ARGS.proto_dir, "kvcache", "v1", "kvcache.proto")
    subprocess.run([ARGS.protoc, "--proto_path=" + ARGS.proto_dir, "--python_out=" + out_dir,
                    "--grpc_out=" + out_dir,
                    "--plugin=protoc-gen-grpc=" + ARGS.grpc_python_plugin, proto], check=True)
    sys.path.insert(0, out_dir)
    import grpc as grpc_module
    from kvcache.v1 import kvcache_pb2, kvcache_pb2_grpc
    grpc, pb, pb_grpc = grpc_module, kvcache_pb2, kvcache_pb2_grpc


class Kvcached:
    """The kvcached binary on 127.0.0.1:<free port>, its log collected."""

    def __init__(self, flags=()):
        self.log = []
        self.address = None
        self._listening = threading.Event()
        self.process = subprocess.Popen(
            [ARGS.kvcached, "--listen=127.0.0.1:0", "--data_lane_listen=127.0.0.1:0",
             "--validation", "--pool_bytes=67108864",
             "--page_bytes=8192", "--page_tokens=16", "--shutdown_grace=5s", *flags],
            stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        if not self._listening.wait(60) or self.address is None:
            self.process.kill()
            raise RuntimeError("kvcached did not start:\n" + "".join(self.log))

    def _read_log(self):
        for line in self.process.stderr:
            self.log.append(line)
            match = re.search(r"listening on (\S+)", line)
            if match:
                self.address = match.group(1)
                self._listening.set()
        self._listening.set()  # exited before listening

    def signal(self, number):
        self.process.send_signal(number)

    def wait_for_log(self, text, seconds=10):
        """Whether a line holding text was logged within the time."""
        deadline = time.monotonic() + seconds
        while not any(text in line for line in self.log):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self):
        """SIGTERM, then the exit code."""
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self._reader.join(timeout=10)
        return code


def random_kv(tokens):
    return random.randbytes(HEADS * tokens * ROW), random.randbytes(HEADS * tokens * ROW)


def tensor(data, tokens):
    return pb.Tensor(dtype=pb.DTYPE_FLOAT16, shape=[1, HEADS, tokens, DIM], data=data)


def split_tokens(data, tokens, start):
    """[1, H, L, D] bytes -> [(position, per-head rows)] for L tokens."""
    return [(start + t, tuple(data[(h * tokens + t) * ROW:(h * tokens + t + 1) * ROW]
                              for h in range(HEADS)))
            for t in range(tokens)]


class Mirror:
    """What each layer holds: (position, K rows, V rows) in temporal order."""

    def __init__(self, kinds):
        self.kinds = kinds  # "standard" or "rotating" per layer
        self.layers = [[] for _ in kinds]

    def offset(self, layer):
        return self.layers[layer][-1][0] + 1 if self.layers[layer] else 0

    def append(self, layer, keys, values, tokens):
        start = self.offset(layer)
        ks, vs = split_tokens(keys, tokens, start), split_tokens(values, tokens, start)
        self.layers[layer] += [(k[0], k[1], v[1]) for k, v in zip(ks, vs)]
        if self.kinds[layer] == "rotating" and len(self.layers[layer]) > WINDOW:
            # Single-token steps past the window: the sinks, then the recent rest.
            held = self.layers[layer]
            self.layers[layer] = held[:SINKS] + held[-(WINDOW - SINKS):]

    def copy(self):
        other = Mirror(self.kinds)
        other.layers = [list(tokens) for tokens in self.layers]
        return other


# What a lane connection opens with, answered in kind: the lane's one version.
LANE_PREAMBLE = b"KVLANE02"


class Lane:
    """The data lane from Python: a socket, 8-byte frame headers (payload
    length, kind) and the generated messages, as the .proto describes it."""

    def __init__(self, address, tls=None):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        if tls is not None:  # an ssl.SSLContext: TLS from the first byte
            self.sock = tls.wrap_socket(self.sock, server_hostname=host)
        self.sock.sendall(LANE_PREAMBLE)
        self.buffer = b""
        while len(self.buffer) < len(LANE_PREAMBLE):
            data = self.sock.recv(len(LANE_PREAMBLE) - len(self.buffer))
            if not data:
                raise ConnectionError("the data lane closed")
            self.buffer += data
        if self.buffer != LANE_PREAMBLE:
            raise AssertionError("%r answered with %r" % (LANE_PREAMBLE, self.buffer))
        self.buffer = b""

    def send(self, kind, message=None):
        payload = message.SerializeToString() if message is not None else b""
        self.sock.sendall(struct.pack("<IB3x", len(payload), kind) + payload)

    def read(self):
        """The next frame: (kind, payload bytes)."""
        while True:
            if len(self.buffer) >= 8:
                length, kind = struct.unpack("<IB3x", self.buffer[:8])
                if len(self.buffer) >= 8 + length:
                    payload, self.buffer = self.buffer[8:8 + length], self.buffer[8 + length:]
                    return kind, payload
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the data lane closed")
            self.buffer += data

    def read_status(self):
        kind, payload = self.read()
        if kind != pb.LANE_FRAME_STATUS:
            raise AssertionError("expected a STATUS frame, got kind %d" % kind)
        return pb.LaneStatus.FromString(payload)


CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20)]


class InteropTest(unittest.TestCase):
    lane_tls = None  # the data lane's ssl.SSLContext; None: plaintext

    @classmethod
    def setUpClass(cls):
        cls.server = Kvcached()
        cls.channel = grpc.insecure_channel(cls.server.address, options=CHANNEL_OPTIONS)
        cls.connect()

    @classmethod
    def connect(cls):
        grpc.channel_ready_future(cls.channel).result(timeout=30)
        cls.stub = pb_grpc.KvCacheServiceStub(cls.channel)

    def open_lane(self, address):
        return Lane(address, self.lane_tls)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        code = cls.server.stop()
        log = "".join(cls.server.log)
        if code != 0:
            raise AssertionError("kvcached exited with %d after SIGTERM:\n%s" % (code, log))
        if "vulkan validation" in log:
            raise AssertionError("Vulkan validation messages:\n" + log)

    def setUp(self):
        random.seed(20240611)

    def create_cache(self):
        layers = [pb.LayerSpec(num_kv_heads=HEADS, k_head_dim=DIM, standard=pb.StandardLayer())
                  for _ in range(2)]
        layers.append(pb.LayerSpec(num_kv_heads=HEADS, k_head_dim=DIM,
                                   rotating=pb.RotatingLayer(max_size=WINDOW, keep=SINKS)))
        info = self.stub.CreateCache(pb.CreateCacheRequest(
            spec=pb.CacheSpec(layers=layers, dtype=pb.DTYPE_FLOAT16, model="interop")))
        self.assertEqual(len(info.cache_id), 32)
        self.assertEqual(list(info.layer_offsets), [0, 0, 0])
        return info.cache_id, Mirror(["standard", "standard", "rotating"])

    def stream_steps(self, cache_id, mirror, step_tokens):
        """One Update stream: a step of every layer per entry of step_tokens."""
        requests, expected = [], []
        for tokens in step_tokens:
            for layer in range(3):
                keys, values = random_kv(tokens)
                requests.append(pb.UpdateRequest(cache_id=cache_id, layer=layer,
                                                 keys=tensor(keys, tokens),
                                                 values=tensor(values, tokens)))
                mirror.append(layer, keys, values, tokens)
                expected.append((layer, mirror.offset(layer)))
        acks = [(ack.layer, ack.offset) for ack in self.stub.Update(iter(requests))]
        self.assertEqual(acks, expected)

    def fetch(self, layer, cache_id="", snapshot_id="", start=0, end=None):
        """[(position, K rows, V rows)] of one layer, from 3-token chunks."""
        request = pb.FetchRequest(cache_id=cache_id, snapshot_id=snapshot_id, layers=[layer],
                                  start=start, max_chunk_tokens=3)
        if end is not None:
            request.end = end
        held = []
        for chunk in self.stub.Fetch(request):
            self.assertEqual(chunk.layer, layer)
            tokens = chunk.keys.shape[2]
            self.assertLessEqual(tokens, 3)
            self.assertEqual(list(chunk.values.shape), [1, HEADS, tokens, DIM])
            ks = split_tokens(chunk.keys.data, tokens, chunk.start)
            vs = split_tokens(chunk.values.data, tokens, chunk.start)
            held += [(k[0], k[1], v[1]) for k, v in zip(ks, vs)]
        return held

    def assert_holds(self, cache_id, mirror):
        for layer in range(3):
            self.assertEqual(self.fetch(layer, cache_id=cache_id), mirror.layers[layer],
                             "layer %d" % layer)

    def test_stream_snapshot_restore_fetch(self):
        cache_id, mirror = self.create_cache()
        self.stream_steps(cache_id, mirror, [6, 1, 1, 1, 1])  # a prompt, then decoding
        self.assert_holds(cache_id, mirror)
        snapshot = self.stub.Snapshot(pb.SnapshotRequest(cache_id=cache_id, from_offset=0))
        self.assertEqual((snapshot.from_offset, snapshot.to_offset), (0, 10))
        at_snapshot = mirror.copy()

        self.stream_steps(cache_id, mirror, [1] * 5)
        self.assert_holds(cache_id, mirror)
        self.assertEqual([p for p, _, _ in mirror.layers[2]], [0, 1, 2, 3, 11, 12, 13, 14])

        restored = self.stub.Restore(pb.RestoreRequest(cache_id=cache_id,
                                                       snapshot_id=snapshot.snapshot_id,
                                                       target_offset=10))
        self.assertEqual(list(restored.layer_offsets), [10, 10, 10])
        self.assert_holds(cache_id, at_snapshot)
        # The snapshot itself, a window of it.
        self.assertEqual(self.fetch(0, snapshot_id=snapshot.snapshot_id, start=2, end=7),
                         at_snapshot.layers[0][2:7])

        # The rotating layer has wrapped: a live rewind is refused and changes nothing.
        with self.assertRaises(grpc.RpcError) as refused:
            self.stub.Restore(pb.RestoreRequest(cache_id=cache_id, target_offset=8))
        self.assertEqual(refused.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        self.assert_holds(cache_id, at_snapshot)

        self.stub.ReleaseSnapshot(pb.ReleaseSnapshotRequest(snapshot_id=snapshot.snapshot_id))
        self.stub.DeleteCache(pb.DeleteCacheRequest(cache_id=cache_id))
        self.assertEqual(self.stub.GetStats(pb.GetStatsRequest()).pages_used, 0)

    def test_data_lane_update_and_fetch(self):
        """Update and Fetch over the data lane, framed by hand: the same bytes
        and the same refusals as over gRPC."""
        address = self.stub.GetStats(pb.GetStatsRequest()).data_lane_address
        self.assertRegex(address, r"^127\.0\.0\.1:\d+$")
        cache_id, mirror = self.create_cache()
        lane = self.open_lane(address)
        expected = []
        for tokens in [5, 1, 1]:
            for layer in range(3):
                keys, values = random_kv(tokens)
                lane.send(pb.LANE_FRAME_UPDATE, pb.UpdateRequest(
                    cache_id=cache_id, layer=layer, keys=tensor(keys, tokens),
                    values=tensor(values, tokens)))
                mirror.append(layer, keys, values, tokens)
                expected.append((layer, mirror.offset(layer)))
        lane.send(pb.LANE_FRAME_UPDATE_END)
        acks = []
        for _ in expected:
            kind, payload = lane.read()
            self.assertEqual(kind, pb.LANE_FRAME_UPDATE_ACK)
            ack = pb.UpdateResponse.FromString(payload)
            acks.append((ack.layer, ack.offset))
        self.assertEqual(acks, expected)
        self.assertEqual(lane.read_status().code, 0)

        # Each Fetch says first how many bytes of chunk frames follow.
        for layer in range(3):
            held, announced, chunk_bytes = self.lane_fetch(lane, cache_id, layer)
            self.assertEqual(held, mirror.layers[layer], "layer %d" % layer)
            self.assertEqual(announced, chunk_bytes)
        self.assert_holds(cache_id, mirror)  # and over gRPC

        # A bad request: INVALID_ARGUMENT naming the field, nothing changed.
        keys, values = random_kv(2)
        lane.send(pb.LANE_FRAME_UPDATE, pb.UpdateRequest(
            cache_id=cache_id, layer=7, keys=tensor(keys, 2), values=tensor(values, 2)))
        lane.send(pb.LANE_FRAME_UPDATE_END)
        status = lane.read_status()
        self.assertEqual(status.code, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        self.assertIn("layer", status.message)
        self.assert_holds(cache_id, mirror)
        lane.sock.close()
        self.stub.DeleteCache(pb.DeleteCacheRequest(cache_id=cache_id))

    def lane_fetch(self, lane, cache_id, layer):
        """One layer's tokens over the lane in 3-token chunks, the length the
        server announced (None: none) and the chunk frames' bytes."""
        lane.send(pb.LANE_FRAME_FETCH, pb.FetchRequest(cache_id=cache_id, layers=[layer],
                                                       max_chunk_tokens=3))
        held, announced, chunk_bytes = [], None, 0
        while True:
            kind, payload = lane.read()
            if kind == pb.LANE_FRAME_STATUS:
                self.assertEqual(pb.LaneStatus.FromString(payload).code, 0)
                return held, announced, chunk_bytes
            if kind == pb.LANE_FRAME_FETCH_LENGTH:
                self.assertIsNone(announced)
                announced = pb.LaneFetchLength.FromString(payload).chunk_frame_bytes
                continue
            self.assertEqual(kind, pb.LANE_FRAME_FETCH_CHUNK)
            chunk_bytes += 8 + len(payload)
            chunk = pb.FetchResponse.FromString(payload)
            tokens = chunk.keys.shape[2]
            ks = split_tokens(chunk.keys.data, tokens, chunk.start)
            vs = split_tokens(chunk.values.data, tokens, chunk.start)
            held += [(k[0], k[1], v[1]) for k, v in zip(ks, vs)]

    def test_errors_map_to_status_codes(self):
        cache_id, _ = self.create_cache()
        keys, values = random_kv(2)
        bad = pb.UpdateRequest(cache_id=cache_id, layer=3, keys=tensor(keys, 2),
                               values=tensor(values, 2))
        with self.assertRaises(grpc.RpcError) as invalid:
            list(self.stub.Update(iter([bad])))
        self.assertEqual(invalid.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("layer", invalid.exception.details())
        with self.assertRaises(grpc.RpcError) as missing:
            self.stub.GetCache(pb.GetCacheRequest(cache_id="0" * 32))
        self.assertEqual(missing.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertEqual(list(self.stub.GetCache(pb.GetCacheRequest(cache_id=cache_id))
                              .layer_offsets), [0, 0, 0])
        self.stub.DeleteCache(pb.DeleteCacheRequest(cache_id=cache_id))


def make_certificates(directory):
    """Two CAs, and a certificate for IP 127.0.0.1 signed by the first."""
    script = """set -e
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out $1; }
for ca in ca other_ca; do key $ca.key; openssl req -x509 -new -key $ca.key -days 1 \\
  -subj /CN=$ca -out $ca.pem; done
key server.key; openssl req -new -key server.key -subj /CN=kvcached -out server.csr
printf 'subjectAltName=IP:127.0.0.1\\n' > server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \\
  -extfile server.ext -out server.pem
"""
    subprocess.run(["bash", "-c", script], cwd=directory, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class InteropTlsTest(InteropTest):
    """The same over TLS: grpcio's TLS on the gRPC port, Python's ssl on the lane."""

    @classmethod
    def setUpClass(cls):
        cls.certs = tempfile.mkdtemp(prefix="kvcached-interop-tls-")
        make_certificates(cls.certs)
        cls.server = Kvcached(["--tls_cert=" + os.path.join(cls.certs, "server.pem"),
                               "--tls_key=" + os.path.join(cls.certs, "server.key")])
        with open(os.path.join(cls.certs, "ca.pem"), "rb") as ca:
            credentials = grpc.ssl_channel_credentials(root_certificates=ca.read())
        cls.channel = grpc.secure_channel(cls.server.address, credentials,
                                          options=CHANNEL_OPTIONS)
        cls.lane_tls = ssl.create_default_context(cafile=os.path.join(cls.certs, "ca.pem"))
        cls.connect()

    @classmethod
    def tearDownClass(cls):
        try:
            super().tearDownClass()
        finally:
            shutil.rmtree(cls.certs, ignore_errors=True)

    def test_the_lane_refuses_plaintext_and_other_cas(self):
        address = self.stub.GetStats(pb.GetStatsRequest()).data_lane_address
        with self.assertRaises((ConnectionError, AssertionError, OSError)):
            Lane(address)  # plaintext: closed unanswered
        stranger = ssl.create_default_context(cafile=os.path.join(self.certs, "other_ca.pem"))
        with self.assertRaises(ssl.SSLCertVerificationError):
            Lane(address, tls=stranger)
        lane = self.open_lane(address)  # still served
        lane.sock.close()


class KvEventsTest(unittest.TestCase):
    """kvcached's KV events, read as a vLLM KV-event subscriber reads them."""

    @classmethod
    def setUpClass(cls):
        cls.server = Kvcached(["--kv_events_endpoint=tcp://127.0.0.1:*",
                               "--kv_events_replay_endpoint=tcp://127.0.0.1:*",
                               "--kv_events_topic=kv-events"])
        line = next(line for line in cls.server.log if "KV events (vLLM's" in line)
        cls.endpoint, cls.replay_endpoint = re.findall(r"tcp://127\.0\.0\.1:\d+", line)
        cls.channel = grpc.insecure_channel(cls.server.address, options=CHANNEL_OPTIONS)
        grpc.channel_ready_future(cls.channel).result(timeout=30)
        cls.stub = pb_grpc.KvCacheServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        if cls.server.stop() != 0:
            raise AssertionError("kvcached failed:\n" + "".join(cls.server.log))

    def replay(self, replay, start):
        """[(sequence, batch)] from `start`, asked as vLLM's subscriber asks, from
        a DEALER (a REQ socket would read the first batch only)."""
        replay.send_multipart([b"", start.to_bytes(8, "big")])
        batches = []
        while True:
            self.assertTrue(replay.poll(5000), "no answer to a replay")
            _, sequence, payload = replay.recv_multipart()
            if not payload:
                self.assertEqual(int.from_bytes(sequence, "big", signed=True), -1)
                return batches
            batches.append((int.from_bytes(sequence, "big"), msgpack.unpackb(payload)))

    def publish(self, prompt):
        """A one-layer cache of len(prompt) positions published as `prompt`:
        (cache id, snapshot id, the entry's snapshot id)."""
        layer = pb.LayerSpec(num_kv_heads=HEADS, k_head_dim=DIM, standard=pb.StandardLayer())
        info = self.stub.CreateCache(pb.CreateCacheRequest(
            spec=pb.CacheSpec(layers=[layer], dtype=pb.DTYPE_FLOAT16, model="interop")))
        keys, values = random_kv(len(prompt))
        list(self.stub.Update(iter([pb.UpdateRequest(
            cache_id=info.cache_id, layer=0, keys=tensor(keys, len(prompt)),
            values=tensor(values, len(prompt)))])))
        snapshot = self.stub.Snapshot(pb.SnapshotRequest(cache_id=info.cache_id))
        entry = self.stub.PublishPrefix(pb.PublishPrefixRequest(
            snapshot_id=snapshot.snapshot_id, tokens=prompt)).entry
        self.stub.ReleaseSnapshot(pb.ReleaseSnapshotRequest(snapshot_id=snapshot.snapshot_id))
        self.stub.DeleteCache(pb.DeleteCacheRequest(cache_id=info.cache_id))
        return entry.snapshot_id

    def test_a_published_prefix_reaches_a_vllm_subscriber(self):
        context = zmq.Context()
        replay = context.socket(zmq.DEALER)
        replay.connect(self.replay_endpoint)

        prompt = list(range(100, 148))
        entry = self.publish(prompt)
        deadline = time.monotonic() + 10
        while True:
            batches = self.replay(replay, 0)
            if len(batches) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        self.assertEqual([s for s, _ in batches], [0, 1])
        self.assertEqual(batches[0][1][1], [{"type": "AllBlocksCleared"}])
        ts, events, rank = batches[1][1]
        self.assertIsInstance(ts, float)
        self.assertEqual(rank, 0)
        self.assertEqual(len(events), 1)
        stored = events[0]
        self.assertEqual(stored["type"], "BlockStored")
        self.assertEqual(len(stored["block_hashes"]), 3)
        self.assertTrue(all(0 <= h < 2 ** 64 for h in stored["block_hashes"]))
        self.assertIsNone(stored["parent_block_hash"])
        self.assertEqual(stored["token_ids"], prompt)
        self.assertEqual(stored["block_size"], 16)
        self.assertEqual(stored["medium"], "GPU")

        # Live, as vLLM's subscriber reads: [topic, sequence, payload]. A
        # subscription takes a moment to reach the publisher, so entries are
        # released and published until one arrives.
        sub = context.socket(zmq.SUB)
        sub.connect(self.endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
        self.stub.ReleaseSnapshot(pb.ReleaseSnapshotRequest(snapshot_id=entry))
        for attempt in range(40):
            if sub.poll(500):
                break
            self.stub.ReleaseSnapshot(pb.ReleaseSnapshotRequest(snapshot_id=self.publish(
                list(range(1000 * attempt, 1000 * attempt + 16)))))
        self.assertTrue(sub.poll(5000), "no live batch")
        topic, sequence, payload = sub.recv_multipart()
        self.assertEqual(topic, b"kv-events")
        sequence = int.from_bytes(sequence, "big")
        self.assertEqual(dict(self.replay(replay, sequence))[sequence], msgpack.unpackb(payload))
        self.assertIn(msgpack.unpackb(payload)[1][0]["type"], ("BlockStored", "BlockRemoved"))
        context.destroy(linger=0)


def write_curve_files(directory, secret_key, subscriber_keys):
    """The publisher's secret key file (mode 600) and the subscribers file."""
    secret_file = os.path.join(directory, "publisher.key")
    with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as out:
        out.write(secret_key + b"\n")
    subscribers_file = os.path.join(directory, "subscribers")
    write_subscribers(subscribers_file, subscriber_keys)
    return secret_file, subscribers_file


def write_subscribers(path, keys):
    # In place, not renamed over: a container sees a file mounted alone
    # only through its inode.
    with open(path, "wb") as out:
        out.write(b"# the routers\n" + b"".join(key + b"\n" for key in keys))
    os.chmod(path, 0o644)  # whatever the umask: kvcached refuses a list others may write


def curve_server(secret_file, subscribers_file):
    """kvcached publishing KV events under CURVE, and its replay endpoint."""
    server = Kvcached(["--kv_events_endpoint=tcp://127.0.0.1:*",
                       "--kv_events_replay_endpoint=tcp://127.0.0.1:*",
                       "--kv_events_curve_key_file=" + secret_file,
                       "--kv_events_curve_subscribers_file=" + subscribers_file])
    line = next(line for line in server.log if "KV events (vLLM's" in line)
    return server, re.findall(r"tcp://127\.0\.0\.1:\d+", line)[1]


def replay_dealer(context, endpoint, curve_keys):
    """A router's replay socket (a DEALER), with (server, public, secret) keys."""
    dealer = context.socket(zmq.DEALER)
    dealer.linger = 0
    # A DEALER with no connection blocks a send for ever: one whose key was
    # taken off is refused at every reconnect, so it may have none.
    dealer.sndtimeo = 2000
    if curve_keys:
        dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = curve_keys
    dealer.connect(endpoint)
    return dealer


def replay_answer(dealer, wait_ms=2000):
    """Every message answering a replay from 0, or None when none comes in time."""
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    except zmq.Again:
        return None  # no connection to ask on
    answer = []
    while dealer.poll(wait_ms):
        answer.append(dealer.recv_multipart())
        if not answer[-1][2]:
            return answer  # the end marker
    return answer or None


class KvEventsCurveTest(unittest.TestCase):
    """KV events under CURVE, as a pyzmq subscriber (vLLM's) sets it up: the
    replica admits the router whose key it lists, and no one else; SIGHUP
    re-reads the list."""

    @classmethod
    def setUpClass(cls):
        cls.keys = tempfile.mkdtemp(prefix="kvcache_curve_")
        cls.server_public, server_secret = zmq.curve_keypair()
        cls.router_public, cls.router_secret = zmq.curve_keypair()
        cls.secret_file, cls.subscribers_file = write_curve_files(
            cls.keys, server_secret, [cls.router_public])
        cls.server, cls.replay_endpoint = curve_server(cls.secret_file, cls.subscribers_file)
        cls.announced = next(line for line in cls.server.log if "CURVE on" in line)
        cls.listed = (cls.server_public, cls.router_public, cls.router_secret)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.keys, ignore_errors=True)
        if cls.server.stop() != 0:
            raise AssertionError("kvcached failed:\n" + "".join(cls.server.log))

    def ask(self, curve_keys):
        """The first answer to a replay from 0, or None within 2 s."""
        context = zmq.Context()
        answer = replay_answer(replay_dealer(context, self.replay_endpoint, curve_keys),
                               10000 if curve_keys == self.listed else 2000)
        context.destroy(linger=0)
        return answer[0] if answer else None

    def test_the_listed_router_alone_is_answered(self):
        self.assertIn(self.server_public.decode(), self.announced, "the public key is logged")
        answer = self.ask(self.listed)
        self.assertIsNotNone(answer, "the listed router")
        self.assertEqual(int.from_bytes(answer[1], "big"), 0)
        self.assertEqual(msgpack.unpackb(answer[2])[1], [{"type": "AllBlocksCleared"}])
        stranger_public, stranger_secret = zmq.curve_keypair()
        self.assertIsNone(self.ask((self.server_public, stranger_public, stranger_secret)))
        self.assertIsNone(self.ask(None), "plaintext")

    def test_sighup_admits_a_new_router_and_cuts_off_a_revoked_one(self):
        keys = tempfile.mkdtemp(prefix="kvcache_curve_reload_")
        server_public, server_secret = zmq.curve_keypair()
        old_public, old_secret = zmq.curve_keypair()
        new_public, new_secret = zmq.curve_keypair()
        secret_file, subscribers_file = write_curve_files(keys, server_secret, [old_public])
        server, replay_endpoint = curve_server(secret_file, subscribers_file)
        context = zmq.Context()
        try:
            old_router = replay_dealer(context, replay_endpoint,
                                       (server_public, old_public, old_secret))
            self.assertIsNotNone(replay_answer(old_router, 10000), "the listed router")
            new_keys = (server_public, new_public, new_secret)
            self.assertIsNone(replay_answer(replay_dealer(context, replay_endpoint, new_keys)))

            write_subscribers(subscribers_file, [new_public])
            server.signal(signal.SIGHUP)
            self.assertTrue(server.wait_for_log("keys were taken off"),
                            "no reload:\n" + "".join(server.log))
            self.assertIsNotNone(
                replay_answer(replay_dealer(context, replay_endpoint, new_keys), 10000),
                "the router listed now")
            self.assertIsNone(replay_answer(old_router), "the connection it had is gone")

            write_subscribers(subscribers_file, [])
            server.signal(signal.SIGHUP)
            self.assertTrue(server.wait_for_log("subscribers kept as they were"),
                            "no refusal:\n" + "".join(server.log))
            self.assertIsNotNone(
                replay_answer(replay_dealer(context, replay_endpoint, new_keys), 10000),
                "an empty list changes nothing")
        finally:
            context.destroy(linger=0)
            shutil.rmtree(keys, ignore_errors=True)
            self.assertEqual(server.stop(), 0, "".join(server.log))


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvcached", required=True)
    parser.add_argument("--proto_dir", required=True)
    parser.add_argument("--protoc", default="protoc")
    parser.add_argument("--grpc_python_plugin", default="/usr/bin/grpc_python_plugin")
    ARGS, rest = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="kvcache_py_") as out_dir:
        generate_stubs(out_dir)
        program = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
    sys.exit(0 if program.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
