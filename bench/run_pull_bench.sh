#!/usr/bin/env bash
# Two kvcached replicas on this machine, the second listing the first in its
# --peers, and bench/service/pull_bench.cc between them: PullSnapshot
# (replica to replica) beside the copy a client streams through itself, and
# memcpy of the same bytes.
#
#   bash bench/run_pull_bench.sh                 # a 64 MiB snapshot, 5 rounds
#   MIB=16 ROUNDS=3 bash bench/run_pull_bench.sh
#
# Without KVCACHED / PULL_BENCH it builds Release into build-bench/.
set -euo pipefail
cd "$(dirname "$0")/.."

MIB=${MIB:-64}
ROUNDS=${ROUNDS:-5}
if [[ -z ${KVCACHED:-} || -z ${PULL_BENCH:-} ]]; then
  bash .ci/setup --bench >&2
  cmake -S . -B build-bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCACHED_BUILD_TESTS=OFF >&2
  cmake --build build-bench --parallel "$(nproc)" --target kvcached pull_bench >&2
  KVCACHED=build-bench/server/kvcached
  PULL_BENCH=build-bench/bench/service/pull_bench
fi
# shellcheck source=bench/lib/server.sh
source bench/lib/server.sh
work=$(mktemp -d)
cleanup() { rm -rf "$work"; }
on_exit cleanup

# start NAME [FLAGS...]: a replica on a free port; sets `started` to its address.
start() {
  local name=$1
  shift
  start_kvcached "$work/$name.log" "$KVCACHED" --listen=127.0.0.1:0 --data_lane_listen="" \
    --replica_name="$name" --pool_bytes=$(((MIB * 4 + 64) << 20)) --shutdown_grace=1s "$@" ||
    { echo "$name did not start" >&2; exit 1; }
  started=$kvcached_address
}
start owner
owner=$started
start puller --peers="owner=$owner"
puller=$started
echo "machine: $(nproc) cores, $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -n 1)"
"$PULL_BENCH" --owner="$owner" --puller="$puller" --mib="$MIB" --rounds="$ROUNDS"
