"""What concurrency caps and rate limits deliver, and what they cost jobs without caps.

``python -m benchmarks.caps [--rate-seconds 60] [--rounds 3]`` (or ``bash benchmarks/run.sh
--only caps``, which uses ``--rate-seconds 15``):

1. **capped throughput**: a job with ``max_running=N`` whose handler sleeps ``H`` ms, on one
   runner with 8 threads (more threads than slots), drains ``40 * N`` messages; its rate is
   compared with ``N / H`` (target: within 10 %, ratio >= 0.90). The gap between a run's end
   and the next start on a freed slot (``max_running=1``: every start but the first waits for
   one) is reported as p50/p99 (target: p99 <= 50 ms; it includes the settle that gives the
   slot back, the doorbell, the fetch and the hooks);
2. **rate limit**: a job with ``RateLimit(count, 1_000)``, fed more than it may run, for
   ``--rate-seconds`` (60: "over a minute"); the starts in that time are compared with
   ``count * seconds`` (target: within 5 %);
3. **uncapped jobs pay nothing**: enqueue and drain of a no-op job WITHOUT caps, on a lane
   that has a capped job too (the fetch then looks for caps in every message of the lane:
   the worst case for an uncapped job), side by side with plain Dramatiq (target >= 0.95x).
   It is also compared with the same job on a lane without a capped job (which runs exactly
   the code it ran before caps existed: ``benchmarks.run --only throughput``).

Start and end instants come from the handler (``time.monotonic()``), runs from the hooks.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from kumiko_dramatiq import Feature, JobContext, JobRunner, RateLimit, Registry

from .harness import Comparison, Countdown, percentile, timed

if TYPE_CHECKING:
    from .run import Bench

WORKER_THREADS = 8


class Ledger:
    def __init__(self, n: int) -> None:
        self.lock = threading.Lock()
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.countdown = Countdown(n)

    def start(self) -> None:
        with self.lock:
            self.starts.append(time.monotonic())

    def end(self) -> None:
        with self.lock:
            self.ends.append(time.monotonic())
        self.countdown.hit()


def capped_registry(ledger: Ledger, hold_s: float, **caps: Any) -> Registry:
    feature = Feature("bench")

    @feature.job("capped", **caps)
    def capped(payload: dict[str, Any], ctx: JobContext) -> None:
        ledger.start()
        time.sleep(hold_s)
        ledger.end()

    return Registry([feature])


#: the parts of the benchmark, in the order they run (``--parts``)
PARTS = ("throughput", "rate", "uncapped")


class CapsBench:
    def __init__(
        self, bench: Bench, rate_seconds: float = 15.0, parts: tuple[str, ...] = PARTS
    ) -> None:
        self.bench = bench
        self.rate_seconds = rate_seconds
        self.parts = parts

    def runner(self, registry: Registry, prefix: str) -> JobRunner:
        return JobRunner(
            registry,
            redis_url=self.bench.redis_url,
            queue_prefix=prefix,
            worker_threads=WORKER_THREADS,
        )

    def __call__(self) -> None:
        if "throughput" in self.parts:
            self.capped_throughput()
        if "rate" in self.parts:
            self.rate_limit()
        if "uncapped" in self.parts:
            self.uncapped()

    # -- 1 --------------------------------------------------------------------------------
    def capped_throughput(self) -> None:
        bench = self.bench
        rows = []
        gaps: list[float] = []
        for slots, hold_ms in ((1, 50), (2, 50), (4, 50), (6, 50), (4, 20)):
            rates = []
            for _ in range(bench.rounds):
                n = 40 * slots
                ledger = Ledger(n)
                prefix = f"bc{uuid.uuid4().hex[:6]}"
                runner = self.runner(
                    capped_registry(ledger, hold_ms / 1000, max_running=slots), prefix
                )
                for i in range(n):
                    runner.dispatch("bench:job:capped", {"i": i})
                runner.start()
                ledger.countdown.wait()
                runner.stop()
                bench.flush(prefix)
                starts, ends = sorted(ledger.starts), sorted(ledger.ends)
                rates.append((n - 1) / (ends[-1] - starts[0]) if n > 1 else 0.0)
                if slots == 1:
                    # the k-th start waits for the (k-1)-th end: the hand-over of the slot
                    gaps += [s - e for s, e in zip(starts[1:], ends[:-1], strict=True)]
            target = slots / (hold_ms / 1000)
            rate = statistics.median(rates)
            rows.append(
                f"| max_running={slots}, handler {hold_ms} ms, {40 * slots} messages, "
                f"8 threads | {rate:,.1f} runs/s | {target:,.1f} runs/s | {rate / target:.2f}x |"
                f" {'yes' if rate / target >= 0.90 else 'no'} |"
            )
        gap_ms = [g * 1000 for g in gaps]
        bench.notes.append(
            "\n".join(
                [
                    "Capped throughput (medians of "
                    f"{bench.rounds} rounds): rate vs N / handler time",
                    "",
                    "| scenario | measured | N / H | ratio | within 10 % |",
                    "|---|---|---|---|---|",
                    *rows,
                    "",
                    f"Freed slot to next start (max_running=1, {len(gap_ms)} hand-overs): "
                    f"p50 {percentile(gap_ms, 50):.1f} ms, p99 {percentile(gap_ms, 99):.1f} ms, "
                    f"max {max(gap_ms):.1f} ms (target: p99 <= 50 ms)",
                ]
            )
        )
        bench.extra["caps_slot_handover_ms"] = {
            "p50": percentile(gap_ms, 50),
            "p99": percentile(gap_ms, 99),
            "max": max(gap_ms),
        }

    # -- 2 --------------------------------------------------------------------------------
    def rate_limit(self) -> None:
        bench = self.bench
        count, seconds = 20, self.rate_seconds
        expected = int(count * seconds)
        n = expected + 4 * count  # more than it may run in the time
        ledger = Ledger(n)
        prefix = f"br{uuid.uuid4().hex[:6]}"
        runner = self.runner(
            capped_registry(ledger, 0.0, rate_limit=RateLimit(count, 1_000)), prefix
        )
        for i in range(n):
            runner.dispatch("bench:job:capped", {"i": i})
        runner.start()
        time.sleep(seconds + 2.0)
        runner.stop()
        bench.flush(prefix)
        starts = sorted(ledger.starts)
        first = starts[0]
        within = [s for s in starts if s < first + seconds]
        # the handlers' own start instants (after the fetch that took the start, on the local
        # clock: a loaded machine's scheduling jitter shows here, not in Redis's window)
        worst = max(
            sum(1 for s in starts[i : i + 2 * count] if s < starts[i] + 0.999)
            for i in range(len(starts))
        )
        ratio = len(within) / expected
        bench.notes.append(
            f"Rate limit RateLimit({count}, 1_000) over {seconds:g} s: {len(within):,} starts "
            f"vs {expected:,} allowed ({ratio:.3f}x, within 5 %: "
            f"{'yes' if abs(1 - ratio) <= 0.05 else 'no'}); the most starts in any 1 s window "
            f"(local clock): {worst}"
        )
        bench.extra["caps_rate_limit"] = {
            "count": count,
            "seconds": seconds,
            "starts": len(within),
            "expected": expected,
            "ratio": ratio,
            "most_in_a_window": worst,
        }

    # -- 3 --------------------------------------------------------------------------------
    def uncapped(self) -> None:
        bench = self.bench
        n = bench.messages
        enqueue = Comparison("enqueue: uncapped job on a lane with a capped one", "msg/s")
        drain = Comparison("drain: uncapped no-op job on a lane with a capped one", "msg/s")
        same = Comparison(
            "drain: uncapped no-op job, lane with a capped job vs lane without",
            "msg/s",
            "kumiko, no capped job",
        )

        def kumiko_round(with_capped: bool) -> tuple[float, float, float, float]:
            prefix = f"bu{uuid.uuid4().hex[:6]}"
            countdown = Countdown(n)
            feature = Feature("bench")

            @feature.job("noop")
            def noop(payload: dict[str, Any], ctx: JobContext) -> None:
                countdown.hit()

            if with_capped:

                @feature.job("capped", max_running=2, rate_limit=RateLimit(100, 1_000))
                def capped(payload: dict[str, Any], ctx: JobContext) -> None:
                    return None

            runner = self.runner(Registry([feature]), prefix)
            with timed() as sent:
                for i in range(n):
                    runner.dispatch("bench:job:noop", {"i": i})
            with timed() as drained:
                runner.start()
                countdown.wait()
            runner.stop()
            bench.flush(prefix)
            return (
                n / sent[0].wall_s,
                sent[0].cpu_s / n * 1e6,
                n / drained[0].wall_s,
                drained[0].cpu_s / n * 1e6,
            )

        def capped_lane() -> None:
            rate, cpu, drained, drained_cpu = kumiko_round(True)
            enqueue.kumiko.append(rate)
            enqueue.kumiko_cpu_us.append(cpu)
            drain.kumiko.append(drained)
            drain.kumiko_cpu_us.append(drained_cpu)
            same.kumiko.append(drained)
            same.kumiko_cpu_us.append(drained_cpu)

        def plain_lane() -> None:
            _, _, drained, drained_cpu = kumiko_round(False)
            same.plain.append(drained)
            same.plain_cpu_us.append(drained_cpu)

        def plain_round() -> None:
            queue = f"bp{uuid.uuid4().hex[:6]}"
            countdown = Countdown(n)
            broker, actor = bench.plain_broker(queue, countdown)
            with timed() as t:
                for i in range(n):
                    actor.send({"i": i})
            enqueue.plain.append(n / t[0].wall_s)
            enqueue.plain_cpu_us.append(t[0].cpu_s / n * 1e6)
            broker.client.connection_pool.disconnect()
            bench.flush(queue)
            rate, cpu = bench.plain_drain(n)
            drain.plain.append(rate)
            drain.plain_cpu_us.append(cpu)

        order = [capped_lane, plain_lane, plain_round]
        for index in range(bench.rounds):
            for run in order[index % 3 :] + order[: index % 3]:
                run()
        bench.comparisons += [enqueue, drain, same]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument(
        "--rate-seconds", type=float, default=60.0, help="how long the rate limit is measured"
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="which parts to run, comma-separated: throughput (1), rate (2), uncapped (3)",
    )
    args = parser.parse_args(argv)

    from examples.demo import demo_redis

    from .run import Bench, report

    with demo_redis() as url:
        bench = Bench(url, args.messages, max(3, args.rounds))
        parts = tuple(part for part in args.parts.split(",") if part)
        unknown = set(parts) - set(PARTS)
        if unknown:
            parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
        CapsBench(bench, args.rate_seconds, parts)()
        report(bench)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
