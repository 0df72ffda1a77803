#!/bin/sh
# The container's health check: kvcachectl health against the gRPC health
# service (exit 0 only while kvcached answers SERVING for
# kvcache.v1.KvCacheService; NOT_SERVING while it drains). It dials the port
# of KVCACHED_LISTEN on loopback; KVCACHED_PROBE_FLAGS adds kvcachectl flags
# where TLS is on (--tls_ca=..., --tls_server_name=..., and for mutual TLS
# --tls_cert/--tls_key).
set -eu
port=${KVCACHED_LISTEN##*:}
# shellcheck disable=SC2086
exec /usr/local/bin/kvcachectl --server="127.0.0.1:${port:-50051}" ${KVCACHED_PROBE_FLAGS:-} \
  health kvcache.v1.KvCacheService
