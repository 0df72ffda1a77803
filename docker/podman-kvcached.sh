#!/usr/bin/env bash
# kvcached as a program that tests start (tests/service/python/interop_test.py
# --kvcached docker/podman-kvcached.sh), run in a container of $KVCACHED_IMAGE
# and reached through published ports only:
#   - --listen and --data_lane_listen are the container's own (0.0.0.0 inside),
#     published on free loopback ports; the lane's is given to clients with
#     --data_lane_advertise;
#   - --validation is dropped: the runtime image has no validation layers
#     (the same test runs with them outside the container);
#   - a flag naming a file (--tls_cert=/path) gets that file, copied readable
#     for the image's unprivileged user, mounted read-only at the same path;
#   - the log goes to stderr as kvcached writes it, except that "listening on"
#     names the published address;
#   - SIGTERM and SIGINT go to kvcached; the exit code is kvcached's.
set -euo pipefail
image=${KVCACHED_IMAGE:?"KVCACHED_IMAGE: the image to run"}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
files=$(mktemp -d)
args=()
mounts=()
for arg in "$@"; do
  case "$arg" in
    --listen=* | --data_lane_listen=* | --validation) ;;
    --*=/*)
      path=${arg#*=}
      if [[ -f $path ]]; then
        copy="$files/$(basename "$path")"
        install -m 0644 "$path" "$copy"
        mounts+=(-v "$copy:$path:ro")
      fi
      args+=("$arg")
      ;;
    *) args+=("$arg") ;;
  esac
done
grpc_port=$(free_port)
lane_port=$(free_port)
cid=$(podman run -d --health-interval=disable -p "127.0.0.1:$grpc_port:50051" -p "127.0.0.1:$lane_port:50052" \
  "${mounts[@]}" -e "KVCACHED_DATA_LANE_ADVERTISE=127.0.0.1:$lane_port" "$image" "${args[@]}")
cleanup() {
  podman rm -f "$cid" >/dev/null 2>&1 || true
  rm -rf "$files"
}
trap cleanup EXIT
trap 'podman kill --signal TERM "$cid" >/dev/null 2>&1 || true' TERM INT
podman logs -f "$cid" 2>&1 \
  | sed -u "s/listening on 0\.0\.0\.0:50051/listening on 127.0.0.1:$grpc_port/" >&2 &
podman wait "$cid" >"$files/exit_code" &
waiter=$!
# `wait` returns early when a trapped signal arrives; wait again until podman's does.
until wait "$waiter"; do kill -0 "$waiter" 2>/dev/null || break; done
exit "$(cat "$files/exit_code")"
