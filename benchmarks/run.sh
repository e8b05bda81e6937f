#!/usr/bin/env bash
# Runs every benchmark side by side with plain Dramatiq on a private redis-server.
# Extra arguments go to `python -m benchmarks.run` (--rounds, --messages, --only).
source "$(dirname "${BASH_SOURCE[0]}")/../tests/bootstrap.sh"
cd "$ROOT"
[ -n "${KUMIKO_REDIS_URL:-}" ] || ensure_redis_server
exec "$PY" -m benchmarks.run "$@"
