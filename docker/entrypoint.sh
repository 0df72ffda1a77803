#!/bin/sh
# The container's entry point: kvcached with a flag for each KVCACHED_<FLAG>
# environment variable (KVCACHED_POOL_BYTES=1073741824 -> --pool_bytes=1073741824),
# then the container's own arguments, which win. An unknown name is refused
# by kvcached itself, naming the flag. exec: kvcached is the process that
# gets the orchestrator's SIGTERM and drains.
set -eu
flags=""
for name in $(env | sed -n 's/^KVCACHED_\([A-Z0-9_]*\)=.*/\1/p'); do
  case "$name" in
    PROBE_*) continue ;;  # the health check's own (healthcheck.sh)
  esac
  flag=$(echo "$name" | tr 'A-Z' 'a-z')
  eval "value=\${KVCACHED_$name}"
  flags="$flags --$flag=$value"
done
# Word splitting on purpose: values are flags' values (sizes, addresses,
# paths), never spaces.
# shellcheck disable=SC2086
exec /usr/local/bin/kvcached $flags "$@"
