#!/usr/bin/env bash
# What TLS costs, over loopback, in one run: kvcached Update / Fetch over the
# data lane and over gRPC, plaintext and with TLS (--tls_cert: the lane runs
# TLS 1.3, in the kernel where it has kernel TLS, else in OpenSSL), beside
# Redis SET / GET of the same bytes plaintext and over its TLS port
# (redis-benchmark, pipelined, both ways alike).
#
#   bash bench/run_tls_bench.sh            # prints the markdown table
#   REPEATS=5 ROW_SECONDS=3 bash bench/run_tls_bench.sh
#
# Certificates are made for the run (openssl) and deleted after it. Builds
# Release into build-bench/ like run_service_bench.sh. Each row runs REPEATS
# times, the systems alternating within a round; the table gives medians.
# Raw rows go to build-bench/tls_bench_raw.txt (or RAW). About 6 minutes after
# the build. BINARIES=DIR runs the kvcached and service_bench in DIR instead of
# building (a GPU machine that lacks the toolchain: bench/gpu/device_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

REPEATS=${REPEATS:-3}
ROW_SECONDS=${ROW_SECONDS:-2}
STREAMS=${STREAMS:-"1 4"}
CHUNKS=${CHUNKS:-"262144 1048576"}
BUILD_DIR=${BUILD_DIR:-build-bench}
BINARIES=${BINARIES:-}
KVCACHED=${BINARIES:-$BUILD_DIR/server}/kvcached
SERVICE_BENCH=${BINARIES:-$BUILD_DIR/bench/service}/service_bench
# shellcheck source=bench/lib/server.sh
source bench/lib/server.sh
work=$(mktemp -d)
raw=${RAW:-$BUILD_DIR/tls_bench_raw.txt}
pids=()  # the peers other than kvcached

cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
on_exit cleanup
log() { echo "bench: $*" >&2; }

free_port() {
  local port=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((port + 1)); done
  echo "$port"
}
wait_for() {
  for _ in $(seq 300); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  log "gave up waiting for: $*"; return 1
}
median() { sort -g | awk '{v[NR] = $1} END {print NR ? v[int((NR + 1) / 2)] : 0}'; }

build() {
  bash .ci/setup --bench >&2
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCACHED_BUILD_TESTS=OFF >&2
  cmake --build "$BUILD_DIR" --parallel "$(nproc)" --target kvcached service_bench >&2
}

make_certs() {
  (
    cd "$work"
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out ca.key
    openssl req -x509 -new -key ca.key -days 1 -subj /CN=bench-ca -out ca.pem
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out server.key
    openssl req -new -key server.key -subj /CN=127.0.0.1 -out server.csr
    printf 'subjectAltName=IP:127.0.0.1\n' >server.ext
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \
      -extfile server.ext -out server.pem
  ) >/dev/null 2>&1
}

start_peers() {
  plain_port=$(free_port 50251)
  plain_lane=$(free_port $((plain_port + 1)))
  tls_port=$(free_port $((plain_lane + 1)))
  tls_lane=$(free_port $((tls_port + 1)))
  local common=(--pool_bytes=$((6 << 30)) --max_message_bytes=$((256 << 20)))
  start_kvcached "$work/plain.log" "$KVCACHED" --listen="127.0.0.1:$plain_port" \
    --data_lane_listen="127.0.0.1:$plain_lane" "${common[@]}" || exit 1
  start_kvcached "$work/tls.log" "$KVCACHED" --listen="127.0.0.1:$tls_port" \
    --data_lane_listen="127.0.0.1:$tls_lane" --tls_cert="$work/server.pem" \
    --tls_key="$work/server.key" "${common[@]}" || exit 1
  redis_port=$(free_port 6490)
  redis_tls_port=$(free_port $((redis_port + 1)))
  redis-server --bind 127.0.0.1 --port "$redis_port" --tls-port "$redis_tls_port" \
    --tls-cert-file "$work/server.pem" --tls-key-file "$work/server.key" \
    --tls-ca-cert-file "$work/ca.pem" --tls-auth-clients no --save "" --appendonly no \
    --daemonize no --logfile "$work/redis.log" &
  pids+=($!)
  wait_for redis-cli -p "$redis_port" ping
}

# redis-benchmark's rate for one row as GB/s, named like service_bench's
# rows. A GET row runs the SET before it in the same call, so it reads
# values of its own size.
redis_row() {
  local name=$1 op=$2 streams=$3 chunk=$4 port=$5
  shift 5
  local requests=$((ROW_SECONDS * (1 << 30) / chunk)) tests=set
  [[ $op == get ]] && tests=set,get
  local rate
  rate=$(redis-benchmark -h 127.0.0.1 -p "$port" "$@" -t "$tests" -d "$chunk" -c "$streams" \
    -P 4 -n "$requests" --csv 2>/dev/null |
    awk -F'"' -v t="${op^^}" '$2 == t {print $4}')
  awk -v n="$name" -v o="$op" -v s="$streams" -v c="$chunk" -v r="$rate" \
    'BEGIN {printf "ROW %s %s %d %d %.3f\n", n, o, s, c, r * c / 1e9}'
}

run_rows() {
  local kv=$SERVICE_BENCH
  local common=(--seconds="$ROW_SECONDS" --warmup=0.5)
  local tls=(--tls_ca="$work/ca.pem")
  : >"$raw"
  for rep in $(seq "$REPEATS"); do
    log "round $rep of $REPEATS"
    for pair in "update set" "fetch get"; do
      read -r kv_op redis_op <<<"$pair"
      for streams in $STREAMS; do
        for chunk in $CHUNKS; do
          local row=(--ops="$kv_op" --streams="$streams" --chunks="$chunk" "${common[@]}")
          for lane in auto ""; do
            "$kv" --address="127.0.0.1:$plain_port" --data_lane="$lane" "${row[@]}" >>"$raw"
            "$kv" --address="127.0.0.1:$tls_port" --data_lane="$lane" "${tls[@]}" "${row[@]}" |
              sed 's/^ROW kvcached/ROW tls-kvcached/' >>"$raw"
          done
          redis_row redis "$redis_op" "$streams" "$chunk" "$redis_port" >>"$raw"
          redis_row tls-redis "$redis_op" "$streams" "$chunk" "$redis_tls_port" --tls \
            --cacert "$work/ca.pem" >>"$raw"
        done
      done
    done
  done
}

rate_of() {
  awk -v n="$1" -v o="$2" -v s="$3" -v c="$4" \
    '$1 == "ROW" && $2 == n && $3 == o && $4 == s && $5 == c {print $6}' "$raw" | median
}

print_table() {
  echo "| op | streams | chunk | lane GB/s | lane TLS | TLS / plain | gRPC GB/s | gRPC TLS | TLS / plain | Redis GB/s | Redis TLS | TLS / plain |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  for pair in "update set Update/SET" "fetch get Fetch/GET"; do
    read -r kv_op redis_op label <<<"$pair"
    for streams in $STREAMS; do
      for chunk in $CHUNKS; do
        echo "$label $streams $chunk" \
          "$(rate_of kvcached-lane "$kv_op" "$streams" "$chunk")" \
          "$(rate_of tls-kvcached-lane "$kv_op" "$streams" "$chunk")" \
          "$(rate_of kvcached "$kv_op" "$streams" "$chunk")" \
          "$(rate_of tls-kvcached "$kv_op" "$streams" "$chunk")" \
          "$(rate_of redis "$redis_op" "$streams" "$chunk")" \
          "$(rate_of tls-redis "$redis_op" "$streams" "$chunk")"
      done
    done
  done | awk '
    function ratio(a, b) { return a > 0 ? sprintf("%.2f", b / a) : "-" }
    { printf "| %s | %d | %d KiB | %.2f | %.2f | %s | %.2f | %.2f | %s | %.2f | %.2f | %s |\n",
        $1, $2, $3 / 1024, $4, $5, ratio($4, $5), $6, $7, ratio($6, $7), $8, $9, ratio($8, $9) }'
}

print_machine() {
  echo "- CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
  echo "- kernel $(uname -r) (TCP ULPs available: $(cat /proc/sys/net/ipv4/tcp_available_ulp)), $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- $(sed -n 's/.*\] \(data lane: TLS.*\)/\1/p' "$work/tls.log" | head -1)"
  echo "- $REPEATS rounds of ${ROW_SECONDS} s per row (after 0.5 s warm-up); medians; Redis by redis-benchmark -P 4"
}

[[ -n $BINARIES ]] || build
make_certs
start_peers
run_rows
print_machine
echo
print_table
