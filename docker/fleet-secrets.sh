#!/usr/bin/env bash
# Makes docker/secrets/tokens for compose.yaml: two tenants with fresh random
# tokens. The file holds only the tokens' SHA-256 (kvcached's tokens file
# takes `sha256=`), so it is no secret itself; the tokens are printed once,
# for the workers (KVCACHE_TOKEN) and the operator (admin).
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p secrets
digest() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
worker=$(openssl rand -hex 16)
ops=$(openssl rand -hex 16)
printf 'tenant=workers sha256=%s\ntenant=ops sha256=%s admin\n' \
  "$(digest "$worker")" "$(digest "$ops")" >secrets/tokens
chmod 0644 secrets/tokens
echo "workers' token: $worker"
echo "ops (admin) token: $ops"
