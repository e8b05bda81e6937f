"""Concurrency caps (``max_running``) and rate limits (``rate_limit``) across runners.

Real Redis, real workers: several runners (each its own broker and threads, as separate
hosts would be) consume one dataset; every start and end of a run is written to a ledger
from inside the handler, and the ledger is checked: at no instant do more runs overlap than
the cap allows, no attempt is spent waiting, and nothing is lost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from kumiko_dramatiq import (
    Feature,
    JobConfigError,
    JobContext,
    RateLimit,
    Registry,
    build_message_options,
)
from kumiko_dramatiq.broker import keys
from tests.conftest import Recorder, RunnerFactory, wait_for

JOB = "caps:job:work"


class Ledger:
    """Start and end instants of every run (monotonic), in the order they happened."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[tuple[float, int, str]] = []  # (time, +1 start / -1 end, id)
        self.running = 0
        self.peak = 0

    def start(self, message_id: str) -> None:
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.events.append((time.monotonic(), 1, message_id))

    def end(self, message_id: str) -> None:
        with self._lock:
            self.running -= 1
            self.events.append((time.monotonic(), -1, message_id))

    def starts(self) -> list[float]:
        with self._lock:
            return [t for t, kind, _ in self.events if kind == 1]


def capped(
    ledger: Ledger,
    hold_s: float = 0.05,
    fail: Callable[[dict[str, Any]], bool] | None = None,
    **options: Any,
) -> Registry:
    feature = Feature("caps")

    @feature.job("work", **options)
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        ledger.start(ctx.message_id)
        try:
            time.sleep(payload.get("hold_s", hold_s))
            if fail is not None and fail(payload) and ctx.attempt == 1:
                raise RuntimeError("first attempt fails")
        finally:
            ledger.end(ctx.message_id)

    @feature.job("free")
    def free(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    return Registry([feature])


def test_max_running_is_never_exceeded_across_runners(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ledger = Ledger()
    registry = capped(ledger, max_running=2, retries=1, fail=lambda p: p["n"] % 5 == 0)
    runners = [make_runner(registry, worker_threads=4, **recorder.hooks()) for _ in range(3)]
    ids = [runners[0].dispatch(JOB, {"n": n}) for n in range(30)]
    for runner in runners:
        runner.start()
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 30, timeout_s=60)
    assert ledger.peak <= 2
    assert ledger.peak == 2  # the cap was used, not a single file
    # no attempt spent waiting: only the failures planted took a second attempt
    attempts = {e.message_id: e.meta.attempt for e in recorder.of("complete", JOB)}
    assert sorted(attempts) == sorted(ids)
    assert {m for m, a in attempts.items() if a == 2} == {ids[n] for n in range(0, 30, 5)}
    assert len(recorder.of("failed", JOB)) == 6
    # every slot is given back (by the settle, right after the hook), nothing waits
    wait_for(lambda: redis_client.zcard(keys.cap_slots(prefix, JOB)) == 0, what="slots back")
    assert redis_client.llen(keys.cap_wait(prefix, JOB)) == 0
    assert int(redis_client.hget(keys.cap_waits(prefix), JOB) or 0) == 0


def test_waiting_message_holds_no_thread_other_jobs_flow(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ledger = Ledger()
    registry = capped(ledger, hold_s=0.5, max_running=1)
    runner = make_runner(registry, worker_threads=2, **recorder.hooks())
    for n in range(6):
        runner.dispatch(JOB, {"n": n})
    runner.start()
    recorder.wait_until(lambda r: len(r.of("start", JOB)) == 1)
    # five wait in Redis, in the waiting list, not in the worker: a free job still runs
    wait_for(lambda: redis_client.llen(keys.cap_wait(prefix, JOB)) == 5, what="five waiting")
    free_id = runner.dispatch("caps:job:free")
    recorder.wait_until(lambda r: any(e.message_id == free_id for e in r.of("complete")))
    assert len(recorder.of("complete", JOB)) == 0
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 6, timeout_s=30)
    assert ledger.peak == 1
    assert all(e.meta.attempt == 1 for e in recorder.of("start", JOB))


def test_waiters_start_in_arrival_order(make_runner: RunnerFactory, recorder: Recorder) -> None:
    ledger = Ledger()
    registry = capped(ledger, hold_s=0.02, max_running=1)
    runner = make_runner(registry, worker_threads=4, **recorder.hooks())
    ids = [runner.dispatch(JOB, {"n": n}) for n in range(12)]
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 12, timeout_s=30)
    assert [e.message_id for e in recorder.of("start", JOB)] == ids


def test_rate_limit_is_respected(make_runner: RunnerFactory, recorder: Recorder) -> None:
    ledger = Ledger()
    registry = capped(ledger, hold_s=0.0, rate_limit=RateLimit(5, 1_000))
    runners = [make_runner(registry, worker_threads=4, **recorder.hooks()) for _ in range(2)]
    for n in range(15):
        runners[0].dispatch(JOB, {"n": n})
    for runner in runners:
        runner.start()
    recorder.wait_until(lambda r: len(r.of("complete", JOB)) == 15, timeout_s=30)
    starts = sorted(ledger.starts())
    # at most 5 starts in any window of 1 s (a little slack for the local clock vs Redis's)
    for i in range(len(starts) - 5):
        assert starts[i + 5] - starts[i] >= 0.95, starts
    # and it does not wait much longer than it must: 15 starts need two more windows
    assert starts[-1] - starts[0] < 2.0 + 1.5
    assert all(e.meta.attempt == 1 for e in recorder.of("start", JOB))


def test_per_tenant_children_share_the_cap_wrapper_takes_no_slot(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    ledger = Ledger()
    tenants = [f"t{n}" for n in range(8)]
    registry = capped(ledger, hold_s=0.1, per_tenant=True, max_running=2)
    runner = make_runner(
        registry, worker_threads=6, get_active_tenant_ids=lambda: tenants, **recorder.hooks()
    )
    runner.dispatch(JOB, {})
    runner.start()
    recorder.wait_until(
        lambda r: len([e for e in r.of("complete", JOB) if e.meta.tenant_id]) == 8,
        timeout_s=30,
    )
    assert ledger.peak == 2
    wait_for(lambda: redis_client.zcard(keys.cap_slots(prefix, JOB)) == 0, what="slots back")


def test_per_tenant_rate_limit_keeps_a_window_per_tenant(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    ledger = Ledger()
    tenants = ["a", "b", "c"]
    registry = capped(
        ledger, hold_s=0.0, per_tenant=True, rate_limit=RateLimit(1, 60_000, per_tenant=True)
    )
    runner = make_runner(
        registry, worker_threads=4, get_active_tenant_ids=lambda: tenants, **recorder.hooks()
    )
    runner.dispatch(JOB, {})
    runner.dispatch(JOB, {})
    runner.start()
    # one run per tenant starts at once; the second round waits a minute
    recorder.wait_until(
        lambda r: len([e for e in r.of("complete", JOB) if e.meta.tenant_id]) == 3,
        timeout_s=30,
    )
    status = runner.status()
    lane = next(each for each in status.lanes if each.lane == "worker")
    assert lane.queued == 3  # the waiting children count as queued
    assert sorted(e.meta.tenant_id for e in recorder.of("start", JOB) if e.meta.tenant_id) == [
        "a",
        "b",
        "c",
    ]


def test_caps_ride_in_the_message_options(make_runner: RunnerFactory) -> None:
    registry = capped(Ledger(), max_running=3, rate_limit=RateLimit(10, 1_000))
    job = registry.jobs[JOB]
    assert build_message_options(job)["kumiko_caps"] == {
        "max_running": 3,
        "rate_limit": [10, 1_000, False],
    }
    assert "kumiko_caps" not in build_message_options(registry.jobs["caps:job:free"])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"max_running": 0}, r"caps:job:bad: max_running must be an integer >= 1 or None, got 0"),
        ({"max_running": True}, r"max_running must be an integer >= 1 or None, got True"),
        ({"max_running": 2.0}, r"max_running must be an integer >= 1 or None, got 2.0"),
        ({"max_running": "3"}, r"max_running must be an integer >= 1 or None, got '3'"),
        ({"rate_limit": RateLimit(0, 1_000)}, r"rate_limit.count must be a positive integer"),
        ({"rate_limit": RateLimit(1, 0)}, r"rate_limit.per_ms must be a positive integer, got 0"),
        ({"rate_limit": RateLimit(1, -5)}, r"rate_limit.per_ms must be a positive integer"),
        ({"rate_limit": RateLimit(True, 5)}, r"rate_limit.count must be a positive integer"),
        ({"rate_limit": RateLimit(1, 5.0)}, r"rate_limit.per_ms must be a positive integer"),
        ({"rate_limit": (1, 5)}, r"rate_limit must be None or RateLimit"),
        (
            {"rate_limit": RateLimit(1, 5, per_tenant=True)},
            r"rate_limit.per_tenant needs per_tenant=True",
        ),
        ({"boot_gate": True, "max_running": 1}, r"max_running with boot_gate=True"),
        ({"boot_gate": True, "rate_limit": RateLimit(1, 5)}, r"rate_limit with boot_gate=True"),
    ],
)
def test_invalid_caps_are_one_config_error(options: dict[str, Any], match: str) -> None:
    feature = Feature("caps")
    with pytest.raises(JobConfigError, match=match) as caught:
        feature.job("bad", **options)
    assert "\n" not in str(caught.value)
    assert "caps:job:bad" in str(caught.value)
