#!/usr/bin/env bash
# Service over loopback: kvcached Update / Fetch throughput, over
# the data lane and over gRPC, beside Redis SET / GET of the same bytes
# (hiredis, pipelined like kvcached's streams) and the TCP ceiling (iperf3,
# one stream), plus Snapshot / Restore latency against context length, all in
# one run on this machine.
#
#   bash bench/run_service_bench.sh            # prints the markdown tables
#   REPEATS=5 ROW_SECONDS=3 bash bench/run_service_bench.sh
#   bash bench/run_service_bench.sh --report   # the tables of the last run again
#   KVCACHED=/other/kvcached UPDATE_PATH=proto bash bench/run_service_bench.sh
#       # another server build, and Updates sent through the generated stub
#   BEFORE=/other/tree/build-bench bash bench/run_service_bench.sh
#       # a before/after run: that build's server and client (built there
#       # first, e.g. by this script in that tree) run every kvcached row
#       # too, alternating with this build's within each round, so both
#       # see the same load; adds a before / after table
#   SERVER_FLAGS=--default_ttl=10m BEFORE=... bash bench/run_service_bench.sh
#       # this build's kvcached with more flags (BEFORE's gets none)
#   BOTH_FLAGS=--force_staging BEFORE=... bash bench/run_service_bench.sh
#       # flags for both builds' servers (every transfer through the staging
#       # rings, as on a discrete GPU)
#
# Installs the peers (.ci/setup --bench), builds Release into build-bench/,
# starts kvcached, redis-server and iperf3 on free loopback ports, and stops
# them on exit. Each row runs REPEATS times, kvcached and Redis alternating so
# both see the same background load; the tables give medians. Raw rows go to
# build-bench/service_bench_raw.txt. About 5 minutes after the build.
set -euo pipefail
cd "$(dirname "$0")/.."

REPEATS=${REPEATS:-3}
ROW_SECONDS=${ROW_SECONDS:-2}
STREAMS=${STREAMS:-"1 4"}
CHUNKS=${CHUNKS:-"65536 262144 1048576"}
BUILD_DIR=${BUILD_DIR:-build-bench}
KVCACHED=${KVCACHED:-$BUILD_DIR/server/kvcached}
UPDATE_PATH=${UPDATE_PATH:-shared}
BEFORE=${BEFORE:-}
# More flags for this tree's kvcached only (e.g. --default_ttl=10m, so that
# every call renews a lease), not for BEFORE's.
SERVER_FLAGS=${SERVER_FLAGS:-}
BOTH_FLAGS=${BOTH_FLAGS:-}
# shellcheck source=bench/lib/server.sh
source bench/lib/server.sh
work=$(mktemp -d)
raw="$BUILD_DIR/service_bench_raw.txt"
pids=()  # the peers other than kvcached

cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
on_exit cleanup
log() { echo "bench: $*" >&2; }

# The first port from $1 on that nothing on 127.0.0.1 answers.
free_port() {
  local port=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((port + 1)); done
  echo "$port"
}

# Waits until `$@` succeeds (up to 30 s).
wait_for() {
  for _ in $(seq 300); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  log "gave up waiting for: $*"; return 1
}

median() { sort -g | awk '{v[NR] = $1} END {print NR ? v[int((NR + 1) / 2)] : 0}'; }

build() {
  bash .ci/setup --bench >&2
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCACHED_BUILD_TESTS=OFF >&2
  cmake --build "$BUILD_DIR" --parallel "$(nproc)" --target kvcached service_bench redis_bench >&2
}

start_peers() {
  kv_port=$(free_port 50151)
  lane_port=$(free_port $((kv_port + 1)))
  # shellcheck disable=SC2086  # the flag variables hold several flags
  start_kvcached "$work/kvcached.log" "$KVCACHED" --listen="127.0.0.1:$kv_port" \
    --data_lane_listen="127.0.0.1:$lane_port" --pool_bytes=$((6 << 30)) \
    --max_message_bytes=$((256 << 20)) $SERVER_FLAGS $BOTH_FLAGS || exit 1
  if [[ -n $BEFORE ]]; then
    for binary in server/kvcached bench/service/service_bench; do
      if [[ ! -x $BEFORE/$binary ]]; then
        log "BEFORE=$BEFORE has no $binary (build it there first)"
        exit 2
      fi
    done
    before_port=$(free_port $((lane_port + 1)))
    before_lane_port=$(free_port $((before_port + 1)))
    # shellcheck disable=SC2086
    start_kvcached "$work/before.log" "$BEFORE/server/kvcached" --listen="127.0.0.1:$before_port" \
      --data_lane_listen="127.0.0.1:$before_lane_port" --pool_bytes=$((6 << 30)) \
      --max_message_bytes=$((256 << 20)) $BOTH_FLAGS || exit 1
    log "before: kvcached of $BEFORE on $before_port"
  fi
  redis_port=$(free_port 6390)
  redis-server --bind 127.0.0.1 --port "$redis_port" --save "" --appendonly no \
    --daemonize no --logfile "$work/redis.log" &
  pids+=($!)
  wait_for redis-cli -p "$redis_port" ping
  log "kvcached on $kv_port, redis-server on $redis_port"
}

# iperf3's one-stream loopback throughput in GB/s (-1: the server serves one
# test). Pinned to two different cores: unpinned, the scheduler often puts
# both ends on one core and the "ceiling" halves (5-7 instead of 11-14 GB/s
# here), which would flatter everything measured against it.
iperf3_once() {
  local port pin_server=() pin_client=()
  port=$(free_port 5301)
  if (($(nproc) >= 2)); then pin_server=(-A 1) pin_client=(-A 0); fi
  iperf3 -s -1 -B 127.0.0.1 -p "$port" "${pin_server[@]}" >/dev/null 2>&1 &
  pids+=($!)
  sleep 0.5
  iperf3 -c 127.0.0.1 -p "$port" -t 5 "${pin_client[@]}" -J |
    awk '/"sum_received"/ {found = 1} found && /"bits_per_second"/ {
           gsub(/[^0-9.e+]/, "", $2); printf "%.3f\n", $2 / 8e9; exit }'
}

# The before build's row (run_rows' variables), its system renamed.
run_before() {
  "$BEFORE/bench/service/service_bench" --address="127.0.0.1:$before_port" \
    --ops="$kv_op" --streams="$streams" --chunks="$chunk" \
    --update_path="$UPDATE_PATH" --data_lane="$lane" "${common[@]}" |
    sed 's/^ROW kvcached/ROW before-kvcached/' >>"$raw"
}

run_rows() {
  local kv="$BUILD_DIR/bench/service/service_bench" redis="$BUILD_DIR/bench/service/redis_bench"
  local common=(--seconds="$ROW_SECONDS" --warmup=0.5)
  : >"$raw"
  for rep in $(seq "$REPEATS"); do
    log "round $rep of $REPEATS"
    for pair in "update set" "fetch get"; do
      read -r kv_op redis_op <<<"$pair"
      for streams in $STREAMS; do
        for chunk in $CHUNKS; do
          for lane in auto ""; do
            # The before build goes first in even rounds, second in odd
            # ones, so an order effect does not always land on one side.
            if [[ -n $BEFORE ]] && ((rep % 2 == 0)); then run_before; fi
            "$kv" --address="127.0.0.1:$kv_port" --ops="$kv_op" --streams="$streams" \
              --chunks="$chunk" --update_path="$UPDATE_PATH" --data_lane="$lane" \
              "${common[@]}" >>"$raw"
            if [[ -n $BEFORE ]] && ((rep % 2 == 1)); then run_before; fi
          done
          "$redis" --port="$redis_port" --ops="$redis_op" --connections="$streams" \
            --chunks="$chunk" "${common[@]}" >>"$raw"
        done
      done
    done
    echo "IPERF3 $(iperf3_once)" >>"$raw"
  done
  log "latency"
  "$kv" --address="127.0.0.1:$kv_port" --ops=latency >>"$raw"
}

print_machine() {
  echo "- CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
  echo "- kernel $(uname -r), $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- device: $(sed -n 's/.*device: \(.*\)/\1/p' "$work/kvcached.log" | head -1)"
  echo "- flags of both servers: ${BOTH_FLAGS:-none}; of this build's: ${SERVER_FLAGS:-none}"
  echo "- load average before / after: $load_before / $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "- $REPEATS rounds of ${ROW_SECONDS} s per row (after 0.5 s warm-up); medians"
  echo "- server $KVCACHED; lane rows: ClientOptions::data_lane = auto; gRPC rows: Update sent with --update_path=$UPDATE_PATH"
  if [[ -n $BEFORE ]]; then
    echo "- before: server and client of $BEFORE, alternating with this build's within each round"
  fi
}

# The rates of one system's rows (op, streams, chunk) over the rounds.
rates() {
  awk -v n="$1" -v o="$2" -v s="$3" -v c="$4" \
    '$1 == "ROW" && $2 == n && $3 == o && $4 == s && $5 == c {print $6}' "$raw"
}
spread() { sort -g | sed -n '1p;$p' | paste -sd-; }

# One line per row: label streams chunk lane-median grpc-median redis-median
# lane-min..max grpc-min..max redis-min..max
summarise_rows() {
  for pair in "update set Update/SET" "fetch get Fetch/GET"; do
    read -r kv_op redis_op label <<<"$pair"
    for streams in $STREAMS; do
      for chunk in $CHUNKS; do
        local lane grpc redis
        lane=$(rates kvcached-lane "$kv_op" "$streams" "$chunk")
        grpc=$(rates kvcached "$kv_op" "$streams" "$chunk")
        redis=$(rates redis "$redis_op" "$streams" "$chunk")
        echo "$label $streams $chunk $(median <<<"$lane") $(median <<<"$grpc") $(median <<<"$redis")" \
          "$(spread <<<"$lane") $(spread <<<"$grpc") $(spread <<<"$redis")"
      done
    done
  done
}

# One line per row: label streams chunk, then for lane and gRPC: before and
# after medians, and their spreads.
summarise_before_after() {
  for pair in "update Update" "fetch Fetch"; do
    read -r kv_op label <<<"$pair"
    for streams in $STREAMS; do
      for chunk in $CHUNKS; do
        local line="$label $streams $chunk" spreads=""
        for system in kvcached-lane kvcached; do
          local before after
          before=$(rates "before-$system" "$kv_op" "$streams" "$chunk")
          after=$(rates "$system" "$kv_op" "$streams" "$chunk")
          line+=" $(median <<<"$before") $(median <<<"$after")"
          spreads+=" $(spread <<<"$before") $(spread <<<"$after")"
        done
        echo "$line$spreads"
      done
    done
  done
}

print_before_after() {
  echo -n "| op | streams | chunk | lane before | lane after | after / before "
  echo "| gRPC before | gRPC after | after / before | lane spreads (before; after) | gRPC spreads (before; after) |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
  awk '{
    lane = $4 > 0 ? $5 / $4 : 0; grpc = $6 > 0 ? $7 / $6 : 0
    printf "| %s | %d | %d KiB | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %s; %s | %s; %s |\n",
      $1, $2, $3 / 1024, $4, $5, lane, $6, $7, grpc, $8, $9, $10, $11
  }' "$work/before_after"
}

print_throughput() {
  local ceiling=$1
  echo "| op | streams | chunk | lane GB/s | gRPC GB/s | Redis GB/s | lane / Redis | gRPC / Redis | iperf3 GB/s | lane / iperf3 | gRPC / iperf3 |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  awk -v t="$ceiling" '{
    lane_ratio = $6 > 0 ? $4 / $6 : 0; grpc_ratio = $6 > 0 ? $5 / $6 : 0
    tcp = ""; lane_tcp = ""; grpc_tcp = ""
    if ($2 == 1 && $3 == 1048576 && t > 0) {
      tcp = t; lane_tcp = sprintf("%.2f", $4 / t); grpc_tcp = sprintf("%.2f", $5 / t)
    }
    printf "| %s | %d | %d KiB | %.2f | %.2f | %.2f | %.2f | %.2f | %s | %s | %s |\n", $1, $2, $3 / 1024,
      $4, $5, $6, lane_ratio, grpc_ratio, tcp, lane_tcp, grpc_tcp
  }' "$work/summary"
}

# Medians as bars, and each row's spread over the rounds.
print_plot() {
  local ceiling=$1
  echo '```'
  awk -v t="$ceiling" '
    function bar(v) { s = ""; for (i = 0; i < int(v * 4 + 0.5); ++i) s = s "#"; return s }
    {
      row = sprintf("%s x%d %4d KiB", $1, $2, $3 / 1024)
      printf "%-24s lane     %-40s %5.2f  (%s)\n", row, bar($4), $4, $7
      printf "%-24s gRPC     %-40s %5.2f  (%s)\n", "", bar($5), $5, $8
      printf "%-24s Redis    %-40s %5.2f  (%s)\n", "", bar($6), $6, $9
    }
    END { printf "%-24s iperf3   %-40s %5.2f\n", "TCP ceiling x1", bar(t), t }' "$work/summary"
  echo '```'
}

print_latency() {
  echo "| context (tokens) | Snapshot p50 µs | Snapshot p99 µs | Restore p50 µs | Restore p99 µs |"
  echo "|---:|---:|---:|---:|---:|"
  awk '$1 == "LAT" && $2 == "snapshot" {s[$3] = $4 " | " $5; order[++n] = $3}
       $1 == "LAT" && $2 == "restore" {r[$3] = $4 " | " $5}
       END {for (i = 1; i <= n; ++i) printf "| %d | %s | %s |\n", order[i], s[order[i]], r[order[i]]}' "$raw"
}

main() {
  # --report: print the tables again from the last run's raw rows.
  if [[ ${1:-} != --report ]]; then
    build
    load_before=$(cut -d' ' -f1-3 /proc/loadavg)
    start_peers
    run_rows
    print_machine >"$BUILD_DIR/service_bench_machine.txt"
  fi
  local ceiling
  ceiling=$(awk '$1 == "IPERF3" {print $2}' "$raw" | median)
  if grep -q "error" "$raw"; then log "some rows failed:"; grep "error" "$raw" >&2; fi
  echo "### Machine"
  cat "$BUILD_DIR/service_bench_machine.txt"
  echo
  echo "### Throughput (GB/s = 10^9 bytes of K+V or value per second)"
  summarise_rows >"$work/summary"
  print_throughput "$ceiling"
  echo
  echo "Medians as bars (one # = 0.25 GB/s), with (min-max) over the rounds:"
  echo
  print_plot "$ceiling"
  echo
  if [[ -n $BEFORE ]] || grep -q "^ROW before-" "$raw"; then
    echo "### Before / after (GB/s, medians; the before build runs beside this one in every round)"
    summarise_before_after >"$work/before_after"
    print_before_after
    echo
  fi
  echo "### Snapshot / Restore latency (16 layers, 8 KV heads, head dim 128, f16; through kvcache::Client)"
  print_latency
}

main "$@"
