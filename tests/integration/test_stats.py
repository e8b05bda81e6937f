"""Per-job hourly stats: counts by outcome and duration percentiles, kept by the run writes."""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from kumiko_dramatiq import (
    Backoff,
    Feature,
    JobConfigError,
    JobContext,
    JobRunner,
    JobStats,
    Registry,
    UnknownJobError,
)
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.ops.stats import bucket, bucket_value
from tests.conftest import RunnerFactory, wait_for


def registry() -> Registry:
    feature = Feature("st")

    @feature.job("ok")
    def ok(payload: dict[str, Any], ctx: JobContext) -> None: ...

    @feature.job("flaky", retries=1, backoff=Backoff("fixed", delay_ms=10))
    def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
        if ctx.attempt == 1:
            raise ValueError("first attempt fails")

    @feature.job("doomed")
    def doomed(payload: dict[str, Any], ctx: JobContext) -> None:
        raise ValueError("always fails")

    return Registry([feature])


def put(runner: JobRunner, job: str, status: str, duration_ms: int, *, at_ms: int) -> str:
    """One record written as the settle's Lua writes it (run_put: the same put_run)."""
    message_id = uuid.uuid4().hex
    record = {"j": job, "m": message_id, "o": message_id, "tr": "manual", "a": 1, "ma": 1}
    record.update(s=status, st=at_ms - duration_ms, en=at_ms, d=duration_ms)
    history = runner.history
    history.lua.run_put(
        keys=[keys.run_record(runner.queue_prefix, message_id)],
        args=[
            history.root,
            *(message_id, 1, job, status, "", message_id, at_ms),
            json.dumps(record, separators=(",", ":")),
            *(3_600_000, 3_600_000, 100_000, 0, at_ms - duration_ms),
        ],
    )
    return message_id


def test_attempts_are_counted_per_job_and_hour_by_outcome(make_runner: RunnerFactory) -> None:
    # Given: a worker; ok runs 3 times, flaky fails once then completes, doomed dies, and a
    # delayed ok is cancelled
    runner = make_runner(registry())
    runner.start()
    for _ in range(3):
        runner.dispatch("st:job:ok")
    flaky = runner.dispatch("st:job:flaky")
    doomed = runner.dispatch("st:job:doomed")
    assert runner.cancel(runner.dispatch("st:job:ok", delay_ms=600_000))
    wait_for(
        lambda: (
            [r.status for r in runner.run_record(flaky)] == ["failed", "completed"]
            and [r.status for r in runner.run_record(doomed)] == ["dead"]
        ),
        what="flaky to complete and doomed to die",
    )
    wait_for(lambda: len(runner.runs("st:job:ok", status="completed")) == 3, what="ok x3")

    # When: the stats are read
    stats = {s.job_name: s for s in runner.stats()}

    # Then: one row per job in this hour, each outcome counted once
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    assert set(stats) == {"st:job:ok", "st:job:flaky", "st:job:doomed"}
    assert all(isinstance(s, JobStats) and s.hour == hour for s in stats.values())
    ok, flaky_stats, dead = stats["st:job:ok"], stats["st:job:flaky"], stats["st:job:doomed"]
    assert (ok.completed, ok.failed, ok.dead, ok.cancelled) == (3, 0, 0, 1)
    assert (flaky_stats.completed, flaky_stats.failed, flaky_stats.dead) == (1, 1, 0)
    assert (dead.completed, dead.failed, dead.dead, dead.p50_ms) == (0, 0, 1, None)
    assert ok.p50_ms is not None
    assert ok.p95_ms is not None
    assert [s.job_name for s in runner.stats("st:job:ok", hours=1)] == ["st:job:ok"]


def test_percentiles_are_within_five_percent(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry())
    now_ms = int(time.time() * 1000)
    durations = [7 * n for n in range(1, 401)]  # 7 ms .. 2.8 s
    for duration in durations:
        put(runner, "st:job:ok", "completed", duration, at_ms=now_ms)
    (stats,) = runner.stats("st:job:ok", hours=1)
    assert stats.completed == 400
    p50, p95 = durations[199], durations[379]
    assert stats.p50_ms is not None
    assert stats.p95_ms is not None
    assert abs(stats.p50_ms - p50) <= 0.05 * p50
    assert abs(stats.p95_ms - p95) <= 0.05 * p95


def test_a_record_written_again_counts_once_and_hours_are_apart(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(registry())
    now_ms = int(time.time() * 1000)
    message_id = put(runner, "st:job:ok", "completed", 5, at_ms=now_ms)
    record = runner.run_record(message_id)[0]
    assert record.status == "completed"
    # the same record again (a settle retried after a lost reply)
    history = runner.history
    raw = runner.broker.client.hget(keys.run_record(runner.queue_prefix, message_id), "1")
    assert isinstance(raw, bytes)
    history.lua.run_put(
        keys=[keys.run_record(runner.queue_prefix, message_id)],
        args=[
            history.root,
            *(message_id, 1, "st:job:ok", "completed", "", message_id, now_ms, raw),
            *(3_600_000, 3_600_000, 100_000, 0, now_ms - 5),
        ],
    )
    put(runner, "st:job:ok", "failed", 5, at_ms=now_ms - 3_600_000)
    stats = runner.stats("st:job:ok", hours=2)
    assert [(s.completed, s.failed) for s in stats] == [(1, 0), (0, 1)]
    assert stats[0].hour > stats[1].hour
    hour = now_ms // 3_600_000
    assert runner.broker.client.pttl(keys.job_stats(runner.queue_prefix, "st:job:ok", hour)) > 0
    assert (
        runner.broker.client.pttl(keys.job_stats(runner.queue_prefix, "st:job:ok", hour))
        <= 8 * 86_400_000
    )


def test_a_completed_attempt_is_one_count_and_an_older_writers_two_add_up(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(registry())
    now_ms = int(time.time() * 1000)
    hour = now_ms // 3_600_000
    stats_key = keys.job_stats(runner.queue_prefix, "st:job:ok", hour)
    client = runner.broker.client
    # Given two completed attempts of 5 ms written as kumiko writes them now: one field each
    put(runner, "st:job:ok", "completed", 5, at_ms=now_ms)
    put(runner, "st:job:ok", "completed", 5, at_ms=now_ms)
    assert {text(f): int(v) for f, v in client.hgetall(stats_key).items()} == {"c5": 2}
    # and three of 100 ms counted by a worker of an earlier release (in "completed" and in
    # their duration's "b" bucket), as during a rolling upgrade
    client.hincrby(stats_key, "completed", 3)
    client.hincrby(stats_key, f"b{bucket(100)}", 3)
    # Then the hour's stats count five completed attempts, their durations all counted
    (stats,) = runner.stats("st:job:ok", hours=1)
    assert stats.completed == 5
    assert stats.p50_ms is not None
    assert abs(stats.p50_ms - 100) <= 5
    assert stats.p95_ms is not None
    assert abs(stats.p95_ms - 100) <= 5


def test_bad_arguments_are_refused(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry())
    with pytest.raises(UnknownJobError):
        runner.stats("st:job:nope")
    for hours in (0, 169, True, 2.0):
        with pytest.raises(JobConfigError, match="hours"):
            runner.stats(hours=hours)  # type: ignore[arg-type]


def test_the_buckets_read_back_within_five_percent() -> None:
    for duration in [*range(0, 200), *range(200, 200_000, 97)]:
        value = bucket_value(bucket(duration))
        assert abs(value - duration) <= 0.05 * max(duration, 1), duration
