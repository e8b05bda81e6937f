"""Browsing waiting work: ``runner.queued(...)`` pages through queued, parked and delayed
messages with their payload, attempt, enqueued and due times."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kumiko_dramatiq import Feature, JobConfigError, JobContext, QueuedMessage, Registry
from tests.conftest import RunnerFactory, wait_for

A = "browse:job:a"
B = "browse:job:b"


def noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


def registry() -> Registry:
    feature = Feature("browse")
    feature.job("a")(noop)
    feature.job("b")(noop)
    return Registry([feature])


def walk(runner: Any, job: str | None, state: str | None, limit: int) -> list[QueuedMessage]:
    seen: list[QueuedMessage] = []
    after = None
    while True:
        page = runner.queued(job, state=state, limit=limit, after=after)
        assert len(page) <= limit
        seen += page
        if not page:
            return seen
        after = page[-1]


def test_queued_messages_page_oldest_first_with_payload_and_attempt(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(registry())
    ids = []
    for n in range(25):
        ids.append(runner.dispatch(A, {"n": n}))
        runner.dispatch(B, {"n": n})
    first = runner.queued(A, limit=3)
    assert [m.message_id for m in first] == ids[:3]
    assert first[0].payload == {"n": 0}
    assert (first[0].state, first[0].attempt, first[0].due_at) == ("queued", 1, None)
    assert first[0].enqueued_at <= datetime.now(UTC)
    # pages neither repeat nor skip
    assert [m.message_id for m in walk(runner, A, "queued", 7)] == ids
    assert len(walk(runner, None, None, 10)) == 50


def test_delayed_messages_show_their_due_time(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry())
    late = runner.dispatch(A, {"late": True}, delay_ms=600_000)
    soon = runner.dispatch(A, {"soon": True}, delay_ms=300_000)
    runner.dispatch(A, {})
    found = runner.queued(A, state="delayed")
    assert [m.message_id for m in found] == [soon, late]
    due = found[0].due_at
    assert due is not None
    assert timedelta(seconds=200) < due - datetime.now(UTC) <= timedelta(seconds=300)
    assert all(m.state == "delayed" for m in found)
    ids = {m.message_id for m in walk(runner, A, "delayed", 1)}
    assert ids == {soon, late}


def test_parked_messages_are_listed_as_parked(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry())
    runner.pause(A)
    parked = runner.dispatch(A, {"x": 1})
    runner.start()
    wait_for(lambda: bool(runner.queued(A, state="parked")), what="the parked message")
    (message,) = runner.queued(A)
    assert (message.message_id, message.state, message.payload) == (parked, "parked", {"x": 1})


def test_queued_refuses_bad_input(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry())
    with pytest.raises(ValueError, match="state must be one of"):
        runner.queued(state="running")
    with pytest.raises(ValueError, match="limit"):
        runner.queued(limit=0)


@pytest.mark.parametrize("limit", [0, -1, 10_001, "5", 2.5, True, None])
def test_every_listing_refuses_a_limit_that_is_not_a_count(
    make_runner: RunnerFactory, limit: Any
) -> None:
    runner = make_runner(registry())
    for listing in (runner.dead_letters, runner.locks, runner.dedup_keys):
        with pytest.raises(ValueError, match="limit must be an int from 1 to 10000"):
            listing(limit=limit)
    for paged in (runner.queued, runner.batches):
        with pytest.raises(ValueError, match="limit must be an int from 1 to 1000"):
            paged(limit=limit)


def test_a_malformed_id_is_refused_by_run_record(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry())
    with pytest.raises(JobConfigError, match="message_id"):
        runner.run_record("not an id!")
