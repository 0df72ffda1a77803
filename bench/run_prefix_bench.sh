#!/usr/bin/env bash
# Prefix sharing over loopback: LookupPrefix p50 / p99 with 1M tokens in 10k
# published prefixes beside the RPC's floor (a lookup in a layout with
# nothing published), and the time to a usable cache for a worker whose
# 16k-token, 32-layer prompt is cached (LookupPrefix + CreateCache + Restore)
# beside streaming the same K/V into a new cache with Update over the data
# lane. One run on this machine; prefix_bench.cc says what each row times.
# KV_EVENTS=1: the lookup rows twice, a server without KV events and one
# publishing them (--kv_events_endpoint) to a subscriber that reads every
# batch (pyzmq), so publishing's cost shows beside its absence.
#
#   bash bench/run_prefix_bench.sh                 # builds Release into build-bench/
#   BUILD_DIR=build bash bench/run_prefix_bench.sh # an existing build's binaries
#   ARGS="--ttft_layers=8" bash bench/run_prefix_bench.sh
#   KV_EVENTS=1 ARGS="--ops=lookup" bash bench/run_prefix_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build-bench}
ARGS=${ARGS:-}
# shellcheck source=bench/lib/server.sh
source bench/lib/server.sh
work=$(mktemp -d)
subscriber=""
stop() {
  if [[ -n $1 ]]; then kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; fi
}
cleanup() {
  stop "$subscriber"
  rm -rf "$work"
}
on_exit cleanup

free_port() {
  local port=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((port + 1)); done
  echo "$port"
}

if [[ $BUILD_DIR == build-bench ]]; then
  bash .ci/setup >&2
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCACHED_BUILD_TESTS=OFF >&2
fi
cmake --build "$BUILD_DIR" --parallel "$(nproc)" --target kvcached prefix_bench >&2

# A fresh kvcached with the given extra flags; its gRPC port in $port.
start_server() {
  port=$(free_port 50251)
  local lane_port
  lane_port=$(free_port $((port + 1)))
  # 3 GiB: the 16k x 32-layer prompt (1 GiB) cached, and a second copy streamed in.
  start_kvcached "$work/kvcached.log" "$BUILD_DIR/server/kvcached" --listen="127.0.0.1:$port" \
    --data_lane_listen="127.0.0.1:$lane_port" --pool_bytes=$((3 << 30)) \
    --max_message_bytes=$((256 << 20)) "$@" || exit 1
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
  "kernel $(uname -r)"
start_server
# shellcheck disable=SC2086
"$BUILD_DIR/bench/service/prefix_bench" --address="127.0.0.1:$port" $ARGS
[[ ${KV_EVENTS:-0} == 1 ]] || exit 0

stop_all_kvcached || true
events_port=$(free_port 5557)
start_server --kv_events_endpoint="tcp://127.0.0.1:$events_port"
# A router's subscription: reads every batch until stopped, then counts them.
/usr/bin/python3 -c '
import signal, sys, msgpack, zmq
sub = zmq.Context().socket(zmq.SUB)
sub.connect(sys.argv[1]); sub.setsockopt(zmq.SUBSCRIBE, b"")
batches = events = blocks = 0
def report(*_):
    print("kv events: a subscriber read %d batches, %d events, %d blocks" % (batches, events, blocks))
    sys.exit(0)
signal.signal(signal.SIGTERM, report)
while True:
    _, _, payload = sub.recv_multipart()
    batch = msgpack.unpackb(payload)
    batches += 1; events += len(batch[1])
    blocks += sum(len(e.get("block_hashes", ())) for e in batch[1])
' "tcp://127.0.0.1:$events_port" &
subscriber=$!
sleep 0.5
echo "== the same, publishing KV events to a subscriber =="
# shellcheck disable=SC2086
"$BUILD_DIR/bench/service/prefix_bench" --address="127.0.0.1:$port" $ARGS
sleep 0.5
stop "$subscriber"
subscriber=""
