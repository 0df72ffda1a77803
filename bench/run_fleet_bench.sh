#!/usr/bin/env bash
# A fleet on this machine: the load benchmark's clients (bench/service/
# load_bench.cc: mixed Update / Fetch / Snapshot / Restore / Release /
# replace, every fetched byte checked) against 1, 2 and 3 kvcached replicas
# through kvcache::ShardedClient, and against one replica with a plain
# Client (the sharding client's own cost is the difference between "direct"
# and "fleet of 1"). Each configuration runs ROUNDS times, alternating, so
# the machine's noise falls on all alike. Prints one table row per run.
# With ETCD=1 a fleet of 3 that lists itself in an etcd (Debian's
# etcd-server, on loopback) runs too, its clients finding it through etcd.
#
#   bash bench/run_fleet_bench.sh                      # 16 clients x 3,000 ops
#   CLIENTS=8 OPS=1000 ROUNDS=1 bash bench/run_fleet_bench.sh
#
# Without KVCACHED / LOAD_BENCH it builds Release into build-bench/.
set -euo pipefail
cd "$(dirname "$0")/.."

CLIENTS=${CLIENTS:-16}
OPS=${OPS:-3000}
ROUNDS=${ROUNDS:-2}
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
etcd_pid=""
# After the replicas (on_exit): they take themselves off etcd's list.
# shellcheck disable=SC2317  # run at exit
cleanup() {
  [[ -z $etcd_pid ]] || kill "$etcd_pid" 2>/dev/null || true
  rm -rf "$work"
}
on_exit cleanup

# start_fleet N: N replicas r0.. on free ports; sets `peers` (name=address,...).
start_fleet() {
  peers=""
  local i
  for ((i = 0; i < $1; i++)); do
    # shellcheck disable=SC2086  # etcd_flag: no flag or one
    start_kvcached "$work/r$i.log" "$KVCACHED" --listen=127.0.0.1:0 --data_lane_listen=127.0.0.1:0 \
      --replica_name="r$i" --pool_bytes="$POOL_BYTES" --shutdown_grace=1s ${etcd_flag:-} ||
      { echo "r$i did not start" >&2; exit 1; }
    peers+="${peers:+,}r$i=$kvcached_address"
  done
}

# run CONFIG ARGS...: one load run; prints its row.
run() {
  local config=$1 out
  shift
  out=$("$LOAD_BENCH" --clients="$CLIENTS" --ops="$OPS" --seconds=300 "$@")
  local ops_line bytes_line
  ops_line=$(grep "operations in" <<<"$out")
  bytes_line=$(grep "K/V bytes" <<<"$out")
  # "16 clients, 48000 operations in 12.3 s (3902 / s); failed 0, corrupted 0; pages in use after: 0"
  local rate failed corrupted pages update_p50 update_p99 fetch_p50 fetch_p99
  rate=$(sed -n 's/.*(\([0-9]*\) \/ s).*/\1/p' <<<"$ops_line")
  failed=$(sed -n 's/.*failed \([0-9]*\).*/\1/p' <<<"$ops_line")
  corrupted=$(sed -n 's/.*corrupted \([0-9]*\).*/\1/p' <<<"$ops_line")
  pages=$(sed -n 's/.*pages in use after: \(-*[0-9]*\).*/\1/p' <<<"$ops_line")
  read -r update_p50 update_p99 < <(awk -F'|' '$2 ~ /^ Update / {print $4, $5}' <<<"$out")
  read -r fetch_p50 fetch_p99 < <(awk -F'|' '$2 ~ /^ Fetch / {print $4, $5}' <<<"$out")
  printf '| %s | %s | %s | %s / %s | %s / %s | %s / %s / %s |\n' "$config" "$rate" \
    "$(sed -n 's/K\/V bytes: \(.*\)/\1/p' <<<"$bytes_line")" "$update_p50" "$update_p99" \
    "$fetch_p50" "$fetch_p99" "$failed" "$corrupted" "$pages"
  [[ $failed == 0 && $corrupted == 0 && $pages == 0 ]]
}

echo "kvcached fleet on $(nproc) cores, $CLIENTS clients x $OPS ops, $(date -u +%H:%M) UTC"
echo "| config | ops / s | K/V bytes | Update p50 / p99 ms | Fetch p50 / p99 ms | failed / corrupted / pages left |"
echo "|---|---:|---|---:|---:|---:|"
status=0
for ((round = 1; round <= ROUNDS; round++)); do
  start_fleet 1
  run "direct (1 replica, Client)" --address="${peers#r0=}" || status=1
  run "fleet of 1" --peers="$peers" || status=1
  stop_all_kvcached || true
  for n in 2 3; do
    start_fleet "$n"
    run "fleet of $n" --peers="$peers" || status=1
    stop_all_kvcached || true
  done
  if [[ ${ETCD:-0} == 1 ]]; then
    etcd_address=127.0.0.1:23790
    etcd --name=bench --data-dir="$work/etcd" --listen-client-urls="http://$etcd_address" \
      --advertise-client-urls="http://$etcd_address" --listen-peer-urls=http://127.0.0.1:23800 \
      --initial-advertise-peer-urls=http://127.0.0.1:23800 \
      --initial-cluster=bench=http://127.0.0.1:23800 2>"$work/etcd.log" &
    etcd_pid=$!
    etcd_flag=--etcd_endpoints=$etcd_address
    start_fleet 3
    for _ in $(seq 100); do grep -q "etcd: listed" "$work/r2.log" && break; sleep 0.1; done
    run "fleet of 3 (etcd)" --etcd_endpoints="$etcd_address" || status=1
    etcd_flag=""
    stop_all_kvcached || true  # the replicas first: they take themselves off etcd's list
    kill "$etcd_pid" && wait "$etcd_pid" || true
    etcd_pid=""
    rm -rf "$work/etcd"
  fi
done
exit $status
