#!/usr/bin/env bash
# The billing example end to end: a worker, dispatches, visible retries.
# Without KUMIKO_REDIS_URL it runs its own private redis-server (installed with
# apt-get if missing) on a free port and removes it afterwards.
source "$(dirname "${BASH_SOURCE[0]}")/../tests/bootstrap.sh"
cd "$ROOT"
[ -n "${KUMIKO_REDIS_URL:-}" ] || ensure_redis_server
exec "$PY" -m examples.demo "$@"
