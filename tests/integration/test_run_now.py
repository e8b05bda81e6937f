"""``runner.run_now``: a delayed or backing-off message is queued now, same id and attempt."""

from __future__ import annotations

from typing import Any

import pytest

from kumiko_dramatiq import Backoff, Feature, JobContext, NotFoundError, Registry
from tests.conftest import Recorder, RunnerFactory, wait_for

LATER = "soon:job:later"
FLAKY = "soon:job:flaky"
tries: dict[str, int] = {}


def noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
    tries[ctx.message_id] = tries.get(ctx.message_id, 0) + 1
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails")


def registry() -> Registry:
    feature = Feature("soon")
    feature.job("later")(noop)
    feature.job("flaky", retries=1, backoff=Backoff("fixed", delay_ms=600_000))(flaky)
    return Registry([feature])


def test_a_delayed_message_runs_now(make_runner: RunnerFactory, recorder: Recorder) -> None:
    runner = make_runner(registry(), **recorder.hooks())
    message_id = runner.dispatch(LATER, {}, delay_ms=600_000)
    assert runner.run_now(message_id) is True
    assert runner.job_counts()[LATER]["queued"] == 1
    assert runner.job_counts()[LATER]["delayed"] == 0
    assert runner.run_now(message_id) is False  # queued now: not delayed any more
    runner.start()
    recorder.wait_until(lambda r: bool(r.of("complete", LATER)), what="it to run")
    (event,) = recorder.of("complete", LATER)
    assert (event.message_id, event.meta.attempt) == (message_id, 1)


def test_a_backing_off_retry_runs_now_once(make_runner: RunnerFactory, recorder: Recorder) -> None:
    runner = make_runner(registry(), **recorder.hooks())
    runner.start()
    message_id = runner.dispatch(FLAKY, {})
    recorder.wait_until(lambda r: bool(r.of("failed", FLAKY)), what="the first attempt")
    wait_for(lambda: runner.job_counts()[FLAKY]["delayed"] == 1, what="backing off")
    assert runner.run_now(message_id) is True
    recorder.wait_until(lambda r: bool(r.of("complete", FLAKY)), what="the retry")
    (event,) = recorder.of("complete", FLAKY)
    assert (event.message_id, event.meta.attempt) == (message_id, 2)
    runner.drain(timeout_s=20)
    assert tries[message_id] == 2
    assert runner.job_counts()[FLAKY] == {
        "queued": 0,
        "delayed": 0,
        "running": 0,
        "parked": 0,
        "dead": 0,
    }


def test_run_now_of_an_unknown_message(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry())
    with pytest.raises(NotFoundError):
        runner.run_now("00000000-0000-4000-8000-000000000000")
