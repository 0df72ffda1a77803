#!/usr/bin/python3
"""Faults against the real kvcached binary, from other processes.

Clients SIGKILLed mid-stream on gRPC and mid-frame on the data lane leave
exactly what they sent up to where they died (every acknowledged token, with
its bytes); garbage on the lane port and clients that ask for more than they
ever read leave the server's memory bounded and every other client served;
an exhausted pool answers RESOURCE_EXHAUSTED and recovers with no page
leaked; SIGTERM with streams in flight on both transports drains and exits 0.
After each, every page is back (Stats.pages_used is 0).

  /usr/bin/python3 fault_test.py --kvcached build/server/kvcached \\
      --proto_dir protos --protoc /usr/bin/protoc \\
      --grpc_python_plugin /usr/bin/grpc_python_plugin

Uses interop_test.py's server, stubs and hand-framed lane. A killed client is
this script again (--child=grpc|lane), so its bytes are known to the parent:
token t of the stream holds bytes drawn from random.Random(t).
"""

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import interop_test as it  # noqa: E402

STUBS = None  # the directory the stubs were generated into


def token_kv(position):
    """Layer 0's K and V rows of stream token `position` ([1, H, 1, D])."""
    rows = random.Random(position).randbytes(2 * it.HEADS * it.ROW)
    return rows[:it.HEADS * it.ROW], rows[it.HEADS * it.ROW:]


def update(cache_id, position):
    keys, values = token_kv(position)
    return it.pb.UpdateRequest(cache_id=cache_id, layer=0, keys=it.tensor(keys, 1),
                               values=it.tensor(values, 1))


def run_child(kind, address, cache_id):
    """Streams 1-token updates of layer 0 until killed, printing each
    acknowledged offset; a lane child ends on a half-sent frame."""
    if kind == "grpc":
        channel = it.grpc.insecure_channel(address)
        stub = it.pb_grpc.KvCacheServiceStub(channel)

        def requests():
            position = 0
            while True:
                yield update(cache_id, position)
                position += 1
                time.sleep(0.001)

        for ack in stub.Update(requests()):
            print(ack.offset, flush=True)
        return
    lane = it.Lane(address)
    for position in range(40):
        lane.send(it.pb.LANE_FRAME_UPDATE, update(cache_id, position))
        kind_read, payload = lane.read()
        assert kind_read == it.pb.LANE_FRAME_UPDATE_ACK
        print(it.pb.UpdateResponse.FromString(payload).offset, flush=True)
    frame = update(cache_id, 40).SerializeToString()
    lane.sock.sendall(len(frame).to_bytes(4, "little") + bytes(4) + frame[:len(frame) // 2])
    print("partial", flush=True)
    time.sleep(600)


def spawn_child(kind, address, cache_id):
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child=" + kind, "--address=" + address,
         "--cache_id=" + cache_id, "--stubs=" + STUBS, "--kvcached=-", "--proto_dir=-"],
        stdout=subprocess.PIPE, text=True)


def server_rss_bytes(server):
    with open("/proc/%d/status" % server.process.pid) as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class FaultTest(unittest.TestCase):
    def setUp(self):
        self.server = it.Kvcached()
        self.channel = it.grpc.insecure_channel(self.server.address, options=it.CHANNEL_OPTIONS)
        it.grpc.channel_ready_future(self.channel).result(timeout=30)
        self.stub = it.pb_grpc.KvCacheServiceStub(self.channel)
        self.lane_address = self.stub.GetStats(it.pb.GetStatsRequest()).data_lane_address
        self.children = []

    def tearDown(self):
        for child in self.children:
            child.kill()
            child.wait()
            child.stdout.close()
        self.channel.close()
        code = self.server.stop()
        log = "".join(self.server.log)
        self.assertEqual(code, 0, "kvcached exited with %d after SIGTERM:\n%s" % (code, log))
        self.assertNotIn("vulkan validation", log)

    def create_cache(self, layers=1):
        spec = it.pb.CacheSpec(dtype=it.pb.DTYPE_FLOAT16, layers=[
            it.pb.LayerSpec(num_kv_heads=it.HEADS, k_head_dim=it.DIM, standard=it.pb.StandardLayer())
            for _ in range(layers)])
        return self.stub.CreateCache(it.pb.CreateCacheRequest(spec=spec)).cache_id

    def fetch_layer0(self, cache_id):
        """(keys, values) bytes per position of layer 0, in order."""
        held = []
        for chunk in self.stub.Fetch(it.pb.FetchRequest(cache_id=cache_id, layers=[0])):
            tokens = chunk.keys.shape[2]
            for t in range(tokens):
                rows = lambda data: b"".join(
                    data[(h * tokens + t) * it.ROW:(h * tokens + t + 1) * it.ROW]
                    for h in range(it.HEADS))
                held.append((rows(chunk.keys.data), rows(chunk.values.data)))
        return held

    def wait_for_no_pages(self):
        deadline = time.time() + 20
        while time.time() < deadline:
            if self.stub.GetStats(it.pb.GetStatsRequest()).pages_used == 0:
                return
            time.sleep(0.05)
        self.fail("pages still in use: %d" % self.stub.GetStats(it.pb.GetStatsRequest()).pages_used)

    def kill_mid_stream(self, kind, acks_before_kill):
        cache_id = self.create_cache()
        child = spawn_child(kind, self.server.address if kind == "grpc" else self.lane_address,
                            cache_id)
        self.children.append(child)
        acknowledged = 0
        for line in child.stdout:
            if line.strip() == "partial":
                break
            acknowledged = int(line)
            if kind == "grpc" and acknowledged >= acks_before_kill:
                break
        self.assertGreaterEqual(acknowledged, acks_before_kill)
        child.send_signal(signal.SIGKILL)
        child.wait()
        # Every acknowledged token is there with its bytes; what arrived
        # after the last acknowledgement, if anything, is whole and right.
        deadline = time.time() + 10
        while True:
            held = self.fetch_layer0(cache_id)
            if len(held) >= acknowledged or time.time() > deadline:
                break
        self.assertGreaterEqual(len(held), acknowledged)
        for position, rows in enumerate(held):
            self.assertEqual(rows, token_kv(position), "token %d" % position)
        if kind == "lane":
            self.assertEqual(len(held), acknowledged, "the half-sent frame applied nothing")
        self.stub.DeleteCache(it.pb.DeleteCacheRequest(cache_id=cache_id))
        self.wait_for_no_pages()

    def test_a_client_killed_mid_stream_loses_nothing_acknowledged(self):
        for _ in range(3):
            self.kill_mid_stream("grpc", acks_before_kill=random.randint(5, 60))

    def test_a_client_killed_mid_frame_on_the_lane_loses_nothing_acknowledged(self):
        for _ in range(2):
            self.kill_mid_stream("lane", acks_before_kill=40)

    def assert_others_served(self):
        """A fresh client streams, fetches and deletes a cache in time."""
        cache_id = self.create_cache()
        list(self.stub.Update(iter([update(cache_id, p) for p in range(32)]), timeout=10))
        self.assertEqual(self.fetch_layer0(cache_id), [token_kv(p) for p in range(32)])
        self.stub.DeleteCache(it.pb.DeleteCacheRequest(cache_id=cache_id), timeout=10)

    def test_garbage_on_the_lane_port_is_shut_out(self):
        rng = random.Random(3)
        host, port = self.lane_address.rsplit(":", 1)
        for round_ in range(24):
            sock = socket.create_connection((host, int(port)), timeout=10)
            # Half open with the right preamble, then garbage frames; half
            # garbage from the first byte.
            opening = it.LANE_PREAMBLE if round_ % 2 else b""
            sock.sendall(opening + rng.randbytes(rng.randint(1, 64 << 10)))
            sock.settimeout(10)
            try:
                while sock.recv(1 << 16):
                    pass  # a STATUS frame naming the fault, then the end
            except ConnectionResetError:
                pass
            sock.close()
        self.assert_others_served()
        self.wait_for_no_pages()

    def test_clients_that_never_read_hold_no_more_than_their_sockets(self):
        cache_id = self.create_cache(layers=2)
        for layer in range(2):
            requests = []
            for start in range(0, 8192, 256):
                keys, values = it.random_kv(256)
                requests.append(it.pb.UpdateRequest(cache_id=cache_id, layer=layer,
                                                    keys=it.tensor(keys, 256),
                                                    values=it.tensor(values, 256)))
            list(self.stub.Update(iter(requests)))
        before = server_rss_bytes(self.server)
        # 8 lane connections and 8 gRPC streams each ask for ~1 MiB fetches
        # 50 times over (400 MiB each) and never read an answer.
        stalled = []
        fetch = it.pb.FetchRequest(cache_id=cache_id)
        for _ in range(8):
            lane = it.Lane(self.lane_address)
            for _ in range(50):
                lane.send(it.pb.LANE_FRAME_FETCH, fetch)
            stalled.append(lane)
        streams = [self.stub.Fetch(fetch) for _ in range(8)]
        time.sleep(2)
        self.assert_others_served()
        grown = server_rss_bytes(self.server) - before
        self.assertLess(grown, 96 << 20, "the server grew %d MiB for readers that never read"
                        % (grown >> 20))
        for lane in stalled:
            lane.sock.close()
        for stream in streams:
            stream.cancel()
        self.stub.DeleteCache(it.pb.DeleteCacheRequest(cache_id=cache_id))
        self.wait_for_no_pages()

    def test_an_exhausted_pool_recovers_with_no_page_leaked(self):
        caches, exhausted = [], None
        while exhausted is None and len(caches) < 400:
            cache_id = self.create_cache(layers=2)
            caches.append(cache_id)
            requests = []
            for layer in range(2):
                keys, values = it.random_kv(256)
                requests.append(it.pb.UpdateRequest(cache_id=cache_id, layer=layer,
                                                    keys=it.tensor(keys, 256),
                                                    values=it.tensor(values, 256)))
            try:
                for _ in range(16):
                    list(self.stub.Update(iter(requests)))
            except it.grpc.RpcError as error:
                exhausted = error
        self.assertIsNotNone(exhausted, "64 MiB never ran out")
        self.assertEqual(exhausted.code(), it.grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn("pool_bytes", exhausted.details())
        for cache_id in caches:
            self.stub.DeleteCache(it.pb.DeleteCacheRequest(cache_id=cache_id))
        self.wait_for_no_pages()
        self.assert_others_served()
        self.wait_for_no_pages()

    def test_sigterm_with_streams_in_flight_drains_and_exits_zero(self):
        for kind in ("grpc", "lane"):
            cache_id = self.create_cache()
            child = spawn_child(kind, self.server.address if kind == "grpc"
                                else self.lane_address, cache_id)
            self.children.append(child)
            self.assertTrue(child.stdout.readline().strip().isdigit())
        started = time.time()
        code = self.server.stop()  # SIGTERM; --shutdown_grace=5s
        self.assertEqual(code, 0)
        self.assertLess(time.time() - started, 30)
        self.server = it.Kvcached()  # for tearDown's
        self.channel.close()
        self.channel = it.grpc.insecure_channel(self.server.address)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvcached", required=True)
    parser.add_argument("--proto_dir", required=True)
    parser.add_argument("--protoc", default="protoc")
    parser.add_argument("--grpc_python_plugin", default="/usr/bin/grpc_python_plugin")
    parser.add_argument("--child", default="")
    parser.add_argument("--address", default="")
    parser.add_argument("--cache_id", default="")
    parser.add_argument("--stubs", default="")
    args, rest = parser.parse_known_args()
    it.ARGS = args
    global STUBS
    if args.child:
        sys.path.insert(0, args.stubs)
        import grpc as grpc_module
        from kvcache.v1 import kvcache_pb2, kvcache_pb2_grpc
        it.grpc, it.pb, it.pb_grpc = grpc_module, kvcache_pb2, kvcache_pb2_grpc
        run_child(args.child, args.address, args.cache_id)
        return
    with tempfile.TemporaryDirectory(prefix="kvcache_py_") as out_dir:
        it.generate_stubs(out_dir)
        STUBS = out_dir
        program = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
    sys.exit(0 if program.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
