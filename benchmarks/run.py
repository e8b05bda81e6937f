"""Side-by-side benchmarks: kumiko_dramatiq vs plain Dramatiq on the same Redis.

``python -m benchmarks.run [--rounds 3] [--messages 3000] [--only NAME,...]``

Starts its own private redis-server (so ``INFO commandstats`` sees nothing
else) unless ``KUMIKO_REDIS_URL`` is set. Each figure comes from alternating
rounds of kumiko and plain Dramatiq in one run; the table reports medians and
kumiko/plain ratios. Results go to stdout as a Markdown table (paste into
benchmarks/README.md) and to benchmarks/results/latest.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.worker import Worker

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.broker.counts import backfill_counts
from kumiko_dramatiq.ops.history import RunHistory

from .caps import CapsBench
from .delayed import suite as delayed
from .harness import (
    Comparison,
    Countdown,
    RoundTrips,
    alternate,
    command_stats,
    percentile,
    stats_delta,
    timed,
)
from .latency import LatencyBench
from .memory import MemoryBench
from .metrics import MetricsBench
from .plain_actors import suite as plain_actors
from .redis_cost import suite as redis_cost
from .typed import TypedBench

WORKER_THREADS = 8
WORKER_TIMEOUT_MS = 200
RESULTS = Path(__file__).resolve().parent / "results"


class Bench:
    def __init__(self, redis_url: str, messages: int, rounds: int) -> None:
        self.redis_url = redis_url
        self.messages = messages
        self.rounds = rounds
        self.client = redis.Redis.from_url(redis_url)
        self.comparisons: list[Comparison] = []
        self.notes: list[str] = []
        self.extra: dict[str, Any] = {}

    # -- the two stacks -------------------------------------------------
    def kumiko_runner(self, prefix: str, countdown: Countdown | None) -> JobRunner:
        feature = Feature("bench")

        @feature.job("noop")
        def noop(payload: dict[str, Any], ctx: JobContext) -> None:
            if countdown is not None:
                countdown.hit()

        return JobRunner(
            Registry([feature]),
            redis_url=self.redis_url,
            queue_prefix=prefix,
            worker_threads=WORKER_THREADS,
        )

    def plain_broker(
        self, queue: str, countdown: Countdown | None
    ) -> tuple[RedisBroker, dramatiq.Actor[Any, Any]]:
        broker = RedisBroker(url=self.redis_url)  # type: ignore[no-untyped-call]

        def noop(payload: dict[str, Any]) -> None:
            if countdown is not None:
                countdown.hit()

        actor = dramatiq.Actor(
            noop, broker=broker, actor_name="noop", queue_name=queue, priority=0, options={}
        )
        return broker, actor

    def plain_drain(self, n: int) -> tuple[float, float]:
        """Plain Dramatiq's drain of ``n`` pre-enqueued no-op messages: (msg/s, CPU µs/msg)."""
        queue = f"bq{uuid.uuid4().hex[:6]}"
        countdown = Countdown(n)
        broker, actor = self.plain_broker(queue, countdown)
        for i in range(n):
            actor.send({"i": i})
        with timed() as t:
            worker = Worker(broker, worker_threads=WORKER_THREADS, worker_timeout=WORKER_TIMEOUT_MS)
            broker.emit_after("process_boot")
            worker.start()
            countdown.wait()
        worker.stop()
        broker.client.connection_pool.disconnect()
        self.flush(queue)
        return n / t[0].wall_s, t[0].cpu_s / n * 1e6

    def flush(self, prefix: str) -> None:
        for pattern in (f"dramatiq:{prefix}*", f"kumiko:{prefix}:*"):
            keys = list(self.client.scan_iter(match=pattern, count=1000))
            if keys:
                self.client.delete(*keys)

    # -- 1. enqueue rate and drain throughput -----------------------------
    def enqueue_and_drain(self) -> None:
        n = self.messages
        enqueue = Comparison("enqueue: `dispatch` vs `actor.send`", "msg/s")
        drain = Comparison("drain: no-op job, 8 threads", "msg/s")
        trips: dict[str, list[float]] = {"kumiko": [], "plain": []}
        commands: dict[str, dict[str, int]] = {}

        def kumiko_round() -> None:
            prefix = f"bk{uuid.uuid4().hex[:6]}"
            countdown = Countdown(n)
            runner = self.kumiko_runner(prefix, countdown)
            # a queue in use: its per-job counts made exact when a worker first started on it
            # (a one-off backfill), so every enqueue and ack keeps them, as in a deployment
            # that has run before (not a backfill of the messages enqueued below)
            backfill_counts(runner.broker, f"{prefix}-worker")
            with timed() as t:
                for i in range(n):
                    runner.dispatch("bench:job:noop", {"i": i})
            enqueue.kumiko.append(n / t[0].wall_s)
            enqueue.kumiko_cpu_us.append(t[0].cpu_s / n * 1e6)
            before = command_stats(self.client)
            with RoundTrips() as rt, timed() as t:
                runner.start()
                countdown.wait()
            commands["kumiko"] = stats_delta(before, command_stats(self.client))
            runner.stop()
            drain.kumiko.append(n / t[0].wall_s)
            drain.kumiko_cpu_us.append(t[0].cpu_s / n * 1e6)
            trips["kumiko"].append(rt.count / n)
            self.flush(prefix)

        def plain_round() -> None:
            queue = f"bp{uuid.uuid4().hex[:6]}"
            countdown = Countdown(n)
            broker, actor = self.plain_broker(queue, countdown)
            with timed() as t:
                for i in range(n):
                    actor.send({"i": i})
            enqueue.plain.append(n / t[0].wall_s)
            enqueue.plain_cpu_us.append(t[0].cpu_s / n * 1e6)
            before = command_stats(self.client)
            with RoundTrips() as rt, timed() as t:
                worker = Worker(
                    broker, worker_threads=WORKER_THREADS, worker_timeout=WORKER_TIMEOUT_MS
                )
                broker.emit_after("process_boot")
                worker.start()
                countdown.wait()
            commands["plain"] = stats_delta(before, command_stats(self.client))
            worker.stop()
            broker.client.connection_pool.disconnect()
            drain.plain.append(n / t[0].wall_s)
            drain.plain_cpu_us.append(t[0].cpu_s / n * 1e6)
            trips["plain"].append(rt.count / n)
            self.flush(queue)

        alternate(self.rounds, kumiko_round, plain_round)
        self.comparisons += [enqueue, drain]
        self.extra["round_trips_per_message_drain"] = {
            k: statistics.median(v) for k, v in trips.items()
        }
        self.extra["commands_last_drain_round"] = commands
        per_msg = {
            side: {cmd: round(calls / n, 3) for cmd, calls in stats.items()}
            for side, stats in commands.items()
        }
        self.extra["commands_per_message_drain"] = per_msg

    # -- 3. fan-out to many tenants ------------------------------------------
    def fanout(self, tenants: int = 10_000) -> None:
        comparison = Comparison(
            f"fan-out to {tenants:,} tenants vs plain drain of {tenants:,}", "children/s"
        )
        tenant_ids = [f"tenant-{i}" for i in range(tenants)]

        def kumiko_round() -> None:
            prefix = f"bf{uuid.uuid4().hex[:6]}"
            countdown = Countdown(tenants)
            feature = Feature("bench")

            @feature.job("each", per_tenant=True)
            def each(payload: dict[str, Any], ctx: JobContext) -> None:
                countdown.hit()

            runner = JobRunner(
                Registry([feature]),
                redis_url=self.redis_url,
                queue_prefix=prefix,
                worker_threads=WORKER_THREADS,
                get_active_tenant_ids=lambda: tenant_ids,
            )
            runner.start()
            with timed() as t:
                runner.dispatch("bench:job:each")
                countdown.wait()
            runner.stop()
            comparison.kumiko.append(tenants / t[0].wall_s)
            comparison.kumiko_cpu_us.append(t[0].cpu_s / tenants * 1e6)
            self.flush(prefix)

        def plain_round() -> None:
            rate, cpu_us = self.plain_drain(tenants)
            comparison.plain.append(rate)
            comparison.plain_cpu_us.append(cpu_us)

        alternate(self.rounds, kumiko_round, plain_round)
        self.comparisons.append(comparison)

    # -- 4. sequential hand-off ---------------------------------------------
    def sequential(self, runs: int = 200) -> None:
        for delay_ms in (1_000, 100):
            self.extra[f"sequential_{runs}_runs_delay_{delay_ms}ms"] = self._sequential(
                runs, delay_ms
            )

    def _sequential(self, runs: int, delay_ms: int) -> dict[str, float]:
        prefix = f"bs{uuid.uuid4().hex[:6]}"
        countdown = Countdown(runs)
        spans: list[tuple[float, float]] = []
        feature = Feature("bench")

        @feature.job("one_at_a_time", concurrency="sequential")
        def one_at_a_time(payload: dict[str, Any], ctx: JobContext) -> None:
            began = time.perf_counter()
            spans.append((began, time.perf_counter()))
            countdown.hit()

        runner = JobRunner(
            Registry([feature]),
            redis_url=self.redis_url,
            queue_prefix=prefix,
            worker_threads=WORKER_THREADS,
            sequential_retry_delay_ms=delay_ms,
        )
        for i in range(runs):
            runner.dispatch("bench:job:one_at_a_time", {"i": i})
        with timed() as t:
            runner.start()
            countdown.wait(timeout_s=900)
        runner.stop()
        self.flush(prefix)
        spans.sort()
        gaps_ms = [(b[0] - a[1]) * 1000 for a, b in itertools.pairwise(spans)]
        return {
            "runs_per_s": round(runs / t[0].wall_s, 1),
            "gap_p50_ms": round(percentile(gaps_ms, 50), 1),
            "gap_p99_ms": round(percentile(gaps_ms, 99), 1),
            "gap_max_ms": round(max(gaps_ms), 1),
            "overlaps": sum(1 for gap in gaps_ms if gap < 0),
        }

    # -- 5. dedup dispatch rate ------------------------------------------------
    def dedup(self) -> None:
        n = self.messages
        fresh = Comparison("`dispatch(dedup_key=unique)` vs plain `dispatch`", "msg/s")
        same = Comparison("`dispatch(dedup_key=same)` (a burst) vs plain `dispatch`", "msg/s")
        prefix = f"bd{uuid.uuid4().hex[:6]}"
        runner = self.kumiko_runner(prefix, None)

        def plain_round() -> None:
            with timed() as t:
                for i in range(n):
                    runner.dispatch("bench:job:noop", {"i": i})
            fresh.plain.append(n / t[0].wall_s)
            same.plain.append(n / t[0].wall_s)
            self.flush(prefix)

        def dedup_round() -> None:
            with timed() as t:
                for i in range(n):
                    runner.dispatch("bench:job:noop", {"i": i}, dedup_key=f"k{i}")
            fresh.kumiko.append(n / t[0].wall_s)
            with timed() as t:
                for i in range(n):
                    runner.dispatch("bench:job:noop", {"i": i}, dedup_key="burst")
            same.kumiko.append(n / t[0].wall_s)
            self.flush(prefix)

        alternate(self.rounds, dedup_round, plain_round)
        runner.stop()
        fresh.baseline = same.baseline = "kumiko `dispatch`"
        self.comparisons += [fresh, same]

    # -- 6. cron enqueue lag -------------------------------------------------
    def cron(self, seconds: float = 12.0) -> None:
        root = Path(__file__).resolve().parent.parent
        for schedulers in (1, 3):
            prefix = f"bc{uuid.uuid4().hex[:6]}"
            env = {
                **os.environ,
                "KUMIKO_APP": "benchmarks.cron_app:registry",
                "KUMIKO_REDIS_URL": self.redis_url,
                "KUMIKO_QUEUE_PREFIX": prefix,
                "PYTHONPATH": str(root),
            }
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "kumiko_dramatiq.scheduler"],
                    cwd=root,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for _ in range(schedulers)
            ]
            try:
                time.sleep(seconds)  # let the schedulers tick: this is the measurement window
            finally:
                for proc in procs:
                    proc.send_signal(signal.SIGTERM)
                for proc in procs:
                    proc.wait(timeout=30)
            lags_ms: list[float] = []
            ids: list[str] = []
            stored = self.client.hgetall(f"dramatiq:{prefix}-worker.msgs")
            for raw in stored.values():
                message = json.loads(raw)
                tick = datetime.fromisoformat(message["options"]["kumiko_scheduled_at"])
                lags_ms.append(message["message_timestamp"] - tick.timestamp() * 1000)
                ids.append(message["message_id"])
            self.flush(prefix)
            self.extra[f"cron_lag_{schedulers}_scheduler(s)"] = {
                "ticks": len(ids),
                "duplicates": len(ids) - len(set(ids)),
                "lag_p50_ms": round(percentile(lags_ms, 50), 1),
                "lag_p99_ms": round(percentile(lags_ms, 99), 1),
            }


class HistoryBench:
    """Run history at scale: write many records, then time the queries an operator runs."""

    def __init__(self, bench: Bench, records: int) -> None:
        self.bench = bench
        self.records = records

    def __call__(self) -> None:
        prefix = f"bh{uuid.uuid4().hex[:6]}"
        jobs = [f"bench:job:j{n}" for n in range(20)]
        feature = Feature("bench")
        for job in jobs:
            feature.job(job.rsplit(":", 1)[1])(_noop)
        runner = JobRunner(
            Registry([feature]),
            redis_url=self.bench.redis_url,
            queue_prefix=prefix,
            history_cap=self.records * 2,
        )
        history = runner.history
        client = self.bench.client
        client.config_set("maxmemory", 0)
        before = int(client.info("memory")["used_memory"])
        started = time.perf_counter()
        fill_history(client, history, jobs, self.records)
        write_s = time.perf_counter() - started
        after = int(client.info("memory")["used_memory"])
        queries: dict[str, Callable[[], Any]] = {
            "latest 50 failed of one job": lambda: runner.runs(jobs[3], status="failed"),
            "latest 50 of one job": lambda: runner.runs(jobs[3]),
            "latest 50 of every job": lambda: runner.runs(),
            "latest 50 of one tenant": lambda: runner.runs(tenant_id="tenant-42"),
        }
        timings = {}
        for name, query in queries.items():
            samples = []
            for _ in range(30):
                begun = time.perf_counter()
                found = query()
                samples.append((time.perf_counter() - begun) * 1000)
            assert found, name
            timings[name] = {
                "p50_ms": round(percentile(samples, 50), 2),
                "p99_ms": round(percentile(samples, 99), 2),
            }
        self.bench.extra["history"] = {
            "records": self.records,
            "bytes_per_record": round((after - before) / self.records),
            "write_records_per_s": round(self.records / write_s),
            "queries": timings,
        }
        runner.stop()
        self.bench.flush(prefix)


def fill_history(client: redis.Redis, history: RunHistory, jobs: list[str], records: int) -> None:
    """Write ``records`` run records of ``jobs`` straight through the history's Lua call, one
    a millisecond up to now, 5,000 to a pipeline: every tenth failed (with an error), every
    third of one of 500 tenants. The data of the history suite and ``benchmarks/dashboard.py``.
    """
    now_ms = int(time.time() * 1000) - records
    completed_ttl, failed_ttl = 86_400_000, 604_800_000
    pipe = client.pipeline(transaction=False)
    for n in range(records):
        job = jobs[n % len(jobs)]
        status = "failed" if n % 10 == 3 else "completed"
        message_id = str(uuid.uuid4())
        tenant = f"tenant-{n % 500}" if n % 3 == 0 else ""
        record = {
            "j": job,
            "m": message_id,
            "o": message_id,
            "t": tenant or None,
            "tr": "manual",
            "a": 1,
            "ma": 3,
            "s": status,
            "q": now_ms + n - 5,
            "st": now_ms + n - 3,
            "en": now_ms + n,
            "d": 3,
            "w": "bench-host:12345",
        }
        if status == "failed":
            record |= {"et": "RuntimeError", "em": "gateway down", "tb": "Traceback ...\n"}
        history.lua.run_put(
            keys=[f"{history.root}run:{message_id}"],
            args=[
                history.root,
                message_id,
                1,
                job,
                status,
                tenant,
                message_id,
                now_ms + n,
                json.dumps({k: v for k, v in record.items() if v is not None}),
                completed_ttl,
                failed_ttl,
                records * 2,
                0,
            ],
            client=pipe,
        )
        if n % 5_000 == 4_999:
            pipe.execute()
    pipe.execute()


def _noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


def machine() -> str:
    cpus = os.cpu_count()
    server = redis.Redis.from_url(os.environ.get("KUMIKO_REDIS_URL", "redis://127.0.0.1:6379"))
    try:
        version = server.info("server")["redis_version"]
    except redis.RedisError:
        version = "?"
    return (
        f"{platform.processor() or platform.machine()}, {cpus} cores, Python "
        f"{platform.python_version()}, dramatiq {dramatiq.__version__}, Redis {version}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--only", default="")
    parser.add_argument("--history-records", type=int, default=1_000_000)
    parser.add_argument("--latency-samples", type=int, default=200)
    parser.add_argument("--memory-jobs", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kumiko_dramatiq").setLevel(logging.WARNING)

    from examples.demo import demo_redis

    with demo_redis() as url:
        bench = Bench(url, args.messages, max(3, args.rounds))
        suites: dict[str, Callable[[], None]] = {
            "throughput": bench.enqueue_and_drain,
            "fanout": bench.fanout,
            "sequential": bench.sequential,
            "dedup": bench.dedup,
            "cron": bench.cron,
            "history": HistoryBench(bench, args.history_records),
            "latency": LatencyBench(bench, args.latency_samples),
            "memory": MemoryBench(bench, args.memory_jobs),
            "metrics": MetricsBench(bench),
            "typed": TypedBench(bench),
            "caps": CapsBench(bench, rate_seconds=15.0),
            # on a private redis-server of its own: it flushes its database between runs
            "plain_actors": lambda: bench.notes.append(plain_actors(bench.rounds)),
            # Redis CPU per job on a private redis-server of its own (issue 32)
            "redis_cost": lambda: bench.notes.append(redis_cost(bench.rounds)),
            "delayed": lambda: bench.notes.append(delayed([0, 10_000, 100_000], 100_000)),
        }
        chosen = [s for s in args.only.split(",") if s] or list(suites)
        for name in chosen:
            print(f"running {name}...", file=sys.stderr)
            suites[name]()
        report(bench)
    return 0


def report(bench: Bench) -> None:
    lines = [
        f"Machine: {machine()}",
        "",
        "| measure | kumiko (median) | baseline (median) | ratio | kumiko CPU µs/msg"
        " | baseline CPU µs/msg | rounds |",
        "|---|---|---|---|---|---|---|",
        *(c.row() for c in bench.comparisons),
        "",
    ]
    for key, value in bench.extra.items():
        lines.append(f"- {key}: {json.dumps(value)}")
    for note in bench.notes:
        lines.extend(["", note])
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(
        json.dumps(
            {
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "comparisons": [c.__dict__ for c in bench.comparisons],
                "extra": bench.extra,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
