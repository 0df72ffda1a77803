#!/usr/bin/env bash
# kvcached's tests and benchmarks on a real GPU machine that lacks Debian 12's
# libraries (e.g. an Ubuntu host with NVIDIA's driver): binaries built here are
# carried there with their shared libraries, Debian's Vulkan loader and its
# validation layer.
#
#   bash bench/gpu/device_check.sh pack     # here, after building build/ and
#                                           # build-bench/: fills .devrun/
#   bash bench/gpu/device_check.sh run OUT  # there, from the repository root
#                                           # (with .devrun/ copied along)
#
# `run` writes each step's output under OUT and prints a summary: gpu, engine
# and e2e tests in shards over the cores (validation on), copy, quantize and
# service benchmarks. bench/RESULTS.md ("the first run on a real GPU") has
# the figures of an H200.
set -uo pipefail
cd "$(dirname "$0")/../.."
CARRY=.devrun

pack() {
  rm -rf "$CARRY" && mkdir -p "$CARRY/bin" "$CARRY/rel" "$CARRY/lib" "$CARRY/deb" || exit 1
  for b in tests/gpu/gpu_tests tests/engine/engine_tests tests/service/e2e_tests \
    tests/service/kvcache_prefix_worker server/kvcached client/kvcachectl \
    bench/gpu/gpu_copy_bench bench/gpu/gpu_quant_bench; do
    strip -o "$CARRY/bin/$(basename $b)" "build/$b" || exit 1
  done
  for b in server/kvcached bench/service/service_bench; do
    strip -o "$CARRY/rel/$(basename $b)" "build-bench/$b" || exit 1
  done
  # Every library but glibc's own (the host's newer glibc runs these).
  ldd "$CARRY"/bin/* "$CARRY"/rel/* | awk '/=> \//{print $3}' | sort -u |
    grep -v -E '/(libc|libm|libpthread|libdl|librt|ld-linux-x86-64|libresolv)\.so' |
    xargs -I{} cp -L {} "$CARRY/lib/"
  (cd "$CARRY/deb" && apt-get download libvulkan1 vulkan-validationlayers) || exit 1
  pwd >"$CARRY/origin"  # the tests name source files by this path
  du -sh "$CARRY"
}

# Runs `binary` in `shards` processes at once (each its own Vulkan device).
sharded() {
  local name=$1 shards=$2 limit=$3 binary=$4 started=$SECONDS
  for i in $(seq 0 $((shards - 1))); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout "$limit" "$binary" \
      >"$OUT/$name.$i.log" 2>&1 &
  done
  wait
  cat "$OUT/$name".*.log >"$OUT/$name.txt" && rm "$OUT/$name".*.log
  echo "$name: $((SECONDS - started)) s, $(grep -c '^\[       OK' "$OUT/$name.txt") passed," \
    "$(grep -c '^\[  SKIPPED \] [A-Z]' "$OUT/$name.txt") skipped," \
    "$(grep -c '^\[  FAILED  \] [A-Z].*(' "$OUT/$name.txt") failed"
}

run() {
  OUT=$1
  mkdir -p "$OUT" /tmp/vulkan
  for f in "$CARRY"/deb/*.deb; do dpkg -x "$f" /tmp/vulkan; done
  export LD_LIBRARY_PATH=$PWD/$CARRY/lib:/tmp/vulkan/usr/lib/x86_64-linux-gnu
  export VK_LAYER_PATH=/tmp/vulkan/usr/share/vulkan/explicit_layer.d
  local icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  if [ -e $icd ] && ! ls /usr/share/vulkan/icd.d/nvidia* >/dev/null 2>&1; then
    export VK_DRIVER_FILES=$icd
  fi
  # The tests name sources and binaries by their paths on the build machine.
  local origin
  origin=$(cat "$CARRY/origin")
  if [ ! -e "$origin" ]; then mkdir -p "$(dirname "$origin")" && ln -s "$PWD" "$origin"; fi
  mkdir -p build/server build/client build/tests/service
  ln -sf "$PWD/$CARRY/bin/kvcached" build/server/kvcached
  ln -sf "$PWD/$CARRY/bin/kvcachectl" build/client/kvcachectl
  ln -sf "$PWD/$CARRY/bin/kvcache_prefix_worker" build/tests/service/kvcache_prefix_worker
  local bin=$CARRY/bin rel=$CARRY/rel cores
  cores=$(nproc)
  "$bin/kvcached" --list_devices | tee "$OUT/devices.txt"
  sharded gpu_tests "$cores" 120 "$bin/gpu_tests"
  sharded engine_tests "$cores" 300 "$bin/engine_tests"
  # One Vulkan instance per test server: NVIDIA's driver is loaded again for
  # each, and its static TLS outgrows glibc's default surplus in one process.
  GLIBC_TUNABLES=glibc.rtld.optional_static_tls=262144 \
    sharded e2e_tests "$((cores * 2))" 300 "$bin/e2e_tests"
  timeout 120 "$bin/gpu_copy_bench" --benchmark_min_time=0.1 >"$OUT/copy_bench.txt" 2>&1
  timeout 120 "$bin/gpu_quant_bench" --benchmark_min_time=0.1 >"$OUT/quant_bench.txt" 2>&1
  "$rel/kvcached" --listen=127.0.0.1:50051 --data_lane_listen=127.0.0.1:50052 \
    --pool_bytes=$((8 << 30)) --max_message_bytes=$((256 << 20)) >"$OUT/kvcached.log" 2>&1 &
  local server=$!
  for _ in $(seq 100); do grep -q "listening on" "$OUT/kvcached.log" && break; sleep 0.1; done
  grep "device:" "$OUT/kvcached.log"
  for lane in auto ""; do
    timeout 60 "$rel/service_bench" --ops=update,fetch --streams=1,4 \
      --chunks=262144,1048576 --seconds=2 --data_lane="$lane" >>"$OUT/service_bench.txt" 2>&1
  done
  timeout 60 "$rel/service_bench" --ops=latency --latency_iterations=50 >>"$OUT/service_bench.txt" 2>&1
  kill $server && wait $server
  grep -E '^(ROW|LAT)' "$OUT/service_bench.txt"
}

case "${1:-}" in
  pack) pack ;;
  run) run "${2:?run OUT}" ;;
  *) echo "usage: $0 pack | run OUT" >&2; exit 2 ;;
esac
