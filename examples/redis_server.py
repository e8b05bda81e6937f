"""A throwaway ``redis-server`` for the demo, the benchmarks and the soak.

Never the machine's own Redis: the soak kills client connections and the
benchmarks read ``INFO commandstats``, so each gets a private server on a free
port of 127.0.0.1, with nothing saved to disk, removed afterwards.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis


@contextmanager
def private_redis(*extra_args: str, workdir: Path | None = None) -> Iterator[str]:
    """Start ``redis-server`` (with ``extra_args``) and yield its URL; stop it after.

    Its data directory and log go to ``workdir`` when given (kept), else to a
    temporary directory (removed). Raises ``SystemExit`` with one line when
    ``redis-server`` is missing or does not start.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(
            "redis-server is not installed: apt-get install redis-server "
            "(examples/demo.sh and tests/run.sh do it for you)"
        )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    temporary = workdir is None
    base = Path(tempfile.mkdtemp(prefix="kumiko-redis-")) if workdir is None else workdir
    data = base / "redis"
    data.mkdir(exist_ok=True)
    with (base / "redis.log").open("wb") as log:
        server = subprocess.Popen(
            [
                *(binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""),
                *("--appendonly", "no", "--dir", str(data), *extra_args),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(
                        f"the private redis-server on port {port} did not start"
                    ) from None
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if temporary:
            shutil.rmtree(base, ignore_errors=True)
