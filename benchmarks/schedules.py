"""Runtime schedules under load (issue 51).

``python -m benchmarks.schedules [--schedules 10000] [--schedulers 3] [--idle-s 5]``

On a private redis-server (no disk):

- **due together**: ``--schedules`` runtime schedules ``Cron("* * * * *")`` (every one due at
  the same minute), fired by ``--schedulers`` ``kumiko-scheduler`` processes: when each tick was
  enqueued after its time (the message's timestamp less its ``scheduled_at``): p50, p99, max
  (the target: every one within 2 s); that each tick is enqueued once (one message per
  schedule); the slowest Redis command meanwhile (``SLOWLOG``, the target: none over 5 ms);
  and the Redis CPU per tick beside the Redis CPU per plain ``dispatch`` of as many messages
  (the target: <= 2x).
- **idle**: the same schedules, none due (a cron a year ahead), one scheduler for
  ``--idle-s`` seconds: commands per second Redis ran for it, and its CPU per second (the
  target: O(due), the same with 10 schedules as with 10,000).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import redis

from benchmarks.cron_app import registry
from benchmarks.harness import percentile
from examples.redis_server import private_redis
from kumiko_dramatiq import Cron, JobRunner

JOB = "bench:job:tick"
ROOT = Path(__file__).resolve().parent.parent


def server_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def commands(client: redis.Redis) -> int:
    stats: Any = client.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


def schedulers(url: str, prefix: str, count: int) -> list[subprocess.Popen[bytes]]:
    env = {
        **os.environ,
        "KUMIKO_APP": "benchmarks.cron_app:registry",
        "KUMIKO_REDIS_URL": url,
        "KUMIKO_QUEUE_PREFIX": prefix,
        "PYTHONPATH": str(ROOT),
    }
    return [
        subprocess.Popen(
            [sys.executable, "-m", "kumiko_dramatiq.scheduler"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.wait(timeout=60)


def upsert(runner: JobRunner, count: int, cron: Cron) -> None:
    for n in range(count):
        runner.schedules.upsert(f"s{n}", JOB, cron=cron, payload={"n": n})


def due_together(url: str, count: int, procs_count: int) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    prefix = "due"
    runner = JobRunner(registry, redis_url=url, queue_prefix=prefix)
    # the code-declared cron of the app ticks every second: paused, to measure the schedules
    runner.schedules.pause(JOB)
    procs = schedulers(url, prefix, procs_count)
    upsert(runner, count, Cron("* * * * *"))
    first = runner.schedules.get("s0").next_fire
    assert first is not None
    target, expected = first.timestamp(), count
    if target - time.time() < 5:  # too close to measure from before it: the minute after
        target, expected = target + 60, 2 * count
    time.sleep(max(0.0, target - 2 - time.time()))
    client.config_set("slowlog-log-slower-than", 1000)
    client.slowlog_reset()
    cpu_before = server_cpu(client)
    messages = f"dramatiq:{prefix}-worker.msgs"

    def of_target() -> list[dict[str, Any]]:
        found = []
        for raw in client.hvals(messages):
            message = json.loads(raw)
            tick = datetime.fromisoformat(message["options"]["kumiko_scheduled_at"])
            if tick.timestamp() == target:
                found.append(message)
        return found

    deadline = time.monotonic() + 60
    while client.hlen(messages) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)  # any tick enqueued twice would show by now
    cpu_s = server_cpu(client) - cpu_before
    slowest = max((entry["duration"] for entry in client.slowlog_get(128)), default=0)
    stop(procs)
    found = of_target()
    lags_ms = [m["message_timestamp"] - target * 1000 for m in found]
    ids = [m["message_id"] for m in found]
    runner.stop()
    return {
        "enqueued": len(ids),
        "distinct": len(set(ids)),
        "lag_p50_ms": statistics.median(lags_ms) if lags_ms else 0,
        "lag_p99_ms": percentile(lags_ms, 99) if lags_ms else 0,
        "lag_max_ms": max(lags_ms, default=0),
        "slowest_ms": slowest / 1000,
        "cpu_per_tick_us": cpu_s / max(1, len(ids)) * 1e6,
    }


def plain_dispatch_cpu(url: str, count: int) -> float:
    client = redis.Redis.from_url(url)
    runner = JobRunner(registry, redis_url=url, queue_prefix="plain")
    runner.dispatch(JOB, {"n": -1})
    before = server_cpu(client)
    for n in range(count):
        runner.dispatch(JOB, {"n": n})
    spent = server_cpu(client) - before
    runner.stop()
    return spent / count * 1e6


def idle(url: str, count: int, seconds: float) -> tuple[float, float]:
    client = redis.Redis.from_url(url)
    client.flushall()
    prefix = "idle"
    runner = JobRunner(registry, redis_url=url, queue_prefix=prefix)
    upsert(runner, count, Cron("0 0 1 1 *"))
    runner.schedules.pause(JOB)
    (proc,) = schedulers(url, prefix, 1)
    time.sleep(3)  # started
    calls, cpu = commands(client), server_cpu(client)
    time.sleep(seconds)
    calls, cpu = commands(client) - calls, server_cpu(client) - cpu
    stop([proc])
    runner.stop()
    return calls / seconds, cpu / seconds * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--schedulers", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=5.0)
    options = parser.parse_args()
    with private_redis("--save", "") as url:
        found = due_together(url, options.schedules, options.schedulers)
        plain = plain_dispatch_cpu(url, options.schedules)
        print(
            f"{options.schedules:,} schedules due at the same minute, {options.schedulers} "
            f"schedulers: {found['enqueued']:,} ticks enqueued ({found['distinct']:,} distinct); "
            f"after their time p50 {found['lag_p50_ms']:.0f} ms, p99 {found['lag_p99_ms']:.0f} "
            f"ms, max {found['lag_max_ms']:.0f} ms; slowest command {found['slowest_ms']:.2f} ms"
        )
        print(
            f"Redis CPU per tick {found['cpu_per_tick_us']:.1f} µs vs per plain dispatch "
            f"{plain:.1f} µs = {found['cpu_per_tick_us'] / plain:.2f}x"
        )
        for count in (10, options.schedules):
            per_s, cpu_ms = idle(url, count, options.idle_s)
            print(
                f"idle scheduler, {count:,} schedules none due: {per_s:.1f} commands/s, "
                f"Redis CPU {cpu_ms:.2f} ms/s"
            )


if __name__ == "__main__":
    main()
