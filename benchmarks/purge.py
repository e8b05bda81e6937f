"""Purge steps at 100,000 messages: ``python -m benchmarks.purge [--messages 100000] [--runs 3]``.

Each run starts a private redis-server (``SLOWLOG`` of every command) and, for each case,
fills it through the public API, then purges through the public API (``purge --dry-run``,
then ``purge``) and reads every ``purge_step`` call's duration from the ``SLOWLOG``:

- ``queued``: ``--messages`` messages of the job on its lane's queue, each with a dedup key
  (the worst case: every removal frees one), beside as many of another job of the lane;
- ``delayed``: ``--messages`` keyed messages of the job delayed by an hour;
- ``capwait``: ``--messages`` keyed messages waiting for the job's cap
  (:func:`benchmarks.capwait.build`);
- ``queued, 20 KB payloads``: ``--messages // 10`` keyed messages of 20 KB each (the step's
  byte budget, not its entry count, bounds these steps).

Target (issue 33): no single command over 5 ms. Prints, per case and action, the number of
steps, their median, 99th percentile and maximum, how many took over 5 ms, how many
*stalled* (one of the O(1) commands the step ran took over :data:`STALL_US`: Redis was
descheduled inside it) and the slowest of the steps that did not, the slowest command, and
the load average before and after. ``--redis-nice -10`` runs the redis-server at that nice value
(root only): on a machine shared with other work, the scheduler then preempts Redis less
often (as a Redis on its own core would not be), which separates a step's own cost from
the time Redis spent descheduled inside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import redis

from examples.redis_server import private_redis
from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry

from . import capwait
from .run import machine

PREFIX = "bench"
JOB = "bench:job:work"
OTHER = "bench:job:other"
HOUR_MS = 3_600_000


def registry() -> Registry:
    feature = Feature("bench")

    @feature.job("work")
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    @feature.job("other")
    def other(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    return Registry([feature])


def fill(
    runner: JobRunner,
    job: str,
    count: int,
    *,
    keyed: bool = True,
    delay_ms: int | None = None,
    pad: int = 0,
) -> None:
    filler = "x" * pad
    for start in range(0, count, 1_000):
        n = min(1_000, count - start)
        payloads = [{"n": start + i, "pad": filler} for i in range(n)]
        runner.dispatch_many(
            job,
            payloads,
            dedup_keys=[f"{job}:{start + i}" for i in range(n)] if keyed else None,
            delay_ms=delay_ms,
        )


#: An inner command of a step that took this long stalled: each is O(1) on a small key (a
#: body, a dedup record), which takes microseconds; only the process being descheduled (a
#: shared machine, a VM's stolen time) makes one take a millisecond.
STALL_US = 1_000


def step_times_us(client: redis.Redis, sha: str) -> tuple[list[tuple[int, int]], int, str]:
    """The ``purge_step`` calls in the SLOWLOG, each as (its duration, its slowest inner
    command's), and the slowest other command (its duration and name). Redis 7 logs the
    commands a script runs, each just before the script (by entry id)."""
    steps: list[tuple[int, int]] = []
    inner: list[int] = []
    other_us, other = 0, "-"
    entries = client.slowlog_get(10_000_000)
    for entry in sorted(entries, key=lambda e: int(e["id"])):
        command = entry["command"]
        words = command.split() if isinstance(command, bytes | str) else list(command)
        words = [w.decode(errors="replace") if isinstance(w, bytes) else str(w) for w in words]
        duration = int(entry["duration"])
        name = words[0].lower() if words else ""
        if name == "evalsha" and len(words) > 1 and words[1] == sha:
            steps.append((duration, max(inner, default=0)))
            inner = []
            continue
        if name in ("evalsha", "eval", "fcall", "function", "script", "slowlog"):
            inner = []
        else:
            inner.append(duration)
        if name != "slowlog" and duration > other_us:
            other_us, other = duration, " ".join(words[:2])[:60]
    return steps, other_us, other


def measure(client: redis.Redis, sha: str, action: Callable[[], int]) -> dict[str, Any]:
    client.slowlog_reset()
    began = time.perf_counter()
    result = action()
    wall_s = time.perf_counter() - began
    steps, other_us, other = step_times_us(client, sha)
    times = sorted(duration for duration, _ in steps)
    clean = [duration for duration, worst_inner in steps if worst_inner < STALL_US]
    return {
        "result": result,
        "wall_s": wall_s,
        "steps": len(times),
        "median_ms": statistics.median(times) / 1000 if times else 0.0,
        "p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))] / 1000 if times else 0.0,
        "max_ms": times[-1] / 1000 if times else 0.0,
        "over_5ms": sum(1 for t in times if t > 5_000),
        "stalled": len(steps) - len(clean),
        "max_clean_ms": max(clean, default=0) / 1000,
        "other_ms": other_us / 1000,
        "other": other,
    }


def one_run(messages: int, nice: int | None) -> list[tuple[str, str, dict[str, Any]]]:
    rows: list[tuple[str, str, dict[str, Any]]] = []

    def queued(runner: JobRunner, client: redis.Redis) -> None:
        fill(runner, JOB, messages)
        fill(runner, OTHER, messages, keyed=False)

    cases: list[tuple[str, str, Callable[[JobRunner, redis.Redis], None], str]] = [
        ("queued", "queued", queued, JOB),
        ("delayed", "delayed", lambda r, c: fill(r, JOB, messages, delay_ms=HOUR_MS), JOB),
        ("capwait", "queued", lambda r, c: None, capwait.JOB),
        (
            "queued, 20 KB payloads",
            "queued",
            lambda r, c: fill(r, JOB, messages // 10, pad=20_000),
            JOB,
        ),
    ]
    for name, state, setup, job in cases:
        with private_redis(
            "--slowlog-log-slower-than", "0", "--slowlog-max-len", "10000000"
        ) as url:
            client = redis.Redis.from_url(url)
            if nice is not None:
                pid = int(client.info("server")["process_id"])
                os.setpriority(os.PRIO_PROCESS, pid, nice)
            if name == "capwait":
                runner = JobRunner(capwait.registry(), redis_url=url, queue_prefix=PREFIX)
                capwait.build(runner, client, messages)
            else:
                runner = JobRunner(registry(), redis_url=url, queue_prefix=PREFIX)
                setup(runner, client)
            sha = runner.broker.lua.purge_step.sha
            for action, dry in (("purge --dry-run", True), ("purge", False)):
                rows.append(
                    (
                        name,
                        action,
                        measure(
                            client,
                            sha,
                            lambda: runner.purge(job, state=state, dry_run=dry),  # noqa: B023
                        ),
                    )
                )
            runner.broker.close()
            client.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--redis-nice", type=int, default=None)
    args = parser.parse_args(argv)
    print(f"machine: {machine()}; redis-server nice: {args.redis_nice or 0}")
    print(
        "| run | case | action | result | steps | median | p99 | max | steps > 5 ms "
        "| stalled steps | max of the others | slowest command | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in range(1, args.runs + 1):
        before = os.getloadavg()[0]
        rows = one_run(args.messages, args.redis_nice)
        after = os.getloadavg()[0]
        for name, action, m in rows:
            print(
                f"| {run} | {name} | `{action}` | {m['result']:,} | {m['steps']:,} | "
                f"{m['median_ms']:.2f} ms | {m['p99_ms']:.2f} ms | {m['max_ms']:.2f} ms | "
                f"{m['over_5ms']} | {m['stalled']} | {m['max_clean_ms']:.2f} ms | "
                f"{m['other_ms']:.2f} ms ({m['other']}) | {before:.1f}-{after:.1f} |"
            )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
