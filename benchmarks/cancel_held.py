"""How long ``cancel`` of a message a worker holds ahead of its threads takes (issue 47).

``python -m benchmarks.cancel_held [--rounds 3] [--threads 8]``

A CLI worker of ``--threads`` threads (``tests/apps/hold_app.py``) runs as many messages that
block and holds as many more ahead of them; then each held message is cancelled, one after the
other, with the worker **alive** (it answers the ask), **frozen** (``SIGSTOP``: it cannot
answer; the requester takes the message over once the worker's hold ran out) or **killed**
(``SIGKILL``). Reported per case: the cancels' p50, p99 and worst (ms), and that each returned
True and none of the cancelled messages ever started (the worker is let go afterwards and
drains the rest). The contract's bound: 2 s (p99).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

from kumiko_dramatiq import JobRunner
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.testing import private_redis_server
from tests.apps import hold_app

ROOT = Path(__file__).resolve().parents[1]
JOB = "hold:job:work"


def _wait(predicate: object, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def one_round(url: str, fault: str, threads: int) -> tuple[list[float], list[str]]:
    prefix = f"ch{uuid.uuid4().hex[:6]}"
    client = redis.Redis.from_url(url)
    producer = JobRunner(hold_app.registry, redis_url=url, queue_prefix=prefix)
    for _ in range(threads):
        producer.dispatch(JOB, {"block": True})
    held = [producer.dispatch(JOB) for _ in range(threads)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT),
        KUMIKO_APP="tests.apps.hold_app:registry",
        KUMIKO_REDIS_URL=url,
        KUMIKO_QUEUE_PREFIX=prefix,
        KUMIKO_HEARTBEAT_TIMEOUT_MS="1000",
    )
    command = [
        sys.executable,
        "-m",
        "dramatiq",
        "kumiko_dramatiq.app",
        "-p",
        "1",
        "-t",
        str(threads),
    ]

    def start_worker() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    worker = start_worker()
    started = f"kumiko:{prefix}:test:started"
    problems: list[str] = []
    took: list[float] = []
    try:
        _wait(lambda: client.llen(started) == threads, "the blocking runs")
        _wait(
            lambda: (
                sum(text(v).startswith("h") for v in client.hvals(keys.inflight(prefix))) == threads
            ),
            "the held messages",
        )
        if fault != "alive":
            os.killpg(worker.pid, signal.SIGSTOP if fault == "frozen" else signal.SIGKILL)
        for message_id in held:
            began = time.monotonic()
            if producer.cancel(message_id) is not True:
                problems.append(f"cancel of {message_id} was not True")
            took.append((time.monotonic() - began) * 1000)
        if fault == "frozen":
            os.killpg(worker.pid, signal.SIGCONT)
        client.set(f"kumiko:{prefix}:test:release", 1)
        if fault == "killed":
            worker.wait()
            worker = start_worker()
        _wait(
            lambda: (
                client.llen(started) >= (2 * threads if fault == "killed" else threads)
                and not client.hlen(keys.inflight(prefix))
            ),
            "the drain",
        )
        ran = {text(m) for m in client.lrange(started, 0, -1)}
        problems += [f"{m} started after its cancel" for m in held if m in ran]
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGCONT)
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=30)
        producer.stop()
    return took, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args(argv)
    print("| holder | cancels | p50 ms | p99 ms | worst ms | all True, none started |")
    print("|---|---|---|---|---|---|")
    with private_redis_server() as url:
        for fault in ("alive", "frozen", "killed"):
            took: list[float] = []
            problems: list[str] = []
            for _ in range(args.rounds):
                each, found = one_round(url, fault, args.threads)
                took += each
                problems += found
            took.sort()
            p99 = took[min(len(took) - 1, int(len(took) * 0.99))]
            print(
                f"| {fault} | {len(took)} | {statistics.median(took):.1f} | {p99:.1f} |"
                f" {took[-1]:.1f} | {'yes' if not problems else '; '.join(problems[:3])} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
