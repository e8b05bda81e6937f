#!/usr/bin/env bash
# Runs the whole test suite against a real Redis. Extra arguments go to pytest.
#
# Uses KUMIKO_TEST_REDIS_URL (default redis://127.0.0.1:6379/15). When that is
# the default and nothing answers on 127.0.0.1:6379, it installs redis-server
# (apt-get, as root) if needed and starts one. If Redis still does not answer,
# it fails: the tests never skip for a missing Redis. The servers and the browser some tests
# start themselves (redis-sentinel; Debian's chromium and its chromedriver) are installed the
# same way when missing: those tests fail, never skip, without them.
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$ROOT"

export KUMIKO_TEST_REDIS_URL="${KUMIKO_TEST_REDIS_URL:-redis://127.0.0.1:6379/15}"
if ! redis_answers "$KUMIKO_TEST_REDIS_URL"; then
    if [ "$KUMIKO_TEST_REDIS_URL" != "redis://127.0.0.1:6379/15" ]; then
        echo "kumiko: no Redis answers at $KUMIKO_TEST_REDIS_URL" >&2
        exit 1
    fi
    ensure_redis_server
    echo "kumiko: starting redis-server on 127.0.0.1:6379" >&2
    mkdir -p /tmp/kumiko-redis
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
        --dir /tmp/kumiko-redis --logfile /tmp/kumiko-redis/redis.log
    for _ in $(seq 1 100); do
        redis_answers "$KUMIKO_TEST_REDIS_URL" && break
        sleep 0.1
    done
    redis_answers "$KUMIKO_TEST_REDIS_URL" || { echo "kumiko: redis-server did not start" >&2; exit 1; }
fi

command -v redis-sentinel >/dev/null 2>&1 || apt_install redis-sentinel
command -v redis-cli >/dev/null 2>&1 || apt_install redis-tools
command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 \
    || apt_install chromium chromium-driver

"$PY" -m pytest "$@"
