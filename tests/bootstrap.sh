# Sourced by tests/run.sh and examples/demo.sh: a project venv with the package
# installed (editable, with the dev extra), and a way to get redis-server.
# Works on a fresh Debian/Ubuntu machine; installs with apt-get when run as root.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

apt_install() {
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "kumiko: please install $* (needs root and apt-get to do it for you)" >&2
        exit 1
    fi
    echo "kumiko: installing $* with apt-get" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if [ ! -x "$PY" ]; then
    base="${PYTHON:-python3}"
    command -v "$base" >/dev/null 2>&1 || apt_install python3 python3-venv
    if ! "$base" -m venv "$VENV" >/dev/null 2>&1; then
        rm -rf "$VENV"
        apt_install python3-venv
        "$base" -m venv "$VENV"
    fi
fi

stamp="$VENV/.kumiko-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
    echo "kumiko: installing the package and its dev tools into .venv" >&2
    log="$VENV/pip-install.log"
    if ! { "$PY" -m pip install --upgrade pip && "$PY" -m pip install -e "$ROOT[dev]"; } >"$log" 2>&1; then
        cat "$log" >&2
        echo "kumiko: pip install failed (log above)" >&2
        exit 1
    fi
    touch "$stamp"
fi

ensure_redis_server() {
    command -v redis-server >/dev/null 2>&1 || apt_install redis-server
}

redis_answers() {
    "$PY" - "$1" <<'PYEOF'
import sys, redis
try:
    redis.Redis.from_url(sys.argv[1], socket_connect_timeout=1).ping()
except Exception:
    sys.exit(1)
PYEOF
}
