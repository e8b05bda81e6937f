"""What metrics cost: drain throughput with ``metrics_port`` set, side by side with Dramatiq.

Three stacks drain the same number of pre-enqueued no-op messages with 8 threads, in
rotating order each round: kumiko with metrics on (its endpoint scraped once a second
meanwhile, a pessimistic Prometheus), kumiko with metrics off, and plain Dramatiq. Target:
metrics on at least 0.95x plain Dramatiq. Reported as two comparisons: metrics on vs plain
Dramatiq, and metrics on vs metrics off (the cost of the metrics alone).

On a busy machine those rates swing by tens of percent from round to round, far more than
the metrics cost; so the suite also times the metrics middleware's own hooks for one
completed attempt (``before_process_message`` + ``after_process_message``, no I/O), which
noise barely moves: that figure, against the CPU a message costs, is the cost.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
import uuid
from typing import TYPE_CHECKING, Any

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.broker.delivery import Delivery, RunWrite
from kumiko_dramatiq.codec import KumikoOptions
from kumiko_dramatiq.messages import build_message
from kumiko_dramatiq.middleware.metrics import metrics_of
from kumiko_dramatiq.worker.execution import Execution

from .harness import Comparison, Countdown, timed

if TYPE_CHECKING:
    from .run import Bench

WORKER_THREADS = 8
WORKER_TIMEOUT_MS = 200
SCRAPE_EVERY_S = 1.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Scraper:
    """Scrapes ``http://127.0.0.1:{port}/metrics`` every :data:`SCRAPE_EVERY_S` until stopped."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SCRAPE_EVERY_S):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics") as reply:
                    reply.read()
                self.scrapes += 1
            except OSError:
                pass


class MetricsBench:
    """The ``metrics`` suite of ``python -m benchmarks.run``."""

    def __init__(self, bench: Bench, rounds: int = 5) -> None:
        self.bench = bench
        self.rounds = max(rounds, bench.rounds)

    def runner(self, prefix: str, countdown: Countdown, metrics_port: int | None) -> JobRunner:
        feature = Feature("bench")

        @feature.job("noop")
        def noop(payload: dict[str, Any], ctx: JobContext) -> None:
            countdown.hit()

        return JobRunner(
            Registry([feature]),
            redis_url=self.bench.redis_url,
            queue_prefix=prefix,
            worker_threads=WORKER_THREADS,
            metrics_port=metrics_port,
        )

    def __call__(self) -> None:
        n = self.bench.messages
        on_vs_plain = Comparison("drain with metrics on (scraped every second)", "msg/s")
        on_vs_off = Comparison(
            "drain with metrics on vs off", "msg/s", baseline="kumiko, metrics off"
        )
        scrapes: list[int] = []

        def kumiko_round(metrics: bool) -> None:
            prefix = f"bm{uuid.uuid4().hex[:6]}"
            countdown = Countdown(n)
            port = free_port() if metrics else None
            runner = self.runner(prefix, countdown, port)
            for i in range(n):
                runner.dispatch("bench:job:noop", {"i": i})
            scraper = Scraper(port) if port is not None else None
            with timed() as t:
                runner.start()
                if scraper is not None:
                    with scraper:
                        countdown.wait()
                    scrapes.append(scraper.scrapes)
                else:
                    countdown.wait()
            runner.stop()
            rate, cpu_us = n / t[0].wall_s, t[0].cpu_s / n * 1e6
            if metrics:
                on_vs_plain.kumiko.append(rate)
                on_vs_plain.kumiko_cpu_us.append(cpu_us)
                on_vs_off.kumiko.append(rate)
                on_vs_off.kumiko_cpu_us.append(cpu_us)
            else:
                on_vs_off.plain.append(rate)
                on_vs_off.plain_cpu_us.append(cpu_us)
            self.bench.flush(prefix)

        def plain_round() -> None:
            rate, cpu_us = self.bench.plain_drain(n)
            on_vs_plain.plain.append(rate)
            on_vs_plain.plain_cpu_us.append(cpu_us)

        stacks = [lambda: kumiko_round(True), lambda: kumiko_round(False), plain_round]
        for index in range(self.rounds):
            shift = index % len(stacks)
            for run in stacks[shift:] + stacks[:shift]:
                run()
        self.bench.comparisons += [on_vs_plain, on_vs_off]
        self.bench.extra["metrics_scrapes_per_round"] = scrapes
        self.bench.extra["metrics_hooks_us_per_attempt"] = self.hook_cost_us()

    def hook_cost_us(self, calls: int = 50_000) -> float:
        """CPU microseconds of the metrics middleware's hooks for one completed attempt."""
        runner = self.runner(f"bh{uuid.uuid4().hex[:6]}", Countdown(0), free_port())
        metrics = metrics_of(runner.broker)
        assert metrics is not None
        job = runner.registry.jobs["bench:job:noop"]
        message = build_message(job, {}, queue_prefix=runner.queue_prefix, trigger="manual")
        delivery = Delivery(message, fetched_from=job.queue_name(runner.queue_prefix),
                            redis_message_id="r")  # fmt: skip
        delivery.execution = Execution(job, delivery, KumikoOptions.decode(message.options), False)
        delivery.settlement.run = RunWrite("m", 1, job.qualified_name, "completed", "", "m", "", "")
        broker = runner.broker
        started = time.process_time()
        for _ in range(calls):
            metrics.before_process_message(broker, delivery)
            metrics.after_process_message(broker, delivery, result=None)
        cost = (time.process_time() - started) / calls * 1e6
        runner.stop()
        return round(cost, 2)
