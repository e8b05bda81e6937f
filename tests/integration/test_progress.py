"""``ctx.progress``: a running attempt's value and note reach ``runner.running()``, ``kumiko busy``
and the dashboard, coalesced, and are dropped when the attempt ends; on a real Redis and worker.

Handlers signal through events and wait on a release event; the tests wait for what they read
in Redis (``wait_for``), never on sleeps, with generous bounds.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from starlette.testclient import TestClient

from kumiko_dramatiq import Feature, JobContext, JobRun, JobRunner, Registry
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.dashboard import create_app
from kumiko_dramatiq.ops import cli
from kumiko_dramatiq.testing import private_redis_server
from tests.conftest import RunnerFactory, wait_for

REPORT = "etl:job:report"
LOOP = "etl:job:loop"
BAD = "etl:job:bad"
FLAKY = "etl:job:flaky"
ASYNC = "etl:job:async"
LOOPS = 10_000
#: (value, note) pairs ``ctx.progress`` refuses
BAD_REPORTS: list[tuple[Any, Any]] = [
    (1.5, None),
    (-0.1, None),
    ("half", None),
    (True, None),
    (math.nan, None),
    (None, "x" * 201),
    (None, 42),
    (None, "a\nb"),
]


@dataclass
class Gates:
    reported: threading.Event = field(default_factory=threading.Event)
    again: threading.Event = field(default_factory=threading.Event)
    reported_again: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    errors: list[str] = field(default_factory=list)
    commands: list[int] = field(default_factory=list)


def registry_of(gates: Gates) -> Registry:
    etl = Feature("etl")

    @etl.job("report")
    def report(payload: dict[str, Any], ctx: JobContext) -> None:
        ctx.progress(0.25, "parsing")
        gates.reported.set()
        gates.again.wait(30)
        ctx.progress(0.5)  # the note stays
        gates.reported_again.set()
        gates.release.wait(30)

    @etl.job("loop")
    def loop(payload: dict[str, Any], ctx: JobContext) -> None:
        for i in range(1, LOOPS + 1):
            ctx.progress(i / LOOPS, f"row {i}")
        gates.reported.set()
        gates.release.wait(30)

    @etl.job("bad")
    def bad(payload: dict[str, Any], ctx: JobContext) -> None:
        for value, note in BAD_REPORTS:
            try:
                ctx.progress(value, note)
            except ValueError as exc:
                gates.errors.append(str(exc))

    @etl.job("flaky", retries=1)
    def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
        ctx.progress(0.1 * ctx.attempt, f"attempt {ctx.attempt}")
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")
        gates.reported.set()
        gates.release.wait(30)

    @etl.job("async")
    async def run_async(payload: dict[str, Any], ctx: JobContext) -> None:
        ctx.progress(0.75, "from a coroutine")
        gates.reported.set()
        await asyncio.get_running_loop().run_in_executor(None, gates.release.wait, 30)

    return Registry([etl])


#: For ``kumiko busy`` (the CLI loads the app by name; its handlers never run there).
APP = registry_of(Gates())


def running_one(runner: JobRunner, message_id: str) -> JobRun | None:
    runs = [run for run in runner.running() if run.message_id == message_id]
    return runs[0] if runs else None


def shows(runner: JobRunner, message_id: str, value: float | None, note: str | None) -> bool:
    run = running_one(runner, message_id)
    return run is not None and (run.progress, run.progress_note) == (value, note)


def test_running_shows_the_latest_progress_and_note_while_the_handler_waits(
    make_runner: RunnerFactory,
) -> None:
    # Given a handler that reports 25% "parsing" and waits
    gates = Gates()
    runner = make_runner(registry_of(gates))
    runner.start()
    message_id = runner.dispatch(REPORT)
    assert gates.reported.wait(20)
    # Then running() shows it
    wait_for(lambda: shows(runner, message_id, 0.25, "parsing"), 5, "25% parsing in running()")
    # When it reports a value alone, Then the note it reported before stays
    gates.again.set()
    assert gates.reported_again.wait(20)
    wait_for(lambda: shows(runner, message_id, 0.5, "parsing"), 5, "50% parsing in running()")
    run = running_one(runner, message_id)
    assert run is not None
    assert run.to_json()["progress"] == 0.5
    assert run.to_json()["progress_note"] == "parsing"
    gates.release.set()
    runner.drain(timeout_s=30)


def test_an_async_handler_reports_progress_too(make_runner: RunnerFactory) -> None:
    gates = Gates()
    runner = make_runner(registry_of(gates))
    runner.start()
    message_id = runner.dispatch(ASYNC)
    assert gates.reported.wait(20)
    wait_for(lambda: shows(runner, message_id, 0.75, "from a coroutine"), 5, "its progress")
    gates.release.set()
    runner.drain(timeout_s=30)
    assert runner.running() == []


def test_kumiko_busy_and_the_dashboard_show_the_progress(
    make_runner: RunnerFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    redis_url: str,
    prefix: str,
) -> None:
    gates = Gates()
    runner = make_runner(registry_of(gates))
    runner.start()
    message_id = runner.dispatch(REPORT)
    assert gates.reported.wait(20)
    wait_for(lambda: shows(runner, message_id, 0.25, "parsing"), 5, "25% parsing in running()")
    monkeypatch.setenv("KUMIKO_APP", "tests.integration.test_progress:APP")
    monkeypatch.setenv("KUMIKO_REDIS_URL", redis_url)
    monkeypatch.setenv("KUMIKO_QUEUE_PREFIX", prefix)

    assert cli.main(["busy"]) == 0
    out = capsys.readouterr().out
    assert "progress" in out.splitlines()[0]
    assert "25% parsing" in out
    assert cli.main(["busy", "--json"]) == 0
    (shown,) = json.loads(capsys.readouterr().out)["running"]
    assert (shown["progress"], shown["progress_note"]) == (0.25, "parsing")

    page = TestClient(create_app(runner, token="")).get("/busy").text
    assert '<progress max="1" value="0.25"></progress> 25% parsing' in page
    gates.again.set()
    gates.release.set()
    runner.drain(timeout_s=30)


def test_a_tight_loop_of_reports_costs_redis_a_few_writes() -> None:
    # Given a Redis of this test's own (so its command counts are this runner's alone)
    with private_redis_server() as url:
        gates = Gates()
        runner = JobRunner(
            registry_of(gates), redis_url=url, queue_prefix="progress", worker_threads=2
        )
        client = redis.Redis.from_url(url)
        try:
            runner.start()
            sets_before = _calls(client, "set")
            writes_before = runner.runtime.progress.writes
            # When a handler reports 10,000 times in a tight loop
            message_id = runner.dispatch(LOOP)
            assert gates.reported.wait(30)
            # Then the last report lands (the trailing write)
            wait_for(lambda: shows(runner, message_id, 1.0, f"row {LOOPS}"), 5, "the last row")
            # And it cost a few writes, not thousands: the first, then at most two a second
            writes = runner.runtime.progress.writes - writes_before
            assert 1 <= writes <= 5
            # and Redis saw as few SETs (the worker's own liveness refreshes included)
            assert _calls(client, "set") - sets_before <= writes + 5
            gates.release.set()
            runner.drain(timeout_s=30)
        finally:
            gates.release.set()
            runner.stop(timeout_s=10)
            client.close()


def _calls(client: redis.Redis, command: str) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    entry = stats.get(f"cmdstat_{command}")
    return 0 if entry is None else int(entry["calls"])


def test_bad_values_raise_a_clear_error_naming_the_job_and_the_value(
    make_runner: RunnerFactory,
) -> None:
    gates = Gates()
    runner = make_runner(registry_of(gates))
    runner.start()
    runner.dispatch(BAD)
    (run,) = runner.drain(timeout_s=30)
    assert run.status == "completed"  # the handler caught them
    assert gates.errors == [
        f"{BAD}: progress value must be a number from 0.0 to 1.0, got 1.5",
        f"{BAD}: progress value must be a number from 0.0 to 1.0, got -0.1",
        f"{BAD}: progress value must be a number from 0.0 to 1.0 (or None), got 'half'",
        f"{BAD}: progress value must be a number from 0.0 to 1.0 (or None), got True",
        f"{BAD}: progress value must be a number from 0.0 to 1.0, got nan",
        f"{BAD}: progress note must be at most 200 characters (it has 201), got '{'x' * 76}...",
        f"{BAD}: progress note must be a str (or None), got 42",
        f"{BAD}: progress note must not contain control characters (one line), got 'a\\nb'",
    ]


def test_the_progress_is_gone_once_the_attempt_ends_and_a_retry_reports_its_own(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a job whose first attempt reports and fails, and whose retry reports and waits
    gates = Gates()
    runner = make_runner(registry_of(gates))
    runner.start()
    message_id = runner.dispatch(FLAKY)
    assert gates.reported.wait(30)
    # Then the retry shows its own progress, and the failed attempt's key is gone
    wait_for(lambda: shows(runner, message_id, 0.2, "attempt 2"), 5, "the retry's progress")
    assert not redis_client.exists(keys.progress(prefix, message_id, 1))
    # and the running attempt's key lives a bounded time (a killed worker's expires)
    assert 0 < redis_client.pttl(keys.progress(prefix, message_id, 2)) <= keys.PROGRESS_TTL_MS
    # When it ends, Then its progress is gone too
    gates.release.set()
    runner.drain(timeout_s=30)
    assert runner.running() == []
    assert not redis_client.exists(keys.progress(prefix, message_id, 2))
    assert [run.progress for run in runner.run_record(message_id)] == [None, None]


def test_a_progress_left_by_another_worker_is_not_shown(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a running attempt that reported, and a key of the same attempt written as by a
    # worker that died running it earlier (kill -9 leaves its key until its TTL)
    gates = Gates()
    runner = make_runner(registry_of(gates))
    runner.start()
    message_id = runner.dispatch(REPORT)
    assert gates.reported.wait(20)
    wait_for(lambda: shows(runner, message_id, 0.25, "parsing"), 5, "25% parsing in running()")
    key = keys.progress(prefix, message_id, 1)
    redis_client.set(key, json.dumps({"v": 0.9, "n": "old", "w": "elsewhere:1"}), px=60_000)
    # Then running() does not show it as this run's
    assert shows(runner, message_id, None, None)
    gates.again.set()
    gates.release.set()
    runner.drain(timeout_s=30)
