#!/usr/bin/env bash
# Builds the kvcached image with podman, starts it, and runs the demo worker
# and the Python interop test against the container over its published ports.
#
#   bash docker/build-and-test.sh           build, test, remove the test containers
#   IMAGE=kvcached:mine bash docker/build-and-test.sh   another tag (default localhost/kvcached:test)
#   bash docker/build-and-test.sh --no-build   test the image already tagged $IMAGE
#   bash docker/build-and-test.sh --binaries build   the image around the
#       kvcached, kvcachectl and kvcache_demo that the host's build directory
#       `build` holds (stripped), in place of the image's own build stage: how
#       CI tests the image without compiling the server a second time. The
#       runtime stage, the entrypoint and every test below are the same.
#
# Where podman cannot run containers at all (no kernel support, no
# privileges), it says why and exits 0 without testing: the caller (.ci)
# prints that reason; it never passes silently.
#
# What podman needs on a machine like this one (root, runc, cgroup v1, no
# systemd as PID 1, no CAP_SYS_RESOURCE) is written into a containers.conf of
# its own, passed in CONTAINERS_CONF, so the machine's files stay untouched:
#   - cgroup_manager = cgroupfs (no systemd to ask), events to a file;
#   - runtime runc (Debian's; the issue's choice);
#   - default_ulimits no higher than conmon's own: without CAP_SYS_RESOURCE
#     runc cannot raise a limit above its parent's, and podman's default asks
#     for 1048576 open files and as many processes, so every container failed
#     ("error setting rlimit type 7"/"6": operation not permitted);
#   - the overlay storage driver (the kernel has overlayfs; vfs would copy
#     every layer).
# The base image: debian:12-slim from the registry where it can be pulled;
# elsewhere (no registry reachable, as on the project's build machines) one
# made from Debian packages with debootstrap (minbase) and `podman import`,
# cached as localhost/kvcached-base:bookworm.
set -euo pipefail
cd "$(dirname "$0")/.."

build=yes
binaries=""
usage="usage: build-and-test.sh [--no-build | --binaries BUILD_DIR]"
while (($# > 0)); do
  case "$1" in
    --no-build) build="" ;;
    --binaries)
      binaries=${2:?$usage}
      shift
      ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
# What the image holds, by their paths in a build directory.
image_binaries=(server/kvcached client/kvcachectl client/kvcache_demo)
if [[ -n $binaries ]]; then
  for binary in "${image_binaries[@]}"; do
    if [[ ! -x $binaries/$binary ]]; then
      echo "build-and-test: --binaries $binaries: no $binaries/$binary (build it first)" >&2
      exit 2
    fi
  done
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "build-and-test: SKIPPED: needs root (rootful podman with runc; debootstrap)"
  exit 0
fi
image=${IMAGE:-localhost/kvcached:test}
work=${KVCACHED_CONTAINER_WORK:-/var/tmp/kvcached-container}
mkdir -p "$work"

bash .ci/setup --container

# --- podman's configuration -------------------------------------------------
nofile=$(ulimit -Hn)
nproc=$(ulimit -Hu)
# conmon runs with at most 32768 processes here; a container may not get more.
if [[ $nproc == unlimited || $nproc -gt 32768 ]]; then nproc=32768; fi
if [[ $nofile == unlimited || $nofile -gt 1048576 ]]; then nofile=1048576; fi
cat >"$work/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=${nproc}:${nproc}"]

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
EOF
cat >"$work/storage.conf" <<EOF
[storage]
driver = "overlay"
runroot = "/run/containers/storage"
graphroot = "/var/lib/containers/storage"
EOF
export CONTAINERS_CONF="$work/containers.conf"
export CONTAINERS_STORAGE_CONF="$work/storage.conf"

# Does podman work here at all (storage, runtime)? Asked before anything is
# built, so that a machine where it cannot says so at once.
if ! info=$(timeout 120 podman info 2>&1); then
  echo "build-and-test: SKIPPED: podman does not work on this machine: $(tail -3 <<<"$info")"
  exit 0
fi

# The Debian mirror this machine's apt uses (deb822 or one-line sources).
host_mirror() {
  local uri
  uri=$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' /etc/apt/sources.list.d/*.sources \
    2>/dev/null | grep -m1 '/debian/\?$' || true)
  if [[ -z $uri ]]; then
    uri=$(awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}' /etc/apt/sources.list \
      2>/dev/null || true)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

# --- a base image -------------------------------------------------------------
base=localhost/kvcached-base:bookworm
if timeout 120 podman pull -q docker.io/library/debian:12-slim >/dev/null 2>&1; then
  base=docker.io/library/debian:12-slim
  echo "build-and-test: base image debian:12-slim from the registry"
elif podman image exists "$base"; then
  echo "build-and-test: no registry reachable; base image $base (made earlier with debootstrap)"
else
  mirror=$(host_mirror)
  echo "build-and-test: no registry reachable; making the base image from Debian packages" \
    "(debootstrap --variant=minbase bookworm from $mirror, podman import)"
  rm -rf "$work/rootfs"
  # Without a base image nothing can be built or tested: a machine that can
  # neither pull one nor make one is told so, as one where podman cannot run.
  if ! debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" \
    >"$work/debootstrap.log" 2>&1; then
    echo "build-and-test: SKIPPED: no base image: no registry answers and debootstrap failed:"
    tail -5 "$work/debootstrap.log"
    exit 0
  fi
  if ! tar -C "$work/rootfs" -c . | podman import -q - "$base" >/dev/null; then
    echo "build-and-test: SKIPPED: no base image: podman import of the debootstrap tree failed"
    exit 0
  fi
  rm -rf "$work/rootfs"
fi

# Can podman run a container here at all?
if ! probe=$(timeout 120 podman run --rm "$base" true 2>&1); then
  echo "build-and-test: SKIPPED: podman cannot run containers on this machine: $probe"
  exit 0
fi

# --- the image ----------------------------------------------------------------
started=$SECONDS
# The build stage installs packages with apt: the host's network.
# --format docker: the OCI format has no HEALTHCHECK.
# --binaries: a build context named like the build stage replaces it.
prebuilt=()
if [[ -n $binaries ]]; then
  rm -rf "$work/prebuilt"
  mkdir -p "$work/prebuilt/out/bin"
  for binary in "${image_binaries[@]}"; do
    strip -o "$work/prebuilt/out/bin/$(basename "$binary")" "$binaries/$binary"
  done
  prebuilt=(--build-context "build=$work/prebuilt")
fi
if [[ -n $build ]]; then
  podman build --format docker --network=host --build-arg "BASE=$base" "${prebuilt[@]}" \
    -f docker/Dockerfile -t "$image" .
fi
how="as built before"
if [[ -n $build ]]; then how="built in $((SECONDS - started)) s"; fi
if [[ -n $binaries ]]; then how+=" around the binaries of $binaries"; fi
echo "build-and-test: image $image $how;" \
  "$(podman image inspect --format '{{.Size}}' "$image" | awk '{printf "%.0f MiB", $1/1048576}')"

containers=()
compose=()
cleanup() {
  for c in "${containers[@]}"; do podman rm -f "$c" >/dev/null 2>&1 || true; done
  if [[ ${#compose[@]} -gt 0 ]]; then "${compose[@]}" down -v >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# --- the container as an operator runs it: published ports, flags by env ----
grpc_port=$(free_port)
lane_port=$(free_port)
metrics_port=$(free_port)
# Two tenants. The file holds the tokens' SHA-256 only, so it may be
# readable by the container's user (in Kubernetes: a Secret's volume).
token=$(openssl rand -hex 16)
other_token=$(openssl rand -hex 16)
digest() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
printf 'tenant=demo sha256=%s admin\ntenant=other sha256=%s\n' \
  "$(digest "$token")" "$(digest "$other_token")" >"$work/tokens"
chmod 0644 "$work/tokens"
name=kvcached-test-$$
containers+=("$name")
# --health-interval=disable: podman runs the periodic check from a systemd
# timer, and this machine may have no systemd; the script runs it itself.
podman run -d --name "$name" --health-interval=disable \
  -p "127.0.0.1:$grpc_port:50051" -p "127.0.0.1:$lane_port:50052" \
  -p "127.0.0.1:$metrics_port:9464" \
  -v "$work/tokens:/etc/kvcached/tokens:ro" \
  -e KVCACHED_TOKENS_FILE=/etc/kvcached/tokens \
  -e KVCACHED_POOL_BYTES=134217728 -e KVCACHED_HOST_BYTES=268435456 \
  -e "KVCACHED_DATA_LANE_ADVERTISE=127.0.0.1:$lane_port" \
  "$image" >/dev/null
[[ $(podman exec "$name" id -u) != 0 ]] || { echo "the container runs as root" >&2; exit 1; }
healthy=""
for _ in $(seq 1 60); do
  if podman healthcheck run "$name" >/dev/null 2>&1; then healthy=yes; break; fi
  sleep 1
done
if [[ -z $healthy ]]; then
  podman logs "$name" >&2
  echo "build-and-test: the container never answered its health check" >&2
  exit 1
fi
echo "build-and-test: $name healthy (gRPC 127.0.0.1:$grpc_port, lane 127.0.0.1:$lane_port," \
  "metrics 127.0.0.1:$metrics_port)"

# The demo worker, from the image, on the host's network: through the
# published ports only, the lane too.
podman run --rm --network=host -e "KVCACHE_TOKEN=$token" -e "KVCACHE_OTHER_TOKEN=$other_token" \
  --entrypoint /usr/local/bin/kvcache_demo "$image" --server="127.0.0.1:$grpc_port"
# Read whole before grep: `grep -q` stops at the first match, and curl,
# still writing, would fail the pipeline.
if ! metrics=$(curl -fsS "http://127.0.0.1:$metrics_port/metrics"); then
  echo "build-and-test: no metrics page on the published port" >&2
  exit 1
fi
grep -q '^kvcached_' <<<"$metrics" \
  || { echo "build-and-test: no kvcached_ metrics on the published port" >&2; exit 1; }
echo "build-and-test: demo and metrics over the published ports: OK"

# SIGTERM drains and exits 0 (podman stop sends the image's STOPSIGNAL).
podman stop -t 30 "$name" >/dev/null
code=$(podman inspect --format '{{.State.ExitCode}}' "$name")
[[ $code == 0 ]] || { podman logs "$name" >&2; echo "exit code $code after SIGTERM" >&2; exit 1; }
echo "build-and-test: SIGTERM: drained, exit 0"

# --- compose: three replicas, each serving through its published ports ------
# compose.yaml as it is, but for the host ports it publishes (5i051, 5i052,
# 5i464, 5i557, 5i558 and the lane addresses it advertises): those lie in
# Linux's ephemeral range, where any outgoing connection of the moment may
# hold one (a CI run failed so: "127.0.0.1:52052: address already in use").
# The copy publishes ports below that range that nothing holds, and names
# the tokens file by its absolute path.
mkdir -p docker/secrets
[[ -f docker/secrets/tokens ]] || bash docker/fleet-secrets.sh >/dev/null
held=$(ss -Htan | awk '{n = split($4, a, ":"); print a[n]}' | sort -u)
port_map=()
next_port=$((20000 + RANDOM % 10000))
for old_port in 50051 50052 50464 50557 50558 51051 51052 51464 51557 51558 \
  52051 52052 52464 52557 52558; do
  while grep -qx "$next_port" <<<"$held"; do next_port=$((next_port + 1)); done
  port_map+=("$old_port=$next_port")
  next_port=$((next_port + 1))
done
port_of() {
  local entry
  for entry in "${port_map[@]}"; do
    if [[ ${entry%=*} == "$1" ]]; then echo "${entry#*=}"; fi
  done
}
sed_ports=()
for entry in "${port_map[@]}"; do
  sed_ports+=(-e "s/127\.0\.0\.1:${entry%=*}\([:,\"]\|$\)/127.0.0.1:${entry#*=}\1/g")
done
sed "${sed_ports[@]}" -e "s#file: \./secrets/tokens#file: $PWD/docker/secrets/tokens#" \
  docker/compose.yaml >"$work/compose.yaml"
compose=(podman-compose -f "$work/compose.yaml" -p kvcached-test)
"${compose[@]}" down -v >/dev/null 2>&1 || true  # what a run stopped half-way left
if ! KVCACHED_IMAGE="$image" "${compose[@]}" up -d >"$work/compose.log" 2>&1; then
  cat "$work/compose.log" >&2
  exit 1
fi
for replica in 0 1 2; do
  port=$(port_of "5${replica}051")
  served=""
  for _ in $(seq 1 60); do
    if podman run --rm --network=host --entrypoint /usr/local/bin/kvcachectl "$image" \
      --server="127.0.0.1:$port" health kvcache.v1.KvCacheService >/dev/null 2>&1; then
      served=yes
      break
    fi
    sleep 1
  done
  if [[ -z $served ]]; then
    tail -20 "$work/compose.log" >&2
    echo "build-and-test: compose: replica $replica never served on 127.0.0.1:$port" >&2
    exit 1
  fi
done
KVCACHED_IMAGE="$image" "${compose[@]}" down -v >>"$work/compose.log" 2>&1
compose=()
echo "build-and-test: compose: three replicas up and SERVING (host ports from" \
  "$(port_of 50051)), then down"

# --- the Python interop test against containers -----------------------------
# The test starts its server itself, several times (plaintext, TLS): each
# start becomes a container (docker/podman-kvcached.sh) on published ports.
KVCACHED_IMAGE="$image" /usr/bin/python3 tests/e2e/python/interop_test.py \
  --kvcached docker/podman-kvcached.sh --proto_dir protos --protoc /usr/bin/protoc \
  --grpc_python_plugin /usr/bin/grpc_python_plugin
echo "build-and-test: PASSED ($((SECONDS - started)) s from the build on)"
