#!/usr/bin/env bash
# Load: kvcached with four tenants (a tokens file) and CLIENTS clients of
# theirs at once, half on the data lane, OPS mixed operations each with every
# fetched byte checked (bench/service/load_bench.cc), bounded by LOAD_SECONDS seconds.
# Prints latencies per operation, failures and corruptions (must be 0), the
# pages left in use (must be 0), and the server's peak resident memory beside
# its budgets. Exit status 1 on any of those failing.
#
#   bash bench/run_load_bench.sh                   # 64 clients x 10,000 ops
#   CLIENTS=16 OPS=300 bash bench/run_load_bench.sh
#   KVCACHED=build/server/kvcached LOAD_BENCH=build/bench/service/load_bench \
#       bash bench/run_load_bench.sh               # prebuilt (as ctest runs it)
#
# Without KVCACHED / LOAD_BENCH it builds Release into build-bench/.
set -euo pipefail
cd "$(dirname "$0")/.."

CLIENTS=${CLIENTS:-64}
OPS=${OPS:-10000}
SECONDS_BOUND=${LOAD_SECONDS:-900}
POOL_BYTES=${POOL_BYTES:-$((512 << 20))}
if [[ -z ${KVCACHED:-} || -z ${LOAD_BENCH:-} ]]; then
  bash .ci/setup --bench >&2
  cmake -S . -B build-bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCACHED_BUILD_TESTS=OFF >&2
  cmake --build build-bench --parallel "$(nproc)" --target kvcached load_bench >&2
  KVCACHED=build-bench/server/kvcached
  LOAD_BENCH=build-bench/bench/service/load_bench
fi
# shellcheck source=bench/lib/server.sh
source bench/lib/server.sh
work=$(mktemp -d)
# shellcheck disable=SC2317  # run at exit
cleanup() { rm -rf "$work"; }
on_exit cleanup

tokens=()
for tenant in alpha beta gamma delta; do
  token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
  tokens+=("$token")
  echo "tenant=$tenant token=$token" >>"$work/tokens"
done
admin=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
echo "tenant=ops token=$admin admin" >>"$work/tokens"

start_kvcached "$work/kvcached.log" "$KVCACHED" --listen=127.0.0.1:0 \
  --data_lane_listen=127.0.0.1:0 --pool_bytes="$POOL_BYTES" --tokens_file="$work/tokens" \
  --shutdown_grace=5s || exit 1
server=$kvcached_pid
address=$kvcached_address

status=0
"$LOAD_BENCH" --address="$address" --clients="$CLIENTS" --ops="$OPS" --seconds="$SECONDS_BOUND" \
  --tokens="$(IFS=,; echo "${tokens[*]}")" --admin_token="$admin" || status=$?

peak_kib=$(awk '/^VmHWM:/ {print $2}' "/proc/$server/status")
echo
echo "- server peak resident memory: $((peak_kib >> 10)) MiB; --pool_bytes $((POOL_BYTES >> 20)) MiB" \
  "(on lavapipe the device pool is host memory)"
echo "- $(grep -m1 'Vulkan device 0' "$work/kvcached.log" | sed 's/.*\] //')"
echo "- $(nproc) cores, $(date -u '+%Y-%m-%d %H:%M UTC')"
if ! stop_kvcached "$server"; then
  echo "kvcached did not exit 0 after SIGTERM" >&2
  status=1
fi
if grep -qi "vulkan validation" "$work/kvcached.log"; then
  grep -i "vulkan validation" "$work/kvcached.log" >&2
  status=1
fi
exit "$status"
