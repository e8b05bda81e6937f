"""Bulk clean-up: ``runner.purge(job, state=...)`` and ``runner.delete_dead``; what they
remove never runs, what they leave runs, dedup keys they held are freed, nothing else moves."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kumiko_dramatiq import Feature, JobContext, JobRunner, NotFoundError, Registry
from kumiko_dramatiq.ops import admin
from tests.conftest import Recorder, RunnerFactory, wait_for

GONE = "clean:job:gone"
KEPT = "clean:job:kept"
DIES = "clean:job:dies"


def noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


def dies(payload: dict[str, Any], ctx: JobContext) -> None:
    raise RuntimeError("boom")


def registry() -> Registry:
    feature = Feature("clean")
    feature.job("gone")(noop)
    feature.job("kept")(noop)
    feature.job("dies", retries=0)(dies)
    return Registry([feature])


@pytest.fixture(autouse=True, params=["default steps", "one body a step"])
def step_bytes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every purge here also with steps of one body each (a byte budget of 1): each walk
    then resumes after every entry, in every mode (list offsets, heads popped, HSCAN counts,
    tenant groups)."""
    if request.param == "one body a step":
        monkeypatch.setattr(admin, "PURGE_STEP_BYTES", 1)


def ran(recorder: Recorder, job: str) -> list[str]:
    return [event.message_id for event in recorder.of("start", job)]


def test_purge_queued_removes_only_that_jobs_waiting_messages(
    make_runner: RunnerFactory, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    runner = make_runner(registry(), **recorder.hooks())
    # given 450 of one job and 30 of another, interleaved (more than two purge steps)
    for n in range(15):
        runner.dispatch_many(GONE, [{"n": n}] * 30)
        runner.dispatch(KEPT, {"n": n})
        runner.dispatch(KEPT, {"n": n})
    keyed = runner.dispatch(GONE, {}, dedup_key="k")
    assert runner.purge(GONE, dry_run=True) == 451
    assert runner.status().lanes[0].queued == 481  # a dry run changes nothing
    with caplog.at_level(logging.WARNING, logger="kumiko_dramatiq"):
        assert runner.purge(GONE) == 451
    assert [r.message for r in caplog.records if "purged" in r.message] == [
        f"purged 451 queued message(s) of {GONE}"
    ]
    assert runner.status().lanes[0].queued == 30
    assert runner.dedup_keys(GONE) == []
    assert runner.dispatch(GONE, {}, dedup_key="k") != keyed  # the key is free again
    assert runner.purge(GONE) == 1
    assert runner.purge(GONE) == 0
    # no run record per purged message
    assert runner.run_record(keyed) == []
    runner.start()
    runner.drain(timeout_s=30)
    assert ran(recorder, GONE) == []
    assert len(ran(recorder, KEPT)) == 30


def test_purge_delayed_removes_that_jobs_delayed_messages(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    runner = make_runner(registry(), **recorder.hooks())
    runner.dispatch_many(GONE, [{}] * 250, delay_ms=300)
    kept = runner.dispatch(KEPT, {}, delay_ms=300)
    queued = runner.dispatch(GONE, {})
    assert runner.purge(GONE, state="delayed", dry_run=True) == 250
    assert runner.purge(GONE, state="delayed") == 250
    assert runner.status().lanes[0].delayed == 1
    runner.start()
    recorder.wait_until(lambda r: kept in ran(r, KEPT), what="the kept delayed message")
    runner.drain(timeout_s=30)
    assert ran(recorder, GONE) == [queued]


def test_purge_parked_and_dead(make_runner: RunnerFactory, recorder: Recorder) -> None:
    runner = make_runner(registry(), **recorder.hooks())
    runner.pause(GONE)
    runner.dispatch_many(GONE, [{}] * 5)
    runner.dispatch_many(DIES, [{}] * 3)
    runner.start()
    wait_for(lambda: runner.status().lanes[0].parked == 5, what="five parked")
    wait_for(lambda: len(runner.dead_letters()) == 3, what="three dead letters")
    assert runner.purge(GONE, state="parked", dry_run=True) == 5
    assert runner.purge(GONE, state="parked") == 5
    assert runner.status().lanes[0].parked == 0
    assert runner.purge(DIES, state="dead") == 3
    assert runner.dead_letters() == []
    assert runner.status().lanes[0].dead == 0
    runner.resume(GONE)
    runner.drain(timeout_s=30)
    assert ran(recorder, GONE) == []


def test_delete_dead_and_the_wrong_state(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry())
    waiting = runner.dispatch(KEPT, {})
    dead = runner.dispatch(DIES, {})
    runner.start()
    wait_for(lambda: len(runner.dead_letters()) == 1, what="the dead letter")
    runner.drain(timeout_s=30)
    assert runner.delete_dead(dead) is True
    assert runner.dead_letters() == []
    # then it is known and no longer dead
    assert runner.delete_dead(dead) is False
    assert runner.retry_dead(dead) is False
    assert runner.retry_dead(waiting) is False
    unknown = "00000000-0000-4000-8000-000000000000"
    with pytest.raises(NotFoundError):
        runner.delete_dead(unknown)
    with pytest.raises(NotFoundError):
        runner.retry_dead(unknown)


def test_a_purge_step_stops_reading_once_its_bodies_reach_the_byte_budget(
    make_runner: RunnerFactory, prefix: str
) -> None:
    # Given 10 messages of about 2 KB each on the queue
    runner = make_runner(registry())
    runner.dispatch_many(GONE, [{"pad": "x" * 2_000}] * 10)
    job = runner.registry.jobs[GONE]

    def step(cursor: str, byte_budget: int) -> tuple[int, str, int, int]:
        removed, after, spent, read = runner.broker.lua.purge_step(
            keys=[runner.broker.namespace],
            args=[
                *(f"kumiko:{prefix}:", GONE, "queued", job.queue_name(prefix), cursor),
                *(50, 0, byte_budget, "1"),
            ],
        )
        return int(removed), after.decode(), int(spent), int(read)

    # When a dry-run step may read 3,000 bytes of bodies, Then it reads two (the second
    # takes it past the budget) and the next step starts after them
    removed, cursor, spent, read = step("0", 3_000)
    assert (removed, cursor, read) == (2, "2", 2)
    assert 2 * 2_000 < spent < 2 * 2_600  # two bodies of 2 KB and their options
    # a budget smaller than one body still reads one: every step moves on
    assert step(cursor, 1)[:2] == (1, "3")
    # and the walk ends where the list does
    assert step("9", 3_000)[:2] == (1, "0")


def test_purge_refuses_an_unknown_state(make_runner: RunnerFactory) -> None:
    runner: JobRunner = make_runner(registry())
    with pytest.raises(ValueError, match="state must be one of"):
        runner.purge(GONE, state="running")
