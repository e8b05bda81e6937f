"""Priorities and fair keys at the claim (issue 50).

``python -m benchmarks.priorities [--backlog 1000000] [--keys 1000] [--jobs 10000] [--rounds 3]``

On a private redis-server (no disk), one worker process of this one:

- **urgent behind a backlog**: ``--backlog`` no-op messages of priority 5 wait; a worker of 2
  threads drains them; every 50 ms a message of priority 0 is dispatched, 100 times: how long
  from its dispatch to its start (the start hook), p50 and p99 (the target: p99 <= 50 ms with
  a thread free).
- **one round**: ``--backlog`` messages of one fair key, then one message each of ``--keys``
  other keys, a worker of one thread: for each of the ``--keys``, how many messages started
  before it (the target: <= ``--keys``: one round), and the slowest Redis command meanwhile
  (``SLOWLOG``, the target: none over 5 ms).
- **Redis CPU per job**: ``--jobs`` no-op jobs enqueued then drained by a worker of 8 threads,
  plain (priority 0, no key) beside the same jobs with priority 3 and a fair key out of 10 and
  out of 10,000 keys, alternating for ``--rounds`` rounds; the server's CPU (``INFO cpu``) per
  job, medians, and the ratio to plain (the target: <= 1.15x; the same figure at 10 and 10,000
  keys shows the claim's cost does not grow with the keys).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import redis

from benchmarks.harness import percentile
from examples.redis_server import private_redis
from kumiko_dramatiq import Feature, JobContext, JobMeta, JobRunner, Registry
from kumiko_dramatiq.runner import DISPATCH_BATCH

JOB = "bench:job:noop"
URGENT = "bench:job:urgent"


class Starts:
    """The start hook: when each message started, and in what order."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.order: list[str] = []
        self.at: dict[str, float] = {}

    def on_job_start(self, job_name: str, message_id: str, meta: JobMeta) -> None:
        with self.lock:
            self.at[message_id] = time.perf_counter()
            self.order.append(message_id)
            self.lock.notify_all()

    def wait(self, message_ids: set[str], timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while not message_ids <= self.at.keys():
                if not self.lock.wait(deadline - time.monotonic()):
                    raise TimeoutError(f"{len(message_ids - self.at.keys())} never started")


def registry() -> Registry:
    bench = Feature("bench")

    @bench.job("noop", priority=5)
    def noop(payload: dict[str, Any], ctx: JobContext) -> None: ...

    @bench.job("urgent", priority=0)
    def urgent(payload: dict[str, Any], ctx: JobContext) -> None: ...

    return Registry([bench])


def server_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def fill(runner: JobRunner, count: int, **order: Any) -> None:
    payloads: list[dict[str, Any]] = [{}] * DISPATCH_BATCH
    for start in range(0, count, DISPATCH_BATCH):
        runner.dispatch_many(JOB, payloads[: min(DISPATCH_BATCH, count - start)], **order)


def urgent_behind(url: str, backlog: int, samples: int = 100) -> list[float]:
    starts = Starts()
    runner = JobRunner(
        registry(),
        redis_url=url,
        queue_prefix="urgent",
        worker_threads=2,
        on_job_start=starts.on_job_start,
    )
    fill(runner, backlog)
    runner.start()
    waits = []
    for _ in range(samples):
        sent = time.perf_counter()
        message_id = runner.dispatch(URGENT)
        starts.wait({message_id})
        waits.append((starts.at[message_id] - sent) * 1000)
        time.sleep(0.05)
    runner.stop()
    return waits


def one_round(url: str, backlog: int, keys: int) -> tuple[int, float]:
    client = redis.Redis.from_url(url)
    starts = Starts()
    runner = JobRunner(
        registry(),
        redis_url=url,
        queue_prefix="round",
        worker_threads=1,
        on_job_start=starts.on_job_start,
    )
    fill(runner, backlog, fair_key="flood")
    others = {runner.dispatch(JOB, fair_key=f"tenant-{n}") for n in range(keys)}
    client.config_set("slowlog-log-slower-than", 1000)
    client.slowlog_reset()
    runner.start()
    starts.wait(others)
    runner.stop()
    before = max(starts.order.index(message_id) for message_id in others)
    slowest = max((entry["duration"] for entry in client.slowlog_get(128)), default=0)
    return before, slowest / 1000


def cpu_per_job(url: str, jobs: int, keys: int | None) -> float:
    client = redis.Redis.from_url(url)
    client.flushall()
    starts = Starts()
    runner = JobRunner(
        registry(),
        redis_url=url,
        queue_prefix="cpu",
        worker_threads=8,
        on_job_start=starts.on_job_start,
    )
    ids: set[str] = set()
    began = server_cpu(client)
    for start in range(0, jobs, DISPATCH_BATCH):
        size = min(DISPATCH_BATCH, jobs - start)
        for n in range(size):  # one dispatch each, the keys spread over every claim
            if keys is None:
                ids.add(runner.dispatch(JOB, priority=0))
            else:
                ids.add(runner.dispatch(JOB, priority=3, fair_key=f"k{(start + n) % keys}"))
    runner.start()
    starts.wait(ids)
    runner.drain(timeout_s=120)
    spent = server_cpu(client) - began
    runner.stop()
    return spent / jobs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    with private_redis("--save", "") as url:
        waits = urgent_behind(url, options.backlog)
        print(
            f"priority 0 behind {options.backlog:,} of priority 5: start after "
            f"p50 {statistics.median(waits):.1f} ms, p99 {percentile(waits, 99):.1f} ms"
        )
        redis.Redis.from_url(url).flushall()
        before, slowest_ms = one_round(url, options.backlog, options.keys)
        print(
            f"{options.backlog:,} of one key, 1 each of {options.keys:,} others: the last of "
            f"them started after {before:,} others; slowest command {slowest_ms:.2f} ms"
        )
        plain, ten, many = [], [], []
        for _ in range(options.rounds):
            plain.append(cpu_per_job(url, options.jobs, None))
            ten.append(cpu_per_job(url, options.jobs, 10))
            many.append(cpu_per_job(url, options.jobs, 10_000))
        base = statistics.median(plain)
        print(f"Redis CPU per job, {options.jobs:,} jobs x {options.rounds} rounds (µs):")
        print(f"  plain {base:.1f}")
        for label, found in (("10 keys", ten), ("10,000 keys", many)):
            value = statistics.median(found)
            print(f"  priority 3, {label}: {value:.1f} = {value / base:.2f}x")


if __name__ == "__main__":
    main()
