#!/usr/bin/env bash
# Prefix sharing over loopback: LookupPrefix p50 / p99 with 1M tokens in 10k
# published prefixes beside the RPC's floor (a lookup in a layout with
# nothing published), and the time to a usable cache for a worker whose
# 16k-token, 32-layer prompt is cached (LookupPrefix + CreateCache + Restore)
# beside streaming the same K/V into a new cache with Update over the data
# lane. One run on this machine; prefix_bench.cc says what each row times.
#
#   bash bench/run_prefix_bench.sh                 # builds Release into build-bench/
#   BUILD_DIR=build bash bench/run_prefix_bench.sh # an existing build's binaries
#   ARGS="--ttft_layers=8" bash bench/run_prefix_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build-bench}
ARGS=${ARGS:-}
work=$(mktemp -d)
server=""
cleanup() {
  if [[ -n $server ]]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

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

port=$(free_port 50251)
lane_port=$(free_port $((port + 1)))
# 3 GiB: the 16k x 32-layer prompt (1 GiB) cached, and a second copy streamed in.
"$BUILD_DIR/server/kvcached" --listen="127.0.0.1:$port" --data_lane_listen="127.0.0.1:$lane_port" \
  --pool_bytes=$((3 << 30)) --max_message_bytes=$((256 << 20)) >"$work/kvcached.log" 2>&1 &
server=$!
for _ in $(seq 300); do grep -q "listening on" "$work/kvcached.log" && break; sleep 0.1; done
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
  "kernel $(uname -r)"
# shellcheck disable=SC2086
"$BUILD_DIR/bench/service/prefix_bench" --address="127.0.0.1:$port" $ARGS
