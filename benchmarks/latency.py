"""Start latency, delayed and retry lateness, and bulk dispatch, side by side with Dramatiq.

Latency (issue: start in milliseconds, not a poll interval): an idle worker on each stack,
with the Dramatiq CLI's poll interval (``worker_timeout`` 1000 ms), gets jobs at a fixed
rate (open loop: each dispatch at its planned time, whatever the last one did). Measured per
sample, from the caller's clock to the handler's first line (one process, so one clock):

- **start**: ``dispatch`` / ``actor.send`` -> handler start, at 2/s and at 20/s;
- **delayed**: ``delay_ms=500`` / ``delay=500``: handler start - (send time + 500 ms);
- **retry**: a first attempt fails, its retry is due 100 ms later: retry start - (failure
  + 100 ms). Dramatiq's own ``Retries`` jitters its backoff (``min_backoff=max_backoff=100``
  gives 50-100 ms), so its figure reads early by up to 50 ms.

Idle cost: Redis round trips per second an idle worker of each stack sends.

Bulk: 10,000 payloads through ``dispatch_many`` vs 10,000 ``dispatch`` calls, and vs
10,000 ``actor.send`` calls.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.worker import Worker

from kumiko_dramatiq import Backoff, Feature, JobContext, JobRunner, Registry

from .harness import Comparison, RoundTrips, percentile

if TYPE_CHECKING:
    from .run import Bench

#: the Dramatiq CLI's poll interval (``--worker-timeout``), used by both stacks
POLL_MS = 1000
DELAY_MS = 500
BACKOFF_MS = 100


class Samples:
    """Planned times and handler start times of one measurement, by sample key."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.due: dict[str, float] = {}
        self.started: dict[str, float] = {}
        self.failed: dict[str, float] = {}
        self.done = threading.Event()
        self.expected = 0

    def start(self, key: str, attempt: int) -> bool:
        """Record a handler start; ``True`` if this attempt should fail (retry runs)."""
        now = time.perf_counter()
        with self.lock:
            if key in self.failed or attempt > 1:
                self.started[key] = now
            elif key.startswith("r"):
                self.failed[key] = now + BACKOFF_MS / 1000
                return True
            else:
                self.started[key] = now
            if len(self.started) >= self.expected:
                self.done.set()
        return False

    def lateness_ms(self) -> list[float]:
        out = []
        for key, started in self.started.items():
            due = self.failed.get(key, self.due.get(key))
            if due is not None:
                out.append((started - due) * 1000)
        return out


class LatencyBench:
    def __init__(self, bench: Bench, samples: int) -> None:
        self.bench = bench
        self.samples = samples

    def __call__(self) -> None:
        for rate in (2, 20):
            self.compare(f"start latency at {rate}/s (p50 / p99)", "start", rate)
        self.compare("delayed 500 ms: lateness at 20/s (p50 / p99)", "delayed", 20)
        self.compare("retry after 100 ms: lateness at 20/s (p50 / p99)", "retry", 20)
        self.idle()
        self.bulk()

    # -- idle cost ---------------------------------------------------------------------
    def idle(self, seconds: float = 10) -> None:
        """Redis round trips per second an idle worker of each stack sends (this process)."""
        comparison = Comparison("idle worker: Redis round trips per second", "trips/s")
        for stack, rates in (
            (self.kumiko_stack, comparison.kumiko),
            (self.plain_stack, comparison.plain),
        ):
            _, stop = stack(Samples())
            time.sleep(2 * POLL_MS / 1000)
            with RoundTrips() as trips:
                time.sleep(seconds)
            stop()
            rates.append(trips.count / seconds)
        self.bench.comparisons.append(comparison)

    # -- one measurement ---------------------------------------------------------------
    def compare(self, label: str, kind: str, rate: int) -> None:
        kumiko = self.run(kind, rate, self.kumiko_stack)
        plain = self.run(kind, rate, self.plain_stack)
        for q, name in ((50, "p50"), (99, "p99")):
            comparison = Comparison(f"{label.split(' (')[0]}: {name}", "ms")
            comparison.kumiko.append(percentile(kumiko, q))
            comparison.plain.append(percentile(plain, q))
            self.bench.comparisons.append(comparison)
        self.bench.extra[f"{kind} at {rate}/s, samples"] = len(kumiko)

    def run(
        self,
        kind: str,
        rate: int,
        stack: Callable[[Samples], tuple[Callable[[str, int | None], None], Callable[[], None]]],
    ) -> list[float]:
        samples = Samples()
        samples.expected = self.samples
        send, stop = stack(samples)
        time.sleep(2 * POLL_MS / 1000)  # idle: every consumer has gone to its idle wait
        begin = time.perf_counter()
        try:
            for i in range(self.samples):
                planned = begin + i / rate
                pause = planned - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                key = f"{kind[0]}{i}"
                delay = DELAY_MS if kind == "delayed" else None
                with samples.lock:
                    samples.due[key] = time.perf_counter() + (delay or 0) / 1000
                send(key, delay)
            samples.done.wait(60)
        finally:
            stop()
        return samples.lateness_ms()

    def kumiko_stack(
        self, samples: Samples
    ) -> tuple[Callable[[str, int | None], None], Callable[[], None]]:
        feature = Feature("lat")

        @feature.job("probe", retries=1, backoff=Backoff("fixed", delay_ms=BACKOFF_MS))
        def probe(payload: dict[str, Any], ctx: JobContext) -> None:
            if samples.start(payload["k"], ctx.attempt):
                raise RuntimeError("first attempt fails")

        prefix = f"bl{uuid.uuid4().hex[:6]}"
        runner = JobRunner(
            Registry([feature]),
            redis_url=self.bench.redis_url,
            queue_prefix=prefix,
            worker_threads=8,
            idle_wait_ms=POLL_MS,
        )
        runner.start()

        def send(key: str, delay: int | None) -> None:
            runner.dispatch("lat:job:probe", {"k": key}, delay_ms=delay)

        def stop() -> None:
            runner.stop()
            self.bench.flush(prefix)

        return send, stop

    def plain_stack(
        self, samples: Samples
    ) -> tuple[Callable[[str, int | None], None], Callable[[], None]]:
        queue = f"bl{uuid.uuid4().hex[:6]}"
        broker = RedisBroker(url=self.bench.redis_url)  # type: ignore[no-untyped-call]
        broker.add_middleware(dramatiq.middleware.CurrentMessage())

        def probe(payload: dict[str, Any]) -> None:
            message = dramatiq.middleware.CurrentMessage.get_current_message()
            attempt = 1 + (message.options.get("retries", 0) if message is not None else 0)
            if samples.start(payload["k"], attempt):
                raise RuntimeError("first attempt fails")

        actor = dramatiq.Actor(
            probe,
            broker=broker,
            actor_name="probe",
            queue_name=queue,
            priority=0,
            options={"max_retries": 1, "min_backoff": BACKOFF_MS, "max_backoff": BACKOFF_MS},
        )
        worker = Worker(broker, worker_threads=8, worker_timeout=POLL_MS)
        worker.start()

        def send(key: str, delay: int | None) -> None:
            actor.send_with_options(args=({"k": key},), delay=delay)

        def stop() -> None:
            worker.stop()
            broker.close()
            self.bench.flush(queue)

        return send, stop

    # -- bulk dispatch -----------------------------------------------------------------
    def bulk(self) -> None:
        n = 10_000
        payloads = [{"i": i, "customer": f"customer-{i}"} for i in range(n)]
        feature = Feature("bulk")
        feature.job("noop")(_noop)
        rates: dict[str, list[float]] = {"many": [], "one": [], "send": []}
        for _ in range(self.bench.rounds):
            prefix = f"bb{uuid.uuid4().hex[:6]}"
            runner = JobRunner(
                Registry([feature]), redis_url=self.bench.redis_url, queue_prefix=prefix
            )
            begin = time.perf_counter()
            runner.dispatch_many("bulk:job:noop", payloads)
            rates["many"].append(n / (time.perf_counter() - begin))
            self.bench.flush(prefix)
            begin = time.perf_counter()
            for payload in payloads:
                runner.dispatch("bulk:job:noop", payload)
            rates["one"].append(n / (time.perf_counter() - begin))
            runner.stop()
            self.bench.flush(prefix)
            broker, actor = self.bench.plain_broker(f"bp{prefix}", None)
            begin = time.perf_counter()
            for payload in payloads:
                actor.send(payload)
            rates["send"].append(n / (time.perf_counter() - begin))
            broker.close()
            self.bench.flush(f"bp{prefix}")
        versus_dispatch = Comparison(
            "bulk: `dispatch_many` vs `dispatch`, 10,000", "msg/s", baseline="kumiko `dispatch`"
        )
        versus_dispatch.kumiko += rates["many"]
        versus_dispatch.plain += rates["one"]
        versus_send = Comparison("bulk: `dispatch_many` vs `actor.send`, 10,000", "msg/s")
        versus_send.kumiko += rates["many"]
        versus_send.plain += rates["send"]
        self.bench.comparisons += [versus_dispatch, versus_send]


def _noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None
