"""Debounce on dedup keys: while the keyed job has not started, the last payload wins and
its start moves back, never past the max wait. Real Redis, real workers."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis

from kumiko_dramatiq import Feature, JobContext, PayloadError, Registry
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.ids import redis_message_id
from tests.conftest import Recorder, RunnerFactory

JOB = "debounce:job:sync"


def registry(seen: list[dict[str, Any]], release: threading.Event | None = None) -> Registry:
    feature = Feature("debounce")

    @feature.job("sync")
    def sync(payload: dict[str, Any], ctx: JobContext) -> None:
        seen.append(payload)
        if release is not None:
            release.wait(30)

    return Registry([feature])


def due_ms(client: redis.Redis, prefix: str, message_id: str) -> float:
    score = client.zscore(keys.queue_schedule(f"{prefix}-worker"), redis_message_id(message_id))
    assert score is not None
    return float(score)


def test_a_burst_runs_once_with_the_last_payload(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    seen: list[dict[str, Any]] = []
    runner = make_runner(registry(seen), **recorder.hooks())
    ids = {runner.dispatch(JOB, {"n": n}, dedup_key="acme", debounce_ms=600_000) for n in range(5)}
    assert len(ids) == 1
    (queued,) = runner.admin.queued(limit=10)
    assert queued.payload == {"n": 4}
    assert runner.run_now(queued.message_id)  # rather than wait the debounce out
    runner.start()
    runner.drain(timeout_s=30)
    assert seen == [{"n": 4}]
    assert [e.message_id for e in recorder.of("complete")] == list(ids)


def test_each_dispatch_moves_the_start_back_never_past_the_max_wait(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry([]))
    first = runner.dispatch(JOB, {"n": 1}, dedup_key="k", debounce_ms=600_000, max_wait_ms=900_000)
    due = due_ms(redis_client, prefix, first)
    again = runner.dispatch(JOB, {"n": 2}, dedup_key="k", debounce_ms=600_000)
    assert again == first
    assert due_ms(redis_client, prefix, first) >= due
    # a longer debounce would go past the max wait: the start is the deadline
    latest = runner.dispatch(JOB, {"n": 3}, dedup_key="k", debounce_ms=3_000_000)
    assert latest == first
    assert abs(due_ms(redis_client, prefix, first) - (due - 600_000 + 900_000)) <= 5
    assert runner.admin.queued(limit=10)[0].payload == {"n": 3}
    assert runner.admin.job_counts()[JOB]["delayed"] == 1


def test_once_it_started_the_dedup_rules_apply(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    seen: list[dict[str, Any]] = []
    release = threading.Event()
    runner = make_runner(registry(seen, release), **recorder.hooks())
    first = runner.dispatch(JOB, {"n": 1}, dedup_key="k", debounce_ms=50)
    runner.start()
    recorder.wait_until(lambda r: len(r.of("start")) == 1)
    follow_up = runner.dispatch(JOB, {"n": 2}, dedup_key="k", debounce_ms=50)
    assert follow_up != first
    assert runner.dispatch(JOB, {"n": 3}, dedup_key="k", debounce_ms=50) == follow_up
    release.set()
    recorder.wait_until(lambda r: len(r.of("complete")) == 2)
    assert seen == [{"n": 1}, {"n": 3}]


def test_bad_debounce_arguments_are_refused_nothing_enqueued(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry([]))
    bad: list[tuple[dict[str, Any], str]] = [
        ({"debounce_ms": 100}, "debounce_ms needs a dedup_key"),
        ({"dedup_key": "k", "max_wait_ms": 100}, "max_wait_ms needs a debounce_ms"),
        ({"dedup_key": "k", "debounce_ms": 100, "delay_ms": 5}, "cannot go with a delay_ms"),
        ({"dedup_key": "k", "debounce_ms": 0}, "debounce_ms must be an integer >= 1"),
        ({"dedup_key": "k", "debounce_ms": True}, "debounce_ms must be an integer >= 1"),
        ({"dedup_key": "k", "debounce_ms": 10, "max_wait_ms": "5"}, "max_wait_ms must be"),
    ]
    for arguments, message in bad:
        with pytest.raises(PayloadError, match=message):
            runner.dispatch(JOB, {}, **arguments)
    assert runner.admin.queued(limit=10) == []
