"""Redis CPU per job: kumiko vs plain Dramatiq on one private redis-server (issue 32).

``python -m benchmarks.redis_cost [--rounds 3] [--messages 10000] [--feature-messages 2000]
[--no-pin] [--job-ms 0] [--threads 8]`` (or ``bash benchmarks/run.sh --only redis_cost``)

Each round enqueues ``--messages`` no-op jobs (or jobs that wait ``--job-ms`` each), then
drains them with one worker of ``--threads`` threads (kumiko's queue as one in use: its per-job
counts made ready before the enqueue, so every enqueue and ack keeps them, not a one-off
backfill of the whole backlog at the worker's start); the server's own CPU (``INFO cpu``:
``used_cpu_user + used_cpu_sys``) is read before the enqueue, between enqueue and drain, and
once the queue's message hash is empty. Kumiko's plain case (no dedup key, not sequential, run
history and metrics on) and plain Dramatiq's ``RedisBroker`` run in alternating rounds; the
table reports medians per job, the ratio, the derived ceiling (jobs per second one Redis core
can serve: 1 s / CPU per job) and the drain's pace. Then the features, kumiko only, each
beside plain Dramatiq's plain case: a dedup key per dispatch, a sequential job (its waiting
runs' hand-offs included), per-tenant children (per child, the wrapper included) and a retry
(a first attempt that fails, retried at once; per job, both attempts included).

On a machine of two cores or more the server runs alone on the last core and this process
(the client and the worker's threads) on the others, as a deployment runs Redis apart from its
workers; ``--no-pin`` leaves both to the scheduler (then they take turns on one core's caches,
and the figures include that).

No-op jobs end in bursts, so each settle call acks several deliveries at once (about 7 of 8
threads' here) and its fixed cost is shared; jobs that take a while (``--job-ms 2``: the
threads end them one by one) are settled about two per call with 8 threads, the case of most
deployments, and its rows are the ones to size with. A settle carries the deliveries that end
while the previous call of its queue is out, so kumiko's cost per job falls as a worker's
threads grow (``--threads 32``); plain Dramatiq's, one ack per job, does not.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.worker import Worker

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.counts import backfill_counts
from kumiko_dramatiq.testing import private_redis_server

from .harness import Countdown, alternate
from .metrics import free_port

WORKER_THREADS = 8
WORKER_TIMEOUT_MS = 200
RESULTS = Path(__file__).resolve().parent / "results"


def server_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def command_usec(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """(calls, µs) per command from ``INFO commandstats``."""
    info = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(s["calls"]), int(s["usec"])) for name, s in info.items()
    }


@dataclass
class Sample:
    enqueue_us: float
    drain_us: float
    #: the drain's pace (the worker's start until the last job settled)
    drain_jobs_s: float = 0.0
    #: this process's CPU per job over the drain (the worker's threads, its client)
    worker_us: float = 0.0

    @property
    def total_us(self) -> float:
        return self.enqueue_us + self.drain_us


@dataclass
class Series:
    name: str
    samples: list[Sample] = field(default_factory=list)

    def median(self, part: str) -> float:
        return float(statistics.median(float(getattr(s, part)) for s in self.samples))


def wait_empty(client: redis.Redis, messages_key: str, timeout_s: float = 600) -> None:
    """Until the queue's message hash is empty (every message acked), polling gently."""
    deadline = time.monotonic() + timeout_s
    while client.hlen(messages_key):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{messages_key} not empty after {timeout_s}s")
        time.sleep(0.02)


class RedisCost:
    def __init__(
        self,
        url: str,
        messages: int,
        feature_messages: int,
        rounds: int,
        job_ms: float = 0,
        threads: int = WORKER_THREADS,
    ) -> None:
        self.url = url
        self.job_ms = job_ms
        self.threads = threads
        self.messages = messages
        self.feature_messages = feature_messages
        self.rounds = rounds
        self.client = redis.Redis.from_url(url)
        self.commands: dict[str, dict[str, list[float]]] = {}

    def flush(self) -> None:
        self.client.flushdb()

    def work(self) -> None:
        """A job's body: nothing, or ``job_ms`` of waiting (I/O, as a job that calls a
        service): then the threads end their jobs one by one, not in bursts."""
        if self.job_ms:
            time.sleep(self.job_ms / 1000)

    def _measure(
        self,
        name: str,
        n: int,
        enqueue: Callable[[], None],
        start: Callable[[], None],
        done: Callable[[], None],
        stop: Callable[[], None],
    ) -> Sample:
        c0 = server_cpu_s(self.client)
        enqueue()
        c1 = server_cpu_s(self.client)
        s1 = command_usec(self.client)
        started = time.monotonic()
        cpu0 = time.process_time()
        start()
        done()
        drained_s = time.monotonic() - started
        cpu1 = time.process_time()
        c2 = server_cpu_s(self.client)
        s2 = command_usec(self.client)
        stop()
        self.flush()
        delta = {
            cmd: (
                round((calls - s1.get(cmd, (0, 0))[0]) / n, 2),
                round((us - s1.get(cmd, (0, 0))[1]) / n, 1),
            )
            for cmd, (calls, us) in s2.items()
            if calls != s1.get(cmd, (0, 0))[0] and cmd not in {"info", "hlen"}
        }
        self.commands[name] = {k: list(v) for k, v in sorted(delta.items())}
        return Sample(
            (c1 - c0) / n * 1e6, (c2 - c1) / n * 1e6, n / drained_s, (cpu1 - cpu0) / n * 1e6
        )

    # -- kumiko ---------------------------------------------------------------
    def kumiko(self, case: str = "plain") -> Sample:
        prefix = f"rc{uuid.uuid4().hex[:6]}"
        n = self.messages if case == "plain" else self.feature_messages
        countdown = Countdown(n)
        feature = Feature("bench")
        tenant_ids = [f"tenant-{i}" for i in range(n)]
        options: dict[str, Any] = {}
        if case == "sequential":
            options["concurrency"] = "sequential"
        elif case == "per-tenant child":
            options["per_tenant"] = True
        elif case == "retry":
            options["retries"] = 1

        @feature.job("noop", **options)
        def noop(payload: dict[str, Any], ctx: JobContext) -> None:
            if case == "retry" and ctx.attempt == 1:
                raise RuntimeError("first attempt fails")
            self.work()
            countdown.hit()

        runner = JobRunner(
            Registry([feature]),
            redis_url=self.url,
            queue_prefix=prefix,
            worker_threads=self.threads,
            get_active_tenant_ids=lambda: tenant_ids,
            sequential_retry_delay_ms=20,
            metrics_port=free_port(),
        )
        logging.getLogger("kumiko_dramatiq").setLevel(logging.CRITICAL)

        # A queue in use: its per-job counts were made exact when a worker first started on
        # it (a one-off backfill, lua/counts_backfill.lua), so every enqueue and ack keeps
        # them, as in a deployment that has run before (not the backfill of 10,000 messages)
        backfill_counts(runner.broker, f"{prefix}-worker")

        def enqueue() -> None:
            if case == "per-tenant child":
                runner.dispatch("bench:job:noop")
                return
            for i in range(n):
                key = f"k{i}" if case == "dedup key" else None
                runner.dispatch("bench:job:noop", {"i": i}, dedup_key=key)

        def done() -> None:
            countdown.wait(timeout_s=900)
            wait_empty(self.client, keys.queue_messages(f"{prefix}-worker"))

        return self._measure(f"kumiko {case}", n, enqueue, runner.start, done, runner.stop)

    # -- plain Dramatiq -------------------------------------------------------
    def plain(self) -> Sample:
        queue = f"rp{uuid.uuid4().hex[:6]}"
        n = self.messages
        countdown = Countdown(n)
        broker = RedisBroker(url=self.url)  # type: ignore[no-untyped-call]

        def noop(payload: dict[str, Any]) -> None:
            self.work()
            countdown.hit()

        actor = dramatiq.Actor(
            noop, broker=broker, actor_name="noop", queue_name=queue, priority=0, options={}
        )
        worker = Worker(broker, worker_threads=self.threads, worker_timeout=WORKER_TIMEOUT_MS)

        def enqueue() -> None:
            for i in range(n):
                actor.send({"i": i})

        def start() -> None:
            broker.emit_after("process_boot")
            worker.start()

        def done() -> None:
            countdown.wait(timeout_s=900)
            wait_empty(self.client, keys.queue_messages(queue))

        def stop() -> None:
            worker.stop()
            broker.client.connection_pool.disconnect()

        return self._measure("plain Dramatiq", n, enqueue, start, done, stop)

    # -- the run --------------------------------------------------------------
    def run(self, features: list[str]) -> dict[str, Any]:
        kumiko, plain = Series("kumiko (plain case)"), Series("plain Dramatiq")
        alternate(
            self.rounds,
            lambda: kumiko.samples.append(self.kumiko()),
            lambda: plain.samples.append(self.plain()),
        )
        rows = [kumiko]
        for case in features:
            series = Series(f"kumiko, {case}")
            for _ in range(self.rounds):
                series.samples.append(self.kumiko(case))
            rows.append(series)
        return {"plain": plain, "rows": rows}


def table(result: dict[str, Any], uptime: str) -> str:
    plain: Series = result["plain"]
    base = plain.median("total_us")
    lines = [
        "| case | enqueue µs/job | drain µs/job | both µs/job | vs plain Dramatiq | ceiling jobs/s"
        " per Redis core | drain jobs/s | worker CPU µs/job | rounds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for series in [*result["rows"], plain]:
        total = series.median("total_us")
        lines.append(
            f"| {series.name} | {series.median('enqueue_us'):.1f} | {series.median('drain_us'):.1f}"
            f" | {total:.1f} (rounds: {', '.join(f'{s.total_us:.0f}' for s in series.samples)})"
            f" | {total / base:.2f}x | {1e6 / total:,.0f} | {series.median('drain_jobs_s'):,.0f}"
            f" | {series.median('worker_us'):.0f} | {len(series.samples)} |"
        )
    lines += ["", f"Load (`uptime` before the run): {uptime}"]
    return "\n".join(lines)


@contextmanager
def _server(pin: bool) -> Iterator[str]:
    """A private redis-server; with ``pin`` (and two cores or more), the server alone on the
    last core and this process (the client and the worker's threads) on the others, so the
    two do not take turns on one core's caches and the rounds spread less."""
    with private_redis_server() as url:
        cores = sorted(os.sched_getaffinity(0))
        if pin and len(cores) >= 2:
            pid = int(redis.Redis.from_url(url).info("server")["process_id"])
            os.sched_setaffinity(pid, {cores[-1]})
            os.sched_setaffinity(0, set(cores[:-1]))
        try:
            yield url
        finally:
            os.sched_setaffinity(0, set(cores))


FEATURES = ["dedup key", "sequential", "per-tenant child", "retry"]


def suite(
    rounds: int,
    messages: int = 10_000,
    feature_messages: int = 2_000,
    features: list[str] | None = None,
    pin: bool = True,
    job_ms: float = 0,
    threads: int = WORKER_THREADS,
) -> str:
    uptime = os.popen("uptime").read().strip()
    with _server(pin) as url:
        bench = RedisCost(url, messages, feature_messages, rounds, job_ms, threads)
        result = bench.run(FEATURES if features is None else features)
    text = "\n".join(
        [
            f"Redis CPU per job (server `INFO cpu`), {messages:,} jobs per round"
            f" ({feature_messages:,} for the features), {threads} worker threads,"
            f" {f'jobs of {job_ms:g} ms' if job_ms else 'no-op jobs'}, medians",
            "",
            table(result, uptime),
        ]
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "redis_cost.json").write_text(
        json.dumps(
            {
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "uptime": uptime,
                "job_ms": job_ms,
                "threads": threads,
                "series": {
                    s.name: [s2.__dict__ for s2 in s.samples]
                    for s in [*result["rows"], result["plain"]]
                },
                "commands_per_job_last_round": bench.commands,
            },
            indent=2,
        )
    )
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--feature-messages", type=int, default=2_000)
    parser.add_argument("--features", default=",".join(FEATURES), help="'' for none")
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="leave the server and the worker on any core (default: one core for the server)",
    )
    parser.add_argument(
        "--job-ms",
        type=float,
        default=0,
        help="each job waits this long (default 0: no-op jobs, whose settles come in batches)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=WORKER_THREADS,
        help="worker threads, kumiko's and plain Dramatiq's alike (default 8)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    features = [f for f in args.features.split(",") if f]
    print(
        suite(
            args.rounds,
            args.messages,
            args.feature_messages,
            features,
            not args.no_pin,
            args.job_ms,
            args.threads,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
