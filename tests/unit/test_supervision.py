"""The pure pieces of supervision and health, and the deferred writes' retry list (its writes
are plain callables here: no Redis)."""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta

import pytest
import redis

from kumiko_dramatiq import Cron, Feature, JobContext, Manual, Registry
from kumiko_dramatiq.broker.outage import MAX_BACKOFF_MS, Outage, backoff_ms
from kumiko_dramatiq.middleware.presence import ProcessInfo, eviction_problem, stale_after_ms
from kumiko_dramatiq.ops.health import HealthReading, problems
from kumiko_dramatiq.worker.supervision import Deferred, stuck_after_s

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def process(**changes: object) -> ProcessInfo:
    fields: dict[str, object] = {
        "id": "w1",
        "role": "worker",
        "host": "h",
        "pid": 7,
        "lane": "worker",
        "version": "1",
        "started_at": NOW - timedelta(hours=1),
        "last_seen": NOW,
    }
    fields.update(changes)
    return ProcessInfo(**fields)  # type: ignore[arg-type]


def registry(*, cron: bool) -> Registry:
    feature = Feature("h")

    @feature.job("tick", trigger=Cron("* * * * *") if cron else Manual())
    def tick(payload: dict[str, object], ctx: JobContext) -> None: ...

    return Registry([feature])


HEALTHY = HealthReading("noeviction", None, "")


def test_the_backoff_doubles_up_to_a_second() -> None:
    assert [backoff_ms(n) for n in range(0, 7)] == [0, 50, 100, 200, 400, 800, 1000]
    assert backoff_ms(10_000) == MAX_BACKOFF_MS


def test_an_outage_is_logged_once_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kumiko_dramatiq")
    outage = Outage("the consumer of q")
    for _ in range(5):
        outage.failed(redis.ConnectionError("gone"))
    outage.succeeded()
    outage.succeeded()
    lines = [r.getMessage() for r in caplog.records]
    assert len([line for line in lines if "Redis fails" in line]) == 1
    assert len([line for line in lines if "answers again" in line]) == 1
    # and a flapping Redis (a new outage at once) is not logged again at WARNING
    outage.failed(redis.ConnectionError("gone again"))
    outage.succeeded()
    loud = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(loud) == 2


def test_a_stuck_consumer_is_one_far_beyond_its_longest_wait() -> None:
    assert stuck_after_s(200, 5.0) == 30.0
    assert stuck_after_s(10_000, 5.0) == 4 * 25.0


def test_a_record_is_stale_after_two_missed_refreshes() -> None:
    assert stale_after_ms(3_000) == 3_000


def test_only_noeviction_is_no_problem() -> None:
    assert eviction_problem("noeviction") is None
    problem = eviction_problem("allkeys-lru")
    assert problem is not None
    assert "allkeys-lru" in problem
    assert "noeviction" in problem


def test_a_healthy_dataset_has_no_problem() -> None:
    assert problems(HEALTHY, registry(cron=False), [process()], [], NOW) == []


@pytest.mark.parametrize(
    ("reading", "workers", "cron", "schedulers", "expected"),
    [
        (HEALTHY, [process(stale=True, last_seen=NOW - timedelta(seconds=42))], False, [],
         "worker h:7 (worker) has not refreshed its liveness for 42 s"),
        (HEALTHY, [process(issues=("consumer of q ended; restarting it",), consumers_down=1)],
         False, [], "worker h:7 (worker): consumer of q ended"),
        (HealthReading("volatile-lru", None, ""), [], False, [], "volatile-lru, not noeviction"),
        (HealthReading("noeviction", NOW, "h:7"), [], False, [], "dataset was reset"),
        (HEALTHY, [], True, [], "1 cron job(s) declared but no scheduler is alive"),
    ],
)  # fmt: skip
def test_each_problem_is_one_line(
    reading: HealthReading,
    workers: list[ProcessInfo],
    cron: bool,
    schedulers: list[ProcessInfo],
    expected: str,
) -> None:
    (found,) = problems(reading, registry(cron=cron), workers, schedulers, NOW)
    assert expected in found
    assert "\n" not in found


def test_a_scheduler_alive_is_no_cron_problem() -> None:
    scheduler = process(role="scheduler", lane=None)
    assert problems(HEALTHY, registry(cron=True), [], [scheduler], NOW) == []


def test_a_worker_with_an_issue_or_stale_is_not_healthy() -> None:
    assert process().healthy
    assert not process(stale=True).healthy
    assert not process(issues=("x",), consumers_down=1).healthy


def test_a_deferred_write_is_retried_until_it_lands() -> None:
    deferred = Deferred("t")
    landed = threading.Event()
    failures = iter([redis.ConnectionError("a"), redis.TimeoutError("b"), None])

    def write() -> None:
        failure = next(failures)
        if failure is not None:
            raise failure
        landed.set()

    deferred.add("a write", write, bound_ms=1_000)
    assert landed.wait(10)
    deferred.stop()
    assert deferred.pending == 0


def test_writes_left_at_stop_are_logged_with_their_bound(caplog: pytest.LogCaptureFixture) -> None:
    deferred = Deferred("t")

    def never() -> None:
        raise redis.ConnectionError("away")

    deferred.add("release of lock L", never, bound_ms=30_000)
    deferred.stop(timeout_s=0.1)
    assert any(
        "release of lock L" in r.getMessage() and "30000 ms" in r.getMessage()
        for r in caplog.records
    )
    assert deferred.pending == 0
