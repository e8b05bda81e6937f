"""Fail-overs with real sentinels: what a dispatch that returned an id can lose, what runs twice.

    python -m benchmarks.failover                     # 5 runs of each of the four cases
    python -m benchmarks.failover --runs 1 --only planned-recommended

Each run starts a private Sentinel deployment (primary + 2 replicas + 3 sentinels, quorum 2,
``down-after-milliseconds 500``), two in-process workers (4 threads each) and a producer that
dispatches a no-op job at a steady rate (:data:`RATE_PER_S`) through ``redis+sentinel://``,
noting every id ``dispatch`` returned (an error is noted and the dispatch tried again, as an
application would). After :data:`BEFORE_S` of steady load the primary goes away:

- ``crash``: ``kill -9`` of the primary (the sentinels notice within 500 ms and promote one
  replica);
- ``planned``: ``SENTINEL FAILOVER`` on one sentinel (the old primary keeps running; the
  sentinels demote it about ten seconds after the switch, and it then drops what was written
  to it since the promotion).

The load goes on until :data:`AFTER_S` after the producer is back (for a planned fail-over:
after the old primary was demoted), then the workers drain. Each run takes :data:`WORK_MS`
(I/O-bound work), so some are in flight at any moment, and every other dispatch is delayed by
:data:`DELAY_MS` (a reminder, a retry's backoff: work that waits in Redis for a while). The
ledger: **lost** = ids ``dispatch`` returned that never ran; **ran twice** = ids that completed
more than once; **in flight** = runs started and not completed when the primary went away;
**outage** = the time from the first failed dispatch to the last (``dispatch`` raised
``RedisUnavailableError`` meanwhile). Each case runs with Redis's defaults (asynchronous
replication) and with the settings docs/deploying.md recommends on every data node
(:data:`RECOMMENDED`). Then the cost: dispatches per second from one producer thread, as fast as
it can, for both settings (medians of :data:`COST_ROUNDS` alternating rounds).

Results go to stdout and ``benchmarks/results/failover.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kumiko_dramatiq import Feature, JobContext, JobMeta, JobRunner, Registry
from kumiko_dramatiq.errors import RedisUnavailableError
from tests.deployment import SentinelGroup, sentinel_group, wait_for_fail_over

RESULTS = Path(__file__).parent / "results" / "failover.json"
PREFIX = "failover"
JOB = "fo:job:work"
#: Every data node: refuse writes unless one replica acknowledged within 2 s.
RECOMMENDED = ("--min-replicas-to-write", "1", "--min-replicas-max-lag", "2")
SETTINGS: dict[str, tuple[str, ...]] = {"default": (), "recommended": RECOMMENDED}
CASES = [f"{kind}-{setting}" for kind in ("planned", "crash") for setting in SETTINGS]
RATE_PER_S = 200
WORK_MS = 10
DELAY_MS = 2_000
BEFORE_S = 2.0
AFTER_S = 2.0
COST_ROUNDS = 3
COST_DISPATCHES = 3_000


def registry() -> Registry:
    feature = Feature("fo")

    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        time.sleep(WORK_MS / 1000)

    feature.job("work")(work)
    return Registry([feature])


@dataclass
class Ledger:
    starts: dict[str, list[float]] = field(default_factory=dict)
    completions: dict[str, list[float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_job_start(self, job: str, message_id: str, meta: JobMeta) -> None:
        with self.lock:
            self.starts.setdefault(message_id, []).append(time.monotonic())

    def on_job_complete(self, job: str, message_id: str, meta: JobMeta) -> None:
        with self.lock:
            self.completions.setdefault(message_id, []).append(time.monotonic())

    def in_flight(self, at: float) -> int:
        with self.lock:
            ended = {m for m, ends in self.completions.items() if any(t <= at for t in ends)}
            return sum(1 for m, starts in self.starts.items() if starts[0] <= at and m not in ended)


class Producer(threading.Thread):
    """Dispatches at ``rate_per_s`` until stopped; notes every id returned, and every error
    (then the same dispatch is tried again after 20 ms)."""

    def __init__(self, runner: JobRunner, rate_per_s: float) -> None:
        super().__init__(daemon=True)
        self.runner = runner
        self.period_s = 1 / rate_per_s
        self.accepted: list[tuple[str, float]] = []
        self.errors: list[float] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        n, next_at = 0, time.monotonic()
        while not self.stopping.is_set():
            try:
                delay_ms = DELAY_MS if n % 2 else None
                message_id = self.runner.dispatch(JOB, {"n": n}, delay_ms=delay_ms)
            except RedisUnavailableError:
                self.errors.append(time.monotonic())
                self.stopping.wait(0.02)
                continue
            self.accepted.append((message_id, time.monotonic()))
            n += 1
            next_at += self.period_s
            self.stopping.wait(max(0.0, next_at - time.monotonic()))

    def accepted_since(self, at: float) -> int:
        return sum(1 for _, t in self.accepted if t >= at)


def runner(url: str, ledger: Ledger | None = None, **options: Any) -> JobRunner:
    hooks: dict[str, Any] = {}
    if ledger is not None:
        hooks = {"on_job_start": ledger.on_job_start, "on_job_complete": ledger.on_job_complete}
    return JobRunner(
        registry(),
        redis_url=url,
        queue_prefix=PREFIX,
        boot_redis_timeout_ms=2_000,
        **hooks,
        **options,
    )


def fail_over(group: SentinelGroup, kind: str) -> None:
    if kind == "crash":
        group.primary.kill()
        return
    client = group.sentinels[0].client()
    try:
        client.execute_command("SENTINEL", "FAILOVER", group.master)  # type: ignore[no-untyped-call]
    finally:
        client.close()


def wait_for_demotion(group: SentinelGroup, timeout_s: float = 40) -> float:
    """Until the old primary reports itself a replica (the sentinels reconfigured it)."""
    client = group.primary.client()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            role: Any = client.execute_command("ROLE")  # type: ignore[no-untyped-call]
            if role[0] in (b"slave", "slave"):
                return time.monotonic()
            time.sleep(0.05)
    finally:
        client.close()
    raise AssertionError("the old primary was not demoted")


def one_run(kind: str, setting: str) -> dict[str, Any]:
    ledger = Ledger()
    with (
        tempfile.TemporaryDirectory(prefix="kumiko-failover-") as directory,
        sentinel_group(Path(directory), replicas=2, data_args=SETTINGS[setting]) as group,
    ):
        url = group.url()
        workers = [runner(url, ledger, worker_threads=4) for _ in range(2)]
        producer_runner = runner(url)
        for worker in workers:
            worker.start()
        producer = Producer(producer_runner, RATE_PER_S)
        producer.start()
        try:
            time.sleep(BEFORE_S)  # steady load before the fail-over
            began = time.monotonic()
            in_flight = ledger.in_flight(began)
            fail_over(group, kind)
            switched = wait_for_fail_over(group)
            if kind == "planned":
                switched = wait_for_demotion(group)
            # the load goes on until AFTER_S of dispatches went through after the switch
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                back = max(producer.errors, default=began)
                if time.monotonic() - max(back, switched) >= AFTER_S:
                    break
                time.sleep(0.05)
        finally:
            producer.stopping.set()
            producer.join(timeout=10)
        accepted = {message_id for message_id, _ in producer.accepted}
        drain_deadline = time.monotonic() + 30
        while time.monotonic() < drain_deadline:
            with ledger.lock:
                missing = accepted - set(ledger.completions)
            if not missing:
                break
            time.sleep(0.1)
        time.sleep(0.5)  # late duplicates
        for worker in workers:
            worker.stop(timeout_s=10)
        producer_runner.stop()
    with ledger.lock:
        lost = accepted - set(ledger.completions)
        twice = {m for m, ends in ledger.completions.items() if len(ends) > 1}
    errors = producer.errors
    return {
        "accepted": len(accepted),
        "lost": len(lost),
        "ran_twice": len(twice),
        "in_flight_at_switch": in_flight,
        "promotion_s": round(switched - began, 2),
        "outage_s": round(max(errors) - min(errors), 2) if errors else 0.0,
        "failed_dispatches": len(errors),
    }


def cost(setting: str) -> float:
    """Dispatches per second from one producer thread on a Sentinel URL."""
    with (
        tempfile.TemporaryDirectory(prefix="kumiko-failover-") as directory,
        sentinel_group(Path(directory), replicas=2, data_args=SETTINGS[setting]) as group,
    ):
        producer = runner(group.url())
        try:
            for n in range(200):  # warm up: connections, scripts
                producer.dispatch(JOB, {"n": n})
            began = time.perf_counter()
            for n in range(COST_DISPATCHES):
                producer.dispatch(JOB, {"n": n})
            return COST_DISPATCHES / (time.perf_counter() - began)
        finally:
            producer.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", action="append", choices=[*CASES, "cost"])
    args = parser.parse_args(argv)
    wanted = args.only or [*CASES, "cost"]
    out: dict[str, Any] = {
        "rate_per_s": RATE_PER_S,
        "recommended": " ".join(RECOMMENDED),
        "topology": "primary + 2 replicas + 3 sentinels on one machine",
    }
    for case in CASES:
        if case not in wanted:
            continue
        kind, setting = case.split("-")
        runs = []
        for n in range(args.runs):
            result = one_run(kind, setting)
            print(f"{case} run {n + 1}: {result}", flush=True)
            runs.append(result)
        out[case] = {
            "runs": runs,
            "lost": [r["lost"] for r in runs],
            "ran_twice": [r["ran_twice"] for r in runs],
            "in_flight_at_switch": [r["in_flight_at_switch"] for r in runs],
            "outage_s_median": statistics.median(r["outage_s"] for r in runs),
        }
    if "cost" in wanted:
        samples: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
        for round_ in range(COST_ROUNDS):
            order = list(SETTINGS) if round_ % 2 == 0 else list(SETTINGS)[::-1]
            for setting in order:
                samples[setting].append(cost(setting))
        medians = {setting: round(statistics.median(v)) for setting, v in samples.items()}
        out["cost_dispatches_per_s"] = {
            **medians,
            "ratio_recommended_to_default": round(medians["recommended"] / medians["default"], 3),
        }
        print(f"cost: {out['cost_dispatches_per_s']}", flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    previous: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    RESULTS.write_text(json.dumps({**previous, **out}, indent=2) + "\n")
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
