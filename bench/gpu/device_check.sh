#!/usr/bin/env bash
# kvcached's tests and benchmarks on a real GPU machine that lacks Debian 12's
# libraries (e.g. an Ubuntu host with NVIDIA's driver): binaries built here are
# carried there with their shared libraries, Debian's Vulkan loader and its
# validation layer.
#
#   bash bench/gpu/device_check.sh pack     # here, after building build/ and
#                                           # build-bench/: fills .devrun/
#   bash bench/gpu/device_check.sh run OUT [all|benchmarks|tests]
#                                           # there, from the repository root
#                                           # (with .devrun/ copied along)
#
# `run` writes each step's output under OUT and prints a summary: the TLS,
# service, tier, saved-file and copy benchmarks, then gpu, engine and e2e tests
# in shards over the cores (validation on). bench/RESULTS.md ("the first run on a real GPU") has
# the figures of an H200.
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/lib/server.sh
source bench/lib/server.sh
CARRY=.devrun

pack() {
  rm -rf "$CARRY" && mkdir -p "$CARRY/bin" "$CARRY/rel" "$CARRY/lib" "$CARRY/deb" || exit 1
  for b in tests/gpu/gpu_tests tests/engine/engine_tests tests/e2e/e2e_tests \
    tests/e2e/kvcache_prefix_worker server/kvcached client/kvcachectl \
    bench/gpu/gpu_copy_bench bench/gpu/gpu_quant_bench; do
    strip -o "$CARRY/bin/$(basename $b)" "build/$b" || exit 1
  done
  for b in server/kvcached bench/service/service_bench bench/engine/tiers_bench \
    bench/engine/saved_files_bench; do
    strip -o "$CARRY/rel/$(basename $b)" "build-bench/$b" || exit 1
  done
  # The TLS benchmark's peers: Redis with its TLS port, and openssl for the
  # run's certificates.
  cp /usr/bin/redis-server /usr/bin/redis-benchmark /usr/bin/redis-cli /usr/bin/openssl \
    "$CARRY/rel/" || exit 1
  # Every library but glibc's own (the host's newer glibc runs these).
  ldd "$CARRY"/bin/* "$CARRY"/rel/* | awk '/=> \//{print $3}' | sort -u |
    grep -v -E '/(libc|libm|libpthread|libdl|librt|ld-linux-x86-64|libresolv)\.so' |
    xargs -I{} cp -L {} "$CARRY/lib/"
  # NVIDIA's Vulkan driver (libGLX_nvidia) needs glvnd's EGL and GLX
  # libraries, which a CUDA-only image may lack.
  (cd "$CARRY/deb" && apt-get download libvulkan1 vulkan-validationlayers) || exit 1
  mkdir -p "$CARRY/deb/glvnd"
  (cd "$CARRY/deb/glvnd" && apt-get download libegl1 libglvnd0 libopengl0 libgl1 libglx0 \
    libgles2) || exit 1
  pwd >"$CARRY/origin"  # the tests name source files by this path
  # One compressed file: the device tool carries 64 MiB with the tree.
  (cd "$CARRY" && tar -cf - bin rel lib deb origin | xz -T0 -6 >bundle.tar.xz &&
    rm -rf bin rel lib deb origin) || exit 1
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
  OUT=$1 part=$2
  mkdir -p "$OUT" /tmp/vulkan
  if [ -e "$CARRY/bundle.tar.xz" ]; then xz -dc "$CARRY/bundle.tar.xz" | tar -xf - -C "$CARRY"; fi
  for f in "$CARRY"/deb/*.deb; do dpkg -x "$f" /tmp/vulkan; done
  # glvnd where the driver looks for it (the system's paths; a bare machine
  # is lent, and given back after).
  for f in "$CARRY"/deb/glvnd/*.deb; do dpkg -x "$f" /; done
  ldconfig
  local egl=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  if [ -e $egl ]; then export __EGL_VENDOR_LIBRARY_FILENAMES=$egl; fi
  # NVIDIA's driver libraries (its Vulkan ICD names libGLX_nvidia.so.0 bare)
  # where the loader's cache does not list them.
  export LD_LIBRARY_PATH=$PWD/$CARRY/lib:/tmp/vulkan/usr/lib/x86_64-linux-gnu:/usr/local/nvidia/lib64
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
  ln -sf "$PWD/$CARRY/bin/kvcache_prefix_worker" build/tests/e2e/kvcache_prefix_worker
  local bin=$CARRY/bin rel=$CARRY/rel cores
  cores=$(nproc)
  export PATH=$PWD/$rel:$PATH  # the carried openssl and Redis
  if ! "$bin/kvcached" --list_devices >"$OUT/devices.txt" 2>&1; then
    cat "$OUT/devices.txt"
    VK_LOADER_DEBUG=error,warn,driver "$bin/kvcached" --list_devices 2>&1 | tail -30
    return 1
  fi
  cat "$OUT/devices.txt"
  echo "TCP ULPs: $(cat /proc/sys/net/ipv4/tcp_available_ulp) (kernel $(uname -r))"
  [[ $part != tests ]] && benchmarks
  [[ $part != benchmarks ]] && tests
}

# Each bounded, on an otherwise idle machine.
benchmarks() {
  BINARIES=$rel RAW=$OUT/tls_bench_raw.txt REPEATS=${TLS_REPEATS:-2} ROW_SECONDS=1 \
    CHUNKS=1048576 timeout 200 bash bench/run_tls_bench.sh >"$OUT/tls_bench.txt" 2>"$OUT/tls_bench.log"
  cat "$OUT/tls_bench.txt"
  service_rows
  timeout 120 "$rel/tiers_bench" --benchmark_filter='Evict|Promote|Memcpy|RestoreFrom' \
    >"$OUT/tiers_bench.txt" 2>&1
  KVCACHED_BENCH_DIR=/tmp timeout 120 "$rel/saved_files_bench" >"$OUT/saved_files_bench.txt" 2>&1
  timeout 60 "$bin/gpu_copy_bench" --benchmark_min_time=0.1 >"$OUT/copy_bench.txt" 2>&1
  grep -h -E '^BM_' "$OUT/tiers_bench.txt" "$OUT/saved_files_bench.txt"
}

tests() {
  sharded gpu_tests "$cores" 120 "$bin/gpu_tests"
  # One Vulkan instance per test server: NVIDIA's driver is loaded again for
  # each, and its static TLS outgrows glibc's default surplus in one process.
  GLIBC_TUNABLES=glibc.rtld.optional_static_tls=262144 \
    sharded e2e_tests "$((cores * 2))" 150 "$bin/e2e_tests"
  # Last: on a GPU whose mapping is uncached, the forced Direct cases read at
  # ~0.06 GB/s (a path kvcached does not take there) and outlast any bound.
  sharded engine_tests "$cores" 150 "$bin/engine_tests"
  grep -h '^\[  FAILED  \] [A-Z].*(' "$OUT"/*_tests.txt
}

# The service over loopback, both transports, on the path the device picks.
service_rows() {
  start_kvcached "$OUT/kvcached.log" "$rel/kvcached" --listen=127.0.0.1:50051 \
    --data_lane_listen=127.0.0.1:50052 --pool_bytes=$((8 << 30)) \
    --max_message_bytes=$((256 << 20)) || return 1
  local server=$kvcached_pid
  grep "device:" "$OUT/kvcached.log"
  for lane in auto ""; do
    timeout 60 "$rel/service_bench" --ops=update,fetch --streams=1,4 \
      --chunks=262144,1048576 --seconds=1.5 --data_lane="$lane" >>"$OUT/service_bench.txt" 2>&1
  done
  timeout 60 "$rel/service_bench" --ops=latency --latency_iterations=50 >>"$OUT/service_bench.txt" 2>&1
  stop_kvcached "$server"
  grep -E '^(ROW|LAT)' "$OUT/service_bench.txt"
}

case "${1:-}" in
  pack) pack ;;
  run) run "${2:?run OUT}" "${3:-all}" ;;
  *) echo "usage: $0 pack | run OUT [all | benchmarks | tests]" >&2; exit 2 ;;
esac
