#!/usr/bin/env bash
# kvcached as a program that tests start (tests/e2e/python/interop_test.py
# --kvcached docker/podman-kvcached.sh), run in a container of $KVCACHED_IMAGE
# and reached through published ports only:
#   - --listen and --data_lane_listen are the container's own (0.0.0.0 inside),
#     published on free loopback ports; the lane's is given to clients with
#     --data_lane_advertise;
#   - --validation is dropped: the runtime image has no validation layers
#     (the same test runs with them outside the container);
#   - KV events on a loopback tcp endpoint bind the container's 5557 (replays
#     5558), published on free loopback ports;
#   - a flag naming a file (--tls_cert=/path) gets that file read-only at the
#     same path: the file itself where anyone may read it (so a file re-read
#     on SIGHUP is seen as changed in place), else a copy of it owned by the
#     image's unprivileged user (a key stays mode 600);
#   - the log goes to stderr as kvcached writes it, except that "listening on"
#     and the KV event endpoints name the published addresses;
#   - SIGTERM, SIGINT and SIGHUP go to kvcached; the exit code is kvcached's.
set -euo pipefail
image=${KVCACHED_IMAGE:?"KVCACHED_IMAGE: the image to run"}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
files=$(mktemp -d)
cid=""
cleanup() {
  if [[ -n $cid ]]; then podman rm -f "$cid" >/dev/null 2>&1 || true; fi
  rm -rf "$files"  # copies of private files among them
}
trap cleanup EXIT
args=()
mounts=()
ports=()
renamed=()  # sed expressions: container endpoints -> published ones
publish_kv_events() {  # FLAG CONTAINER_PORT
  local port
  port=$(free_port)
  args+=("--$1=tcp://0.0.0.0:$2")
  ports+=(-p "127.0.0.1:$port:$2")
  renamed+=(-e "s|tcp://0\.0\.0\.0:$2|tcp://127.0.0.1:$port|g")
}
for arg in "$@"; do
  case "$arg" in
    --listen=* | --data_lane_listen=* | --validation) ;;
    --kv_events_endpoint=tcp://127.0.0.1:* | --kv_events_endpoint=tcp://localhost:*)
      publish_kv_events kv_events_endpoint 5557 ;;
    --kv_events_replay_endpoint=tcp://127.0.0.1:* | --kv_events_replay_endpoint=tcp://localhost:*)
      publish_kv_events kv_events_replay_endpoint 5558 ;;
    --*=/*)
      path=${arg#*=}
      if [[ -f $path && $(stat -L -c %A "$path") == ???????r?? ]]; then
        mounts+=(-v "$path:$path:ro")
      elif [[ -f $path ]]; then
        copy="$files/$(basename "$path")"
        cp -p "$path" "$copy"
        mounts+=(-v "$copy:$path:ro,U")  # U: owned by the container's user
      fi
      args+=("$arg")
      ;;
    *) args+=("$arg") ;;
  esac
done
# Bound beyond the container's loopback so that a published port reaches it.
if [[ ${#renamed[@]} -gt 0 ]]; then args+=(--kv_events_allow_remote); fi
grpc_port=$(free_port)
lane_port=$(free_port)
renamed+=(-e "s/listening on 0\.0\.0\.0:50051/listening on 127.0.0.1:$grpc_port/")
cid=$(podman run -d --health-interval=disable -p "127.0.0.1:$grpc_port:50051" -p "127.0.0.1:$lane_port:50052" \
  "${ports[@]}" "${mounts[@]}" -e "KVCACHED_DATA_LANE_ADVERTISE=127.0.0.1:$lane_port" \
  "$image" "${args[@]}")
trap 'podman kill --signal TERM "$cid" >/dev/null 2>&1 || true' TERM INT
trap 'podman kill --signal HUP "$cid" >/dev/null 2>&1 || true' HUP
podman logs -f "$cid" 2>&1 | sed -u "${renamed[@]}" >&2 &
podman wait "$cid" >"$files/exit_code" &
waiter=$!
# `wait` returns early when a trapped signal arrives; wait again until podman's does.
until wait "$waiter"; do kill -0 "$waiter" 2>/dev/null || break; done
exit "$(cat "$files/exit_code")"
