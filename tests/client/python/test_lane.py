"""The data lane's client side against a scripted server on loopback: the
preamble, AUTH, Update and Fetch calls frame by frame as kvcache.proto says."""

import socket
import struct
import threading

import grpc
import numpy as np
import pytest

from kvcached import frames
from kvcached.errors import KvCacheError
from kvcached.fetch import FetchAssembler
from kvcached.lane import (LanePool, LaneUpdateStream, lane_fetch, message_chunks, placing_chunks,
                           reachable)
from kvcached.options import ClientOptions
from kvcached.proto import pb
from kvcached.update_encoding import LayerUpdate


class Peer:
    """The server's end of one connection, read and written by the script."""

    def __init__(self, sock):
        self.sock = sock

    def read_exact(self, size):
        data = b""
        while len(data) < size:
            more = self.sock.recv(size - len(data))
            if not more:
                raise EOFError
            data += more
        return data

    def read_frame(self):
        length, kind, reserved = struct.unpack("<IB3s", self.read_exact(8))
        assert reserved == b"\0\0\0"
        return kind, self.read_exact(length)

    def send_frame(self, kind, message=None):
        payload = message.SerializeToString() if message is not None else b""
        self.sock.sendall(struct.pack("<IB3x", len(payload), kind) + payload)

    def send_status(self, code=0, message=""):
        self.send_frame(frames.FrameKind.STATUS, pb.LaneStatus(code=code, message=message))

    def answer_preamble(self):
        assert self.read_exact(8) == b"KVLANE02"
        self.sock.sendall(b"KVLANE02")


class ScriptedServer:
    """Accepts connections on 127.0.0.1 and runs `script(peer)` on each, in turn."""

    def __init__(self, script):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.script = script
        self.connections = 0
        self.errors = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            try:
                self.script(Peer(sock))
            except (EOFError, ConnectionError):
                pass
            except AssertionError as error:  # reported by stop()
                self.errors.append(error)
            finally:
                sock.close()

    def stop(self, *pools):
        """Ends the clients' kept connections, then the server; raises what its scripts found."""
        for pool in pools:
            pool.close()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes a waiting accept
        except OSError:
            pass
        self.listener.close()
        self.thread.join(timeout=5)
        assert not self.thread.is_alive(), "the scripted server is stuck"
        assert not self.errors, self.errors


def pool_for(server, **options):
    return LanePool(ClientOptions(data_lane=server.address, deadline=5, keepalive_time=0,
                                  **options), ask_server=lambda: "")


def kv(tokens, value):
    array = np.full((1, 2, tokens, 4), value, dtype=np.float16)
    return array, array + 1


def test_the_preamble_is_answered_in_kind():
    server = ScriptedServer(lambda peer: (peer.answer_preamble(), peer.read_exact(1)))
    pool = pool_for(server)
    assert pool.enabled()
    pool.take().close()
    server.stop(pool)


def test_a_server_that_closes_unanswered_is_unavailable():
    server = ScriptedServer(lambda peer: peer.read_exact(8))
    with pytest.raises(KvCacheError) as refused:
        pool_for(server).take()
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert "KVLANE02" in refused.value.message
    server.stop()


def test_a_refusal_in_place_of_the_answer_is_its_status():
    def refuse(peer):
        peer.read_exact(8)
        peer.send_status(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "max_lane_connections")
    server = ScriptedServer(refuse)
    with pytest.raises(KvCacheError) as refused:
        pool_for(server).take()
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    server.stop()


def authenticating(expected_token):
    def script(peer):
        peer.answer_preamble()
        kind, payload = peer.read_frame()
        assert kind == frames.FrameKind.AUTH
        if pb.LaneAuth.FromString(payload).token != expected_token:
            peer.send_status(grpc.StatusCode.UNAUTHENTICATED.value[0], "bad token")
            return
        peer.send_status()
        peer.read_exact(1)  # until the client goes
    return script


def test_the_auth_frame_carries_the_token():
    server = ScriptedServer(authenticating("s3cret"))
    pool_for(server, token="s3cret").take().close()
    with pytest.raises(KvCacheError) as refused:
        pool_for(server, token="wrong").take()
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    server.stop()


def serve_updates(fail_at=None, seen=None):
    """Acks each UPDATE (offset = tokens so far), or refuses number `fail_at`."""
    def script(peer):
        peer.answer_preamble()
        while True:  # calls, one after another
            offset, failed, index = 0, False, 0
            while True:
                kind, payload = peer.read_frame()
                if kind == frames.FrameKind.UPDATE_END:
                    break
                assert kind == frames.FrameKind.UPDATE
                request = pb.UpdateRequest.FromString(payload)
                if seen is not None:
                    seen.append(request)
                if failed:
                    continue  # the rest of a failed call is skipped
                if index == fail_at:
                    peer.send_status(grpc.StatusCode.INVALID_ARGUMENT.value[0], "layer: 9")
                    failed = True
                    continue
                offset += request.keys.shape[2]
                peer.send_frame(frames.FrameKind.UPDATE_ACK,
                                pb.UpdateResponse(layer=request.layer, offset=offset))
                index += 1
            if not failed:
                peer.send_status()
    return script


def test_updates_are_acknowledged_in_order_and_the_connection_kept():
    seen = []
    server = ScriptedServer(serve_updates(seen=seen))
    pool = pool_for(server)
    stream = LaneUpdateStream(pool, "cache")
    arrays = [kv(tokens, tokens) for tokens in (3, 1, 2)] * 4  # past an ack poll
    for step, (keys, values) in enumerate(arrays):
        stream.write(LayerUpdate(layer=step % 3, keys=keys, values=values))
    acks = stream.finish()
    assert [ack.offset for ack in acks] == list(np.cumsum([k.shape[2] for k, _ in arrays]))
    assert [request.keys.data for request in seen] == [k.tobytes() for k, _ in arrays]
    assert all(request.cache_id == "cache" for request in seen)
    second = LaneUpdateStream(pool, "cache")  # on the kept connection
    second.write(LayerUpdate(layer=0, keys=arrays[0][0], values=arrays[0][1]))
    assert len(second.finish()) == 1
    assert server.connections == 1
    server.stop(pool)


def test_a_refused_update_ends_the_call_with_its_status():
    server = ScriptedServer(serve_updates(fail_at=1))
    pool = pool_for(server)
    stream = LaneUpdateStream(pool, "cache")
    keys, values = kv(2, 1)
    with pytest.raises(KvCacheError) as refused:
        for _ in range(3):
            stream.write(LayerUpdate(layer=0, keys=keys, values=values))
        stream.finish()
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.message == "layer: 9"
    assert [ack.offset for ack in stream.acknowledged] == [2]
    # UPDATE_END went out, so the connection serves the next call.
    again = LaneUpdateStream(pool, "cache")
    again.write(LayerUpdate(layer=0, keys=keys, values=values))
    assert [ack.offset for ack in again.finish()] == [2]
    assert server.connections == 1
    server.stop(pool)


def serve_fetch(keys, values, pieces, announce=True, announce_extra=0, close_first=False):
    """Answers FETCH with the history cut into `pieces` (start, length)."""
    state = {"connections": 0}

    def script(peer):
        peer.answer_preamble()
        state["connections"] += 1
        if close_first and state["connections"] == 1:
            peer.sock.close()
            return
        while True:
            kind, payload = peer.read_frame()
            assert kind == frames.FrameKind.FETCH
            request = pb.FetchRequest.FromString(payload)
            chunks, at = [], 0
            for start, length in pieces:
                chunk = pb.FetchResponse(layer=request.layers[0], start=start)
                for tensor, source in ((chunk.keys, keys), (chunk.values, values)):
                    piece = np.ascontiguousarray(source[:, :, at:at + length])
                    tensor.CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT16, shape=piece.shape,
                                              data=piece.tobytes()))
                chunks.append(chunk.SerializeToString())
                at += length
            if announce:
                total = sum(8 + len(c) for c in chunks) + announce_extra
                peer.send_frame(frames.FrameKind.FETCH_LENGTH,
                                pb.LaneFetchLength(chunk_frame_bytes=total))
            for chunk in chunks:
                peer.sock.sendall(frames.encode_header(len(chunk), frames.FrameKind.FETCH_CHUNK)
                                  + chunk)
            peer.send_status()
    return script


def history(tokens):
    rng = np.random.default_rng(tokens)
    return (rng.standard_normal((1, 3, tokens, 8)).astype(np.float16),
            rng.standard_normal((1, 3, tokens, 8)).astype(np.float16))


@pytest.mark.parametrize("announce", [True, False])
def test_fetched_chunks_land_in_the_callers_arrays(announce):
    keys, values = history(700)  # several reads per chunk
    server = ScriptedServer(serve_fetch(keys, values, [(0, 300), (300, 400)], announce))
    pool = pool_for(server)
    out = (np.zeros((1, 3, 700, 8), np.float16), np.zeros((1, 3, 700, 8), np.float16))
    assembler = FetchAssembler({4: out})
    lane_fetch(pool, pb.FetchRequest(cache_id="c", layers=[4]), placing_chunks(assembler))
    got = assembler.results()[4]
    assert got.ranges == [(0, 700)]
    assert out[0].tobytes() == keys.tobytes() and out[1].tobytes() == values.tobytes()
    lane_fetch(pool, pb.FetchRequest(cache_id="c", layers=[4]), placing_chunks(FetchAssembler()))
    assert server.connections == 1
    server.stop(pool)


def test_chunks_past_the_announced_length_are_data_loss():
    keys, values = history(10)
    server = ScriptedServer(serve_fetch(keys, values, [(0, 5), (5, 5)], announce_extra=-1))
    with pytest.raises(KvCacheError) as lost:
        lane_fetch(pool_for(server), pb.FetchRequest(cache_id="c", layers=[0]),
                   placing_chunks(FetchAssembler()))
    assert lost.value.code == grpc.StatusCode.DATA_LOSS
    server.stop()


def test_a_kept_connection_closed_since_is_replaced_once():
    keys, values = history(4)
    server = ScriptedServer(serve_fetch(keys, values, [(0, 4)], close_first=True))
    pool = pool_for(server)
    lane = pool.take()
    pool.give(lane)  # kept, then closed by the server before the call
    assembler = FetchAssembler()
    lane_fetch(pool, pb.FetchRequest(cache_id="c", layers=[0]), placing_chunks(assembler))
    assert assembler.results()[0].keys.tobytes() == keys.tobytes()
    assert server.connections == 2
    server.stop(pool)


@pytest.mark.parametrize("advertised, grpc_address, expected", [
    ("0.0.0.0:7001", "10.1.2.3:50051", "10.1.2.3:7001"),
    ("[::]:7001", "[fd00::1]:50051", "[fd00::1]:7001"),
    ("10.9.9.9:7001", "10.1.2.3:50051", "10.9.9.9:7001"),
])
def test_wildcard_lane_hosts_mean_the_servers_own(advertised, grpc_address, expected):
    assert reachable(advertised, grpc_address) == expected


def test_a_refusal_seen_while_writing_raises_from_write():
    server = ScriptedServer(serve_updates(fail_at=0))
    pool = pool_for(server)
    stream = LaneUpdateStream(pool, "cache")
    keys, values = kv(1, 1)
    written = 0
    with pytest.raises(KvCacheError) as refused:
        for _ in range(200):
            stream.write(LayerUpdate(layer=0, keys=keys, values=values))
            written += 1
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert written < 200 and stream.acknowledged == []
    server.stop(pool)


def test_whole_messages_for_states_and_packed_chunks():
    state = pb.FetchResponse(layer=1, start=9, state=pb.RecurrentState(
        conv_state=pb.Tensor(dtype=1, shape=[1, 2, 2], data=bytes(16)), advance=0))

    def script(peer):
        peer.answer_preamble()
        kind, _ = peer.read_frame()
        assert kind == frames.FrameKind.FETCH
        peer.send_frame(frames.FrameKind.FETCH_CHUNK, state)
        peer.send_status()
        peer.read_exact(1)

    server = ScriptedServer(script)
    pool = pool_for(server)
    got = []
    lane_fetch(pool, pb.FetchRequest(cache_id="c", layers=[1]), message_chunks(got.append))
    assert got == [state]
    server.stop(pool)


def test_a_state_chunk_where_tokens_were_expected_is_invalid_argument():
    def script(peer):
        peer.answer_preamble()
        peer.read_frame()
        peer.send_frame(frames.FrameKind.FETCH_CHUNK,
                        pb.FetchResponse(layer=1, state=pb.RecurrentState(advance=2)))
        peer.send_status()
        peer.read_exact(1)

    server = ScriptedServer(script)
    pool = pool_for(server)
    with pytest.raises(KvCacheError) as refused:
        lane_fetch(pool, pb.FetchRequest(cache_id="c", layers=[1]),
                   placing_chunks(FetchAssembler()))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    server.stop(pool)


class RecordingSocket:
    """A socket proxy that keeps what each sendmsg was given."""

    def __init__(self, sock):
        self._sock = sock
        self.sent_buffers = []

    def sendmsg(self, buffers):
        self.sent_buffers += list(buffers)
        return self._sock.sendmsg(buffers)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_tensors_are_sent_from_their_own_memory():
    server = ScriptedServer(serve_updates())
    pool = pool_for(server)
    stream = LaneUpdateStream(pool, "cache")
    recording = stream._lane.sock = RecordingSocket(stream._lane.sock)
    keys, values = kv(64, 3)
    stream.write(LayerUpdate(layer=0, keys=keys, values=values))
    assert stream.finish()[0].offset == 64
    shared = [view for view in recording.sent_buffers
              if np.shares_memory(np.frombuffer(view, np.uint8), keys)
              or np.shares_memory(np.frombuffer(view, np.uint8), values)]
    assert sum(len(view) for view in shared) == keys.nbytes + values.nbytes
    server.stop(pool)


def test_fetched_bytes_come_straight_from_the_socket():
    keys, values = history(4000)  # 4 chunks of 1000 tokens, 48 KB per tensor each
    server = ScriptedServer(serve_fetch(keys, values, [(i * 1000, 1000) for i in range(4)]))
    pool = pool_for(server)
    lane = pool.take()
    pool.give(lane)
    out = (np.empty_like(keys), np.empty_like(values))
    lane_fetch(pool, pb.FetchRequest(cache_id="c", layers=[0]),
               placing_chunks(FetchAssembler({0: out})))
    assert out[0].tobytes() == keys.tobytes() and out[1].tobytes() == values.tobytes()
    # At most a read-ahead's worth per chunk passed through the buffer.
    assert lane.bulk_bytes_buffered <= 4 * 2 * 256
    server.stop(pool)


def test_a_stream_refused_while_writing_gives_its_connection_back():
    server = ScriptedServer(serve_updates(fail_at=0))
    pool = pool_for(server)
    stream = LaneUpdateStream(pool, "cache")
    keys, values = kv(1, 1)
    with pytest.raises(KvCacheError):
        for _ in range(200):
            stream.write(LayerUpdate(layer=0, keys=keys, values=values))
    stream.cancel()  # what a caller's clean-up does: the pool's connection stays open
    again = LaneUpdateStream(pool, "cache")
    with pytest.raises(KvCacheError):
        again.write(LayerUpdate(layer=0, keys=keys, values=values))
        again.finish()
    assert server.connections == 1
    server.stop(pool)
