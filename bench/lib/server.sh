# Sourced by the bench scripts (from the repository root): kvcached servers
# started in the background, waited for until they listen, and stopped when the
# script exits, however it exits.
#
#   source bench/lib/server.sh
#   on_exit cleanup                   # the script's own cleanup, run after
#                                     # its servers are stopped
#   start_kvcached "$work/kvcached.log" "$KVCACHED" --listen=127.0.0.1:0 ... || exit 1
#   ... "$kvcached_address" ...       # where it listens, from its log
#   stop_kvcached "$kvcached_pid"     # or stop_all_kvcached, or leave them
#                                     # to the exit trap
#
# The server's stdout and stderr go to its log; it is up when it logs
# "listening on ADDRESS", its last line of start-up (server/kv_server.cc).
# Sourcing it sets the EXIT trap: a script adds its own steps with on_exit
# rather than a trap of its own, which would leave its servers running.

# Every server started and not yet stopped.
kvcached_pids=()
# Functions to run at exit, in order, after the servers are stopped.
kvcached_exit_steps=()

# How long a server may take to listen: 600 x 0.1 s.
KVCACHED_START_TRIES=600

# on_exit FUNCTION: runs FUNCTION when the script exits, after its servers.
on_exit() {
  kvcached_exit_steps+=("$1")
}

kvcached_at_exit() {
  # Under set -e a failing step here would replace the script's exit status.
  stop_all_kvcached || true
  local step
  for step in "${kvcached_exit_steps[@]}"; do "$step" || true; done
}
trap kvcached_at_exit EXIT

# start_kvcached LOG BINARY [FLAGS...]: starts BINARY FLAGS... with its output
# in LOG and waits until it listens. Sets `kvcached_pid` and `kvcached_address`
# (host:port). Returns 1, its log printed to stderr, when it exits or has not
# listened within KVCACHED_START_TRIES tenths of a second.
start_kvcached() {
  local log=$1
  shift
  "$@" >"$log" 2>&1 &
  kvcached_pid=$!
  kvcached_pids+=("$kvcached_pid")
  kvcached_address=""
  local try
  for ((try = 0; try < KVCACHED_START_TRIES; try++)); do
    kvcached_address=$(sed -n 's/.*listening on \([^ ]*\).*/\1/p' "$log" | head -n 1)
    [[ -n $kvcached_address ]] && return 0
    kill -0 "$kvcached_pid" 2>/dev/null || break
    sleep 0.1
  done
  cat "$log" >&2
  echo "$1 exited or did not listen within $((KVCACHED_START_TRIES / 10)) s (its log is above)" >&2
  return 1
}

# stop_kvcached PID...: stops those servers with SIGTERM and waits for them.
# Returns 1 when one exited other than 0 (a graceful shutdown exits 0).
stop_kvcached() {
  local pid status=0
  for pid in "$@"; do kill "$pid" 2>/dev/null || true; done
  for pid in "$@"; do wait "$pid" 2>/dev/null || status=1; done
  local running=()
  for pid in "${kvcached_pids[@]}"; do
    [[ " $* " == *" $pid "* ]] || running+=("$pid")
  done
  kvcached_pids=("${running[@]}")
  return "$status"
}

# stop_all_kvcached: stop_kvcached for every server started and not stopped.
stop_all_kvcached() {
  stop_kvcached "${kvcached_pids[@]}"
}
