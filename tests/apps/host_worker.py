"""One "host" of the several-hosts test: a worker process run inside a network namespace.

``python -m tests.apps.host_worker LOG RELEASE`` with ``KUMIKO_REDIS_URL`` and
``KUMIKO_QUEUE_PREFIX`` set. It starts a runner (short heartbeat timeout and lock TTL, read
from ``HOST_HEARTBEAT_TIMEOUT_MS`` / ``HOST_LOCK_TTL_MS``) and appends to LOG, one line each,
flushed at once (the test reads it while this process runs, even while this host is cut
off from Redis)::

    ready <hostname> <broker id>
    start <message id> <job> <epoch s>
    end <message id> <job> <epoch s>

A job whose payload has ``"hold": true`` runs until the file RELEASE exists (the work it
simulates; polled every 20 ms), ``"hold": "NAME"`` until ``RELEASE.NAME`` exists.
``"sleep_ms"`` makes a job take that long. It stops on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry


def registry_of(log: Path, release: Path) -> Registry:
    lock = threading.Lock()

    def write(line: str) -> None:
        with lock, log.open("a") as out:
            out.write(line + "\n")
            out.flush()

    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        write(f"start {ctx.message_id} {ctx.job_name} {time.time():.6f}")
        hold = payload.get("hold")
        if hold:
            until = release if hold is True else release.with_name(f"{release.name}.{hold}")
            while not until.exists():
                time.sleep(0.02)
        sleep_ms = payload.get("sleep_ms")
        if isinstance(sleep_ms, int):
            time.sleep(sleep_ms / 1000)
        write(f"end {ctx.message_id} {ctx.job_name} {time.time():.6f}")

    hosts = Feature("hosts")
    hosts.job("work")(work)
    hosts.job("seq", concurrency="sequential")(work)
    return Registry([hosts])


def main() -> int:
    log, release = Path(sys.argv[1]), Path(sys.argv[2])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())

    runner = JobRunner(
        registry_of(log, release),
        worker_threads=int(os.environ.get("HOST_THREADS", "4")),
        heartbeat_timeout_ms=int(os.environ["HOST_HEARTBEAT_TIMEOUT_MS"]),
        lock_ttl_ms=int(os.environ["HOST_LOCK_TTL_MS"]),
        sequential_retry_delay_ms=100,
        boot_redis_timeout_ms=2_000,
    )
    runner.start()
    with log.open("a") as out:
        out.write(f"ready {socket.gethostname()} {runner.broker.broker_id}\n")
    stop.wait()
    runner.stop(timeout_s=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
