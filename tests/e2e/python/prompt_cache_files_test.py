#!/usr/bin/python3
"""Prompt-cache files: kvcached reads and writes mlx-lm's save_prompt_cache layout.

numpy writes one file per mlx-lm cache class the way mlx-lm and mlx write it
(safetensors by hand: an 8-byte little-endian header length, the JSON header
with keys sorted and "__metadata__", tensor data in a shuffled order as mlx's
hash map leaves it, no padding). kvcached, started on a free loopback port with
the Vulkan validation layer and a --data_dir holding those files, loads each
one (LoadSnapshot, or ImportSnapshot streaming its bytes) and the test checks:

  - the spec it derives (layer kinds and sizes, dtype, batch, left padding,
    model) and that no checksum was verified (mlx-lm files carry none);
  - every layer fetched from the snapshot against what the numpy model says
    the layer holds, position by position (rotating rings back in temporal
    order, quantized layers packed as stored, recurrent layers' state);
  - SaveSnapshot of it: the file it writes has the fixture's tensor keys,
    dtypes, shapes and tensor bytes and its metadata, plus a 32-hex-digit
    "1.kvcached_checksum"; ExportSnapshot by name and by snapshot_id give
    those bytes; loaded back, its checksum is verified;
  - damaged files (truncated; a tensor that disagrees with its metadata) are
    refused with DATA_LOSS / INVALID_ARGUMENT and leave no snapshot or file.

Whole-file bytes are not compared with the fixtures: mlx's tensor order is
not defined. The fixtures are generated here, never stored.

  /usr/bin/python3 prompt_cache_files_test.py --kvcached build/server/kvcached \\
      --proto_dir protos --protoc /usr/bin/protoc \\
      --grpc_python_plugin /usr/bin/grpc_python_plugin
"""

import argparse
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import unittest

import numpy as np

ARGS = None
pb = None  # kvcache.v1.kvcache_pb2, once generated
pb_grpc = None
grpc = None
DATA_DIR = None  # the server's --data_dir

HEADS, DIM = 2, 8  # attention layers: float16 [B, 2, L, 8]
MODEL = "mlx-community/Tiny-Test-4bit"
TOKENIZER_CONFIG = json.dumps({"add_bos_token": True, "eos_token": "</s>"})

# safetensors dtype names (mlx/io/safetensors.cpp) <-> numpy.
DTYPES = {"F16": np.float16, "F32": np.float32, "U32": np.uint32, "I32": np.int32,
          "I64": np.int64, "U8": np.uint8}
DTYPE_NAMES = {np.dtype(v).str: k for k, v in DTYPES.items()}


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


# --- safetensors, as mlx writes it ---------------------------------------------------------


def encode_safetensors(tensors, metadata, seed=0):
    """The bytes mx.save_safetensors writes: u64 LE header length, the header as
    nlohmann::json::dump() (keys sorted, no spaces, no padding), then the tensor
    data in std::unordered_map order (here: shuffled), offsets in the header."""
    names = sorted(tensors)
    random.Random(seed).shuffle(names)
    header, blobs, offset = {}, [], 0
    for name in names:
        array = np.ascontiguousarray(tensors[name])
        assert array.size > 0, "mlx refuses empty arrays: " + name
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": DTYPE_NAMES[array.dtype.newbyteorder("<").str],
                        "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = dict(metadata)
    text = json.dumps(header, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode("utf-8")
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def write_safetensors(path, tensors, metadata, seed=0):
    with open(path, "wb") as f:
        f.write(encode_safetensors(tensors, metadata, seed))


class Parsed:
    """A safetensors file read back: {name: (dtype, shape, bytes)} and metadata."""

    def __init__(self, data):
        if len(data) < 8:
            raise AssertionError("shorter than a header length")
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length].decode("utf-8"))
        self.metadata = header.pop("__metadata__", None)
        body = data[8 + length:]
        self.tensors = {}
        spans = []
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            self.tensors[name] = (entry["dtype"], list(entry["shape"]), body[begin:end])
            spans.append((begin, end, name))
            size = int(np.prod(entry["shape"])) * np.dtype(DTYPES[entry["dtype"]]).itemsize
            if end - begin != size:
                raise AssertionError("%s: %d bytes for shape %s %s" % (
                    name, end - begin, entry["shape"], entry["dtype"]))
        # The tensors tile the data section exactly.
        position = 0
        for begin, end, name in sorted(spans):
            if begin != position:
                raise AssertionError("%s starts at %d, expected %d" % (name, begin, position))
            position = end
        if position != len(body):
            raise AssertionError("data section holds %d bytes, tensors %d" % (len(body), position))

    def array(self, name):
        dtype, shape, data = self.tensors[name]
        return np.frombuffer(data, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<")).reshape(shape)


def read_safetensors(path):
    with open(path, "rb") as f:
        return Parsed(f.read())


# --- mlx-lm caches as numpy models -----------------------------------------------------------
#
# Each fixture is (tensors, metadata, layers): the file's tensors and metadata in
# save_prompt_cache's layout, and per layer what kvcached should make of it: the
# spec kind and sizes, and what Fetch should return.


class Layer:
    def __init__(self, kind, heads=HEADS, dim=DIM, vdim=None, **kind_fields):
        self.kind = kind  # "standard", "rotating", "quantized", "chunked", "recurrent"
        self.heads, self.dim, self.vdim = heads, dim, vdim or dim
        self.kind_fields = kind_fields
        self.positions = []  # attention: absolute positions in temporal order
        self.keys = self.values = None  # [B, H, len(positions), D] in temporal order
        self.packed = None  # quantized: ((wq, scales, biases) keys, (...) values)
        self.state = None  # recurrent: (conv, delta)
        self.state_start = None  # recurrent: the chunk's start (the layer's offset)


class Fixture:
    def __init__(self, name, batch=1, left_padding=(), offset=0):
        self.name, self.batch, self.left_padding, self.offset = name, batch, list(left_padding), offset
        self.tensors = {}
        self.metadata = {"1.model": MODEL, "1.tokenizer_config": TOKENIZER_CONFIG}
        self.layers = []

    def add(self, mlx_class, layer, tensors, meta):
        """Layer i: its state tensors "<i>.<k>", meta_state "0.<i>[.<k>]", class "2.<i>"."""
        i = len(self.layers)
        for key, array in tensors.items():
            self.tensors["%d.%s" % (i, key)] = array
        if isinstance(meta, str):
            self.metadata["0.%d" % i] = meta
        else:
            for k, value in enumerate(meta):
                self.metadata["0.%d.%d" % (i, k)] = str(value)
        self.metadata["2.%d" % i] = mlx_class
        self.layers.append(layer)

    def encode(self, seed=0):
        return encode_safetensors(self.tensors, self.metadata, seed)


def rand16(rng, *shape):
    return rng.standard_normal(shape).astype(np.float16)


def kv_cache(fx, rng, length, batch=1):
    """mlx-lm KVCache: keys, values sliced to offset; meta_state ""."""
    keys, values = rand16(rng, batch, HEADS, length, DIM), rand16(rng, batch, HEADS, length, DIM)
    layer = Layer("standard")
    layer.positions, layer.keys, layer.values = list(range(length)), keys, values
    fx.add("KVCache", layer, {"0": keys, "1": values}, "")


def rotating_cache(fx, rng, keep, max_size, offset, idx, held=None):
    """mlx-lm RotatingKVCache: the raw ring buffer (sliced to offset while
    offset < its length), meta (keep, max_size, offset, _idx).
    After single-token steps it holds min(offset, max_size) tokens; wrapped,
    the buffer is sinks | newest | oldest: temporal = [:keep] + [_idx:] + [keep:_idx].
    After a multi-token step (_update_concat) it is in temporal order with
    _idx = held, and may hold more than max_size: the whole first prompt, or
    the sinks and the newest max_size - 1 - keep + S tokens."""
    held = min(offset, max_size) if held is None else held
    ring_k, ring_v = rand16(rng, 1, HEADS, held, DIM), rand16(rng, 1, HEADS, held, DIM)
    layer = Layer("rotating", max_size=max_size, keep=keep)
    if idx == held:  # temporal order
        order = list(range(held))
        layer.positions = (list(range(offset)) if held == offset else
                           list(range(keep)) + list(range(offset - (held - keep), offset)))
    else:
        assert held == max_size and keep < idx <= max_size
        order = list(range(keep)) + list(range(idx, max_size)) + list(range(keep, idx))
        layer.positions = list(range(keep)) + list(range(offset - (max_size - keep), offset))
    layer.keys, layer.values = ring_k[:, :, order], ring_v[:, :, order]
    fx.add("RotatingKVCache", layer, {"0": ring_k, "1": ring_v}, (keep, max_size, offset, idx))


def quantize(rng, batch, length, dim, group_size, bits):
    """Random (wq uint32 [B,H,L,D*bits/32], scales, biases float16 [B,H,L,D/group])
    as mx.quantize lays them out: values packed little-end first."""
    per_word = 32 // bits
    q = rng.integers(0, 1 << bits, size=(batch, HEADS, length, dim), dtype=np.uint64)
    q = q.reshape(batch, HEADS, length, dim // per_word, per_word)
    shifts = (np.arange(per_word, dtype=np.uint64) * bits)
    wq = (q << shifts).sum(axis=-1).astype(np.uint32)
    scales = (rng.random((batch, HEADS, length, dim // group_size)) * 0.05).astype(np.float16)
    biases = rand16(rng, batch, HEADS, length, dim // group_size)
    return wq, scales, biases


def dequantize(wq, scales, biases, group_size, bits):
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)
    q = (wq[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(*wq.shape[:-1], wq.shape[-1] * per_word).astype(np.float32)
    groups = q.reshape(*q.shape[:-1], -1, group_size)
    w = groups * scales.astype(np.float32)[..., None] + biases.astype(np.float32)[..., None]
    return w.reshape(q.shape)


def quantized_cache(fx, rng, length, dim, group_size, bits):
    """mlx-lm QuantizedKVCache: "<i>.0.{0,1,2}" keys (wq, scales, biases),
    "<i>.1.*" values; meta (offset, group_size, bits)."""
    keys, values = (quantize(rng, 1, length, dim, group_size, bits),
                    quantize(rng, 1, length, dim, group_size, bits))
    layer = Layer("quantized", dim=dim, group_size=group_size, bits=bits)
    layer.positions, layer.packed = list(range(length)), (keys, values)
    tensors = {"0.%d" % j: keys[j] for j in range(3)}
    tensors.update({"1.%d" % j: values[j] for j in range(3)})
    fx.add("QuantizedKVCache", layer, tensors, (length, group_size, bits))


def chunked_cache(fx, rng, chunk_size, start, offset):
    """mlx-lm ChunkedKVCache: `state` slices its buffer (which starts at
    start_position) by offset, so the file holds `offset` rows: the held tokens
    [start, offset) then start rows of zeros (the buffer's unused tail). Loaded,
    offset = rows and the held tokens are rows [0, rows - start)."""
    held = offset - start
    keys, values = rand16(rng, 1, HEADS, held, DIM), rand16(rng, 1, HEADS, held, DIM)
    zeros = np.zeros((1, HEADS, start, DIM), np.float16)
    layer = Layer("chunked", chunk_size=chunk_size)
    layer.positions, layer.keys, layer.values = list(range(start, offset)), keys, values
    fx.add("ChunkedKVCache", layer,
           {"0": np.concatenate([keys, zeros], axis=2), "1": np.concatenate([values, zeros], axis=2)},
           (chunk_size, start))


def arrays_cache(fx, rng, conv_tail, conv_dim, hv, dv, dk, offset):
    """mlx-lm ArraysCache of a gated-delta layer: [conv [B, conv_tail, conv_dim],
    ssm state [B, Hv, Dv, Dk]]; meta_state ""."""
    conv, delta = rand16(rng, 1, conv_tail, conv_dim), rand16(rng, 1, hv, dv, dk)
    layer = Layer("recurrent", conv_tail=conv_tail, conv_dim=conv_dim, num_v_heads=hv,
                  head_v_dim=dv, head_k_dim=dk)
    layer.state, layer.state_start = (conv, delta), offset
    fx.add("ArraysCache", layer, {"0": conv, "1": delta}, "")


def batch_kv_cache(fx, rng, length, padding):
    """mlx-lm BatchKVCache: keys, values [B,H,_idx,D] (padding positions hold
    what the model computed for pad tokens), offset [B] = _idx - left_padding,
    left_padding [B], both int32 (mx.array of Python ints); meta_state ""."""
    batch = len(padding)
    keys, values = rand16(rng, batch, HEADS, length, DIM), rand16(rng, batch, HEADS, length, DIM)
    layer = Layer("standard")
    layer.positions, layer.keys, layer.values = list(range(length)), keys, values
    fx.add("BatchKVCache", layer, {
        "0": keys, "1": values,
        "2": np.array([length - p for p in padding], np.int32),
        "3": np.array(padding, np.int32)}, "")


def batch_rotating_cache(fx, rng, max_size, offset, idx, padding):
    """mlx-lm BatchRotatingKVCache (keep 0) after single-token steps: the ring
    (sliced to _offset while under max_size), offset [B] = _offset - padding,
    left_padding [B] = padding less every evicted token (mlx decrements it once
    rotated), meta (max_size, _offset, _idx, rotated). Rotated, temporal order
    is roll(-_idx): [_idx:] + [:_idx]."""
    batch = len(padding)
    held = min(offset, max_size)
    rotated = offset > max_size
    ring_k = rand16(rng, batch, HEADS, held, DIM)
    ring_v = rand16(rng, batch, HEADS, held, DIM)
    layer = Layer("rotating", max_size=max_size, keep=0)
    if rotated:
        assert 0 < idx <= max_size
        order = list(range(idx, max_size)) + list(range(idx))
    else:
        assert idx == offset
        order = list(range(held))
    layer.positions = list(range(offset - held, offset))
    layer.keys, layer.values = ring_k[:, :, order], ring_v[:, :, order]
    evicted = offset - held
    fx.add("BatchRotatingKVCache", layer, {
        "0": ring_k, "1": ring_v,
        "2": np.array([offset - p for p in padding], np.int32),
        "3": np.array([p - evicted for p in padding], np.int32)},
        (max_size, offset, idx, "True" if rotated else "False"))


def make_fixtures():
    """name -> Fixture, one or more per mlx-lm class."""
    rng = np.random.default_rng(20241125)
    fixtures = {}

    def new(name, **kwargs):
        fixtures[name] = Fixture(name, **kwargs)
        return fixtures[name]

    fx = new("mlx-kv", offset=7)  # KVCache x2
    kv_cache(fx, rng, 7)
    kv_cache(fx, rng, 7)

    fx = new("mlx-rotating-sliced", offset=9)  # gemma-like: full + sliding, window not full
    kv_cache(fx, rng, 9)
    rotating_cache(fx, rng, keep=4, max_size=16, offset=9, idx=9)

    fx = new("mlx-rotating-wrapped", offset=21)  # keep 4, window wrapped, _idx mid-ring
    kv_cache(fx, rng, 21)
    rotating_cache(fx, rng, keep=4, max_size=12, offset=21, idx=7)
    rotating_cache(fx, rng, keep=4, max_size=12, offset=21, idx=7)

    # After prompt processing in steps (_update_concat): more than max_size held.
    fx = new("mlx-rotating-prefill", offset=20)  # one 20-token step: the whole prompt
    kv_cache(fx, rng, 20)
    rotating_cache(fx, rng, keep=4, max_size=12, offset=20, idx=20, held=20)
    fx = new("mlx-rotating-concat", offset=30)  # a 5-token step past the window: 11 + 5
    kv_cache(fx, rng, 30)
    rotating_cache(fx, rng, keep=4, max_size=12, offset=30, idx=16, held=16)

    fx = new("mlx-quantized", offset=5)  # group 32: bits 8 and bits 4
    quantized_cache(fx, rng, 5, 64, 32, 8)
    quantized_cache(fx, rng, 5, 64, 32, 4)

    fx = new("mlx-chunked", offset=12)  # llama4-like: full + chunked, front trimmed
    kv_cache(fx, rng, 12)
    chunked_cache(fx, rng, chunk_size=8, start=5, offset=12)

    fx = new("mlx-recurrent", offset=6)  # qwen3-next-like: 2 gated-delta + 1 attention
    arrays_cache(fx, rng, 3, 16, 2, 8, 4, offset=6)
    arrays_cache(fx, rng, 3, 16, 2, 8, 4, offset=6)
    kv_cache(fx, rng, 6)

    fx = new("mlx-recurrent-only", offset=1)  # no attention layer: offset 1 (mlx_state.h)
    arrays_cache(fx, rng, 3, 16, 2, 8, 4, offset=1)

    fx = new("mlx-batch", batch=2, left_padding=[0, 3], offset=7)  # BatchKVCache x2
    batch_kv_cache(fx, rng, 7, [0, 3])
    batch_kv_cache(fx, rng, 7, [0, 3])

    fx = new("mlx-batch-rotating", batch=2, left_padding=[0, 2], offset=6)  # not rotated
    batch_rotating_cache(fx, rng, max_size=8, offset=6, idx=6, padding=[0, 2])
    batch_rotating_cache(fx, rng, max_size=8, offset=6, idx=6, padding=[0, 2])

    # Rotated: row 1's padding (5) outlives 3 evicted tokens, row 0's goes negative.
    fx = new("mlx-batch-rotated", batch=2, left_padding=[0, 5], offset=11)
    batch_kv_cache(fx, rng, 11, [0, 5])
    batch_rotating_cache(fx, rng, max_size=8, offset=11, idx=3, padding=[0, 5])
    return fixtures


# Loaded from the data dir at start (LoadSnapshot) or streamed (ImportSnapshot).
IMPORTED = {"mlx-quantized", "mlx-batch-rotated"}


def damaged_fixtures():
    """name -> (bytes, expected status, words its message should contain)."""
    fixtures = make_fixtures()
    kv = fixtures["mlx-kv"].encode()
    out = {"bad-truncated": (kv[:-10], "DATA_LOSS", "truncated"),
           "bad-truncated-header": (kv[:40], "DATA_LOSS", "truncated")}

    quantized = fixtures["mlx-quantized"]
    quantized.metadata["0.1.0"] = "6"  # offset 6, but the tensors hold 5 tokens
    out["bad-quantized-offset"] = (quantized.encode(), "INVALID_ARGUMENT", "0.1.0")

    rotating = fixtures["mlx-rotating-wrapped"]
    rotating.metadata["0.1.2"] = "20"  # offset 20 with the other layers at 21
    out["bad-rotating-offset"] = (rotating.encode(), "INVALID_ARGUMENT", "offset")

    batch = fixtures["mlx-batch"]
    batch.tensors["1.2"] = np.array([7, 5], np.int32)  # offset[1] != _idx - left_padding[1]
    out["bad-batch-offset"] = (batch.encode(), "INVALID_ARGUMENT", "1.2")

    chunked = fixtures["mlx-chunked"]
    chunked.tensors["1.1"] = chunked.tensors["1.1"][:, :, :11]  # values shorter than keys
    out["bad-chunked-shape"] = (chunked.encode(), "INVALID_ARGUMENT", "1.1")
    return out


# --- the server -----------------------------------------------------------------------------


class Kvcached:
    """The kvcached binary on 127.0.0.1:<free port>, its log collected."""

    def __init__(self, data_dir):
        self.log = []
        self.address = None
        self._listening = threading.Event()
        self.process = subprocess.Popen(
            [ARGS.kvcached, "--listen=127.0.0.1:0", "--data_lane_listen=127.0.0.1:0",
             "--validation", "--pool_bytes=67108864",
             "--page_bytes=8192", "--page_tokens=16", "--shutdown_grace=5s",
             "--data_dir=" + data_dir],
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

    def stop(self):
        """SIGTERM, then the exit code."""
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self._reader.join(timeout=10)
        return code


def kind_of(layer_spec):
    return layer_spec.WhichOneof("kind")


class PromptCacheFilesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.fixtures = make_fixtures()
        cls.damaged = damaged_fixtures()
        for name, fx in cls.fixtures.items():
            if name not in IMPORTED:
                write_safetensors(os.path.join(DATA_DIR, name + ".safetensors"),
                                  fx.tensors, fx.metadata, seed=len(name))
        for name in ("bad-truncated", "bad-quantized-offset"):
            with open(os.path.join(DATA_DIR, name + ".safetensors"), "wb") as f:
                f.write(cls.damaged[name][0])
        cls.server = Kvcached(DATA_DIR)
        options = [("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.max_send_message_length", 64 << 20)]
        cls.channel = grpc.insecure_channel(cls.server.address, options=options)
        grpc.channel_ready_future(cls.channel).result(timeout=30)
        cls.stub = pb_grpc.KvCacheServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        code = cls.server.stop()
        log = "".join(cls.server.log)
        if code != 0:
            raise AssertionError("kvcached exited with %d after SIGTERM:\n%s" % (code, log))
        if "vulkan validation" in log.lower():
            raise AssertionError("Vulkan validation messages:\n" + log)

    # --- helpers ---

    def import_bytes(self, data, name="", piece=1000):
        """ImportSnapshot: the bytes in pieces, the first message with the name."""
        def requests():
            first = True
            for begin in range(0, max(len(data), 1), piece):
                request = pb.ImportSnapshotRequest(data=data[begin:begin + piece])
                if first:
                    request.name, first = name, False
                yield request
        return self.stub.ImportSnapshot(requests())

    def load(self, fx):
        if fx.name in IMPORTED:
            return self.import_bytes(fx.encode(seed=7), name=fx.name)
        return self.stub.LoadSnapshot(pb.LoadSnapshotRequest(name=fx.name))

    def export(self, **kwargs):
        return b"".join(chunk.data for chunk in
                        self.stub.ExportSnapshot(pb.ExportSnapshotRequest(**kwargs)))

    def release(self, snapshot_id):
        self.stub.ReleaseSnapshot(pb.ReleaseSnapshotRequest(snapshot_id=snapshot_id))

    def snapshot_ids(self):
        return {s.snapshot_id for s in
                self.stub.ListSnapshots(pb.ListSnapshotsRequest()).snapshots}

    def saved_names(self):
        return {f.name for f in self.stub.ListSaved(pb.ListSavedRequest()).files}

    def check_spec(self, fx, response):
        spec = response.spec
        self.assertEqual(spec.model, MODEL)
        self.assertEqual(spec.dtype, pb.DTYPE_FLOAT16)
        self.assertEqual(spec.batch_size or 1, fx.batch)
        self.assertEqual(list(spec.left_padding), fx.left_padding)
        self.assertEqual(len(spec.layers), len(fx.layers))
        for i, (got, want) in enumerate(zip(spec.layers, fx.layers)):
            where = "%s layer %d" % (fx.name, i)
            self.assertEqual(kind_of(got), want.kind, where)
            fields = getattr(got, want.kind)
            for field, value in want.kind_fields.items():
                self.assertEqual(getattr(fields, field), value, "%s %s" % (where, field))
            if want.kind != "recurrent":
                self.assertEqual(got.num_kv_heads, want.heads, where)
                self.assertEqual(got.k_head_dim, want.dim, where)
                self.assertEqual(got.v_head_dim or got.k_head_dim, want.vdim, where)
        self.assertEqual(dict(response.metadata),
                         {"model": MODEL, "tokenizer_config": TOKENIZER_CONFIG})
        self.assertFalse(response.checksum_verified, "%s: mlx-lm files carry no checksum" % fx.name)
        self.assertEqual((response.snapshot.from_offset, response.snapshot.to_offset),
                         (0, fx.offset))

    def fetch_layer(self, snapshot_id, index, packed=False):
        request = pb.FetchRequest(snapshot_id=snapshot_id, layers=[index], packed=packed,
                                  max_chunk_tokens=3)
        chunks = list(self.stub.Fetch(request))
        for chunk in chunks:
            self.assertEqual(chunk.layer, index)
        return chunks

    @staticmethod
    def tensor_array(tensor, dtype=np.float16):
        return np.frombuffer(tensor.data, dtype=dtype).reshape(list(tensor.shape))

    def check_layer(self, fx, snapshot_id, index):
        layer = fx.layers[index]
        where = "%s layer %d" % (fx.name, index)
        if layer.kind == "recurrent":
            chunks = self.fetch_layer(snapshot_id, index)
            self.assertEqual(len(chunks), 1, where)
            chunk = chunks[0]
            self.assertEqual(chunk.start, layer.state_start, where + " state start")
            self.assertFalse(chunk.HasField("keys"), where)
            for got, want, what in ((chunk.state.conv_state, layer.state[0], "conv"),
                                    (chunk.state.delta_state, layer.state[1], "delta")):
                self.assertEqual(got.dtype, pb.DTYPE_FLOAT16, "%s %s" % (where, what))
                self.assertEqual(list(got.shape), list(want.shape), "%s %s" % (where, what))
                self.assertEqual(got.data, want.tobytes(), "%s %s bytes" % (where, what))
            return
        if layer.kind == "quantized":
            chunks = self.fetch_layer(snapshot_id, index, packed=True)
            positions = []
            parts = [[[] for _ in range(3)] for _ in range(2)]
            for chunk in chunks:
                self.assertFalse(chunk.HasField("keys"), where)
                tokens = chunk.packed_keys.wq.shape[2]
                positions += list(range(chunk.start, chunk.start + tokens))
                for side, packed in enumerate((chunk.packed_keys, chunk.packed_values)):
                    self.assertEqual((packed.group_size, packed.bits),
                                     (layer.kind_fields["group_size"], layer.kind_fields["bits"]))
                    parts[side][0].append(self.tensor_array(packed.wq, np.uint32))
                    parts[side][1].append(self.tensor_array(packed.scales))
                    parts[side][2].append(self.tensor_array(packed.biases))
            self.assertEqual(positions, layer.positions, where)
            for side in range(2):
                for j, what in enumerate(("wq", "scales", "biases")):
                    got = np.concatenate(parts[side][j], axis=2)
                    want = layer.packed[side][j]
                    self.assertEqual(got.shape, want.shape, "%s side %d %s" % (where, side, what))
                    self.assertEqual(got.tobytes(), want.tobytes(),
                                     "%s side %d %s bytes" % (where, side, what))
            # Dequantized (w = scale * q + bias per group), within float16 rounding.
            chunks = self.fetch_layer(snapshot_id, index)
            for side, name in enumerate(("keys", "values")):
                got = np.concatenate([self.tensor_array(getattr(c, name)) for c in chunks], axis=2)
                want = dequantize(*layer.packed[side], layer.kind_fields["group_size"],
                                  layer.kind_fields["bits"])
                np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-3, atol=2e-3,
                                           err_msg="%s dequantized %s" % (where, name))
            return
        chunks = self.fetch_layer(snapshot_id, index)
        positions, keys, values = [], [], []
        for chunk in chunks:
            tokens = chunk.keys.shape[2]
            self.assertLessEqual(tokens, 3, where)
            self.assertEqual(chunk.keys.dtype, pb.DTYPE_FLOAT16, where)
            positions += list(range(chunk.start, chunk.start + tokens))
            keys.append(self.tensor_array(chunk.keys))
            values.append(self.tensor_array(chunk.values))
        self.assertEqual(positions, layer.positions, where + " positions")
        keys, values = np.concatenate(keys, axis=2), np.concatenate(values, axis=2)
        self.assertEqual(keys.shape, layer.keys.shape, where)
        self.assertEqual(keys.tobytes(), layer.keys.tobytes(), where + " keys")
        self.assertEqual(values.tobytes(), layer.values.tobytes(), where + " values")

    def assert_same_file(self, fx, parsed, what):
        """Same tensors (keys, dtypes, shapes, bytes) and metadata as the fixture,
        plus kvcached's checksum."""
        want = Parsed(fx.encode())
        self.assertEqual(sorted(parsed.tensors), sorted(want.tensors), what + ": tensor keys")
        for key in sorted(want.tensors):
            got_t, want_t = parsed.tensors[key], want.tensors[key]
            self.assertEqual(got_t[0], want_t[0], "%s: tensor %s dtype" % (what, key))
            self.assertEqual(got_t[1], want_t[1], "%s: tensor %s shape" % (what, key))
            self.assertEqual(got_t[2], want_t[2], "%s: tensor %s bytes" % (what, key))
        self.assertIsNotNone(parsed.metadata, what + ": __metadata__")
        metadata = dict(parsed.metadata)
        checksum = metadata.pop("1.kvcached_checksum", None)
        self.assertRegex(checksum or "", r"^xxh3-128/4MiB:[0-9a-f]{32}$", what + ": 1.kvcached_checksum")
        self.assertEqual(metadata, fx.metadata, what + ": metadata")

    # --- tests ---

    def round_trip(self, fx):
        response = self.load(fx)
        snapshot_id = response.snapshot.snapshot_id
        try:
            self.check_spec(fx, response)
            for index in range(len(fx.layers)):
                self.check_layer(fx, snapshot_id, index)

            saved_name = fx.name + "-saved"
            saved = self.stub.SaveSnapshot(pb.SaveSnapshotRequest(
                snapshot_id=snapshot_id, name=saved_name, metadata=dict(response.metadata)))
            self.assertEqual(saved.name, saved_name)
            path = os.path.join(DATA_DIR, saved_name + ".safetensors")
            with open(path, "rb") as f:
                on_disk = f.read()
            self.assertEqual(saved.size_bytes, len(on_disk))
            self.assert_same_file(fx, Parsed(on_disk), fx.name + " saved")
            self.assertIn(saved_name, self.saved_names())

            self.assertEqual(self.export(name=saved_name), on_disk, fx.name + " export by name")
            by_id = self.export(snapshot_id=snapshot_id, metadata=dict(response.metadata))
            self.assert_same_file(fx, Parsed(by_id), fx.name + " export by snapshot_id")

            # kvcached's own file: its checksum is verified, and it holds the same.
            again = self.stub.LoadSnapshot(pb.LoadSnapshotRequest(name=saved_name))
            try:
                self.assertTrue(again.checksum_verified, saved_name)
                self.assertEqual(again.spec, response.spec)
                for index in range(len(fx.layers)):
                    self.check_layer(fx, again.snapshot.snapshot_id, index)
            finally:
                self.release(again.snapshot.snapshot_id)
            self.stub.DeleteSaved(pb.DeleteSavedRequest(name=saved_name))
            self.assertFalse(os.path.exists(path))
        finally:
            self.release(snapshot_id)

    def test_kv_cache(self):
        self.round_trip(self.fixtures["mlx-kv"])

    def test_rotating_kv_cache_sliced(self):
        self.round_trip(self.fixtures["mlx-rotating-sliced"])

    def test_rotating_kv_cache_wrapped(self):
        fx = self.fixtures["mlx-rotating-wrapped"]
        self.assertEqual(fx.layers[1].positions, [0, 1, 2, 3] + list(range(13, 21)))
        self.round_trip(fx)

    def test_rotating_kv_cache_after_multi_token_steps(self):
        fx = self.fixtures["mlx-rotating-concat"]
        self.assertEqual(fx.layers[1].positions, [0, 1, 2, 3] + list(range(18, 30)))
        self.round_trip(self.fixtures["mlx-rotating-prefill"])
        self.round_trip(fx)

    def test_quantized_kv_cache_imported(self):
        fx = self.fixtures["mlx-quantized"]
        self.assertNotIn(fx.name, self.saved_names())
        self.round_trip(fx)
        # Imported with a name: saved as sent.
        with open(os.path.join(DATA_DIR, fx.name + ".safetensors"), "rb") as f:
            self.assertEqual(f.read(), fx.encode(seed=7))
        self.assertIn(fx.name, self.saved_names())

    def test_chunked_kv_cache(self):
        self.round_trip(self.fixtures["mlx-chunked"])

    def test_arrays_cache_beside_attention(self):
        self.round_trip(self.fixtures["mlx-recurrent"])

    def test_arrays_cache_only(self):
        self.round_trip(self.fixtures["mlx-recurrent-only"])

    def test_batch_kv_cache(self):
        self.round_trip(self.fixtures["mlx-batch"])

    def test_batch_rotating_kv_cache(self):
        self.round_trip(self.fixtures["mlx-batch-rotating"])

    def test_batch_rotating_kv_cache_rotated_imported(self):
        self.round_trip(self.fixtures["mlx-batch-rotated"])

    def test_import_without_name(self):
        fx = self.fixtures["mlx-kv"]
        before = self.saved_names()
        response = self.import_bytes(fx.encode(seed=3), piece=100)
        try:
            self.check_spec(fx, response)
            for index in range(len(fx.layers)):
                self.check_layer(fx, response.snapshot.snapshot_id, index)
        finally:
            self.release(response.snapshot.snapshot_id)
        self.assertEqual(self.saved_names(), before)

    def test_damaged_files_refused(self):
        snapshots, files = self.snapshot_ids(), self.saved_names()
        for name in ("bad-truncated", "bad-quantized-offset"):  # in the data dir at start
            data, code, words = self.damaged[name]
            with self.assertRaises(grpc.RpcError, msg=name) as refused:
                self.stub.LoadSnapshot(pb.LoadSnapshotRequest(name=name))
            self.assertEqual(refused.exception.code().name, code,
                             "%s: %s" % (name, refused.exception.details()))
            self.assertIn(words, refused.exception.details(), name)
        for name, (data, code, words) in sorted(self.damaged.items()):  # streamed in
            with self.assertRaises(grpc.RpcError, msg=name) as refused:
                self.import_bytes(data, name=name + "-imported")
            self.assertEqual(refused.exception.code().name, code,
                             "%s: %s" % (name, refused.exception.details()))
            self.assertIn(words, refused.exception.details(), name)
        self.assertEqual(self.snapshot_ids(), snapshots)
        self.assertEqual(self.saved_names(), files)
        leftovers = [f for f in os.listdir(DATA_DIR) if "-imported" in f or f.startswith(".tmp-")]
        self.assertEqual(leftovers, [])


def main():
    global ARGS, DATA_DIR
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvcached", required=True)
    parser.add_argument("--proto_dir", required=True)
    parser.add_argument("--protoc", default="protoc")
    parser.add_argument("--grpc_python_plugin", default="/usr/bin/grpc_python_plugin")
    ARGS, rest = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="kvcache_py_") as out_dir, \
            tempfile.TemporaryDirectory(prefix="kvcache_files_") as data_dir:
        DATA_DIR = data_dir
        generate_stubs(out_dir)
        program = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
    sys.exit(0 if program.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
