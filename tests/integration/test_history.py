"""Run history: every attempt on record, on every path, bounded, queried newest first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

from kumiko_dramatiq import (
    Backoff,
    Cron,
    Event,
    Feature,
    JobContext,
    JobRunner,
    Registry,
    Retention,
)
from kumiko_dramatiq.broker import settling as settling_module
from kumiko_dramatiq.errors import BootGateError
from kumiko_dramatiq.ops.history import JobRun, record_write
from kumiko_dramatiq.scheduler import Scheduler
from tests.conftest import Recorder, RunnerFactory, wait_for

ROOT = Path(__file__).resolve().parents[2]


def app_registry() -> Registry:
    feature = Feature("hist")

    @feature.job("ok", trigger=Event("thing.done"))
    def ok(payload: dict[str, Any], ctx: JobContext) -> None: ...

    @feature.job("flaky", retries=2, backoff=Backoff("fixed", delay_ms=20))
    def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
        if ctx.attempt <= payload["fails"]:
            raise ValueError(f"attempt {ctx.attempt} <b>fails</b>")

    @feature.job("each", per_tenant=True)
    def each(payload: dict[str, Any], ctx: JobContext) -> None: ...

    @feature.job("tick", trigger=Cron("* * * * * *"))
    def tick(payload: dict[str, Any], ctx: JobContext) -> None: ...

    @feature.job("boot", run_on_boot=True)
    def boot(payload: dict[str, Any], ctx: JobContext) -> None: ...

    @feature.job("slow", timeout_ms=200)
    def slow(payload: dict[str, Any], ctx: JobContext) -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # Python code: interrupted by the time limit
            sum(range(1000))

    return Registry([feature])


def settled(runner: JobRunner, message_id: str, statuses: set[str]) -> list[JobRun]:
    runs = runner.run_record(message_id)
    if runs and runs[-1].status in statuses:
        return runs
    return []


def wait_runs(runner: JobRunner, message_id: str, *statuses: str) -> list[JobRun]:
    found: list[JobRun] = []

    def done() -> bool:
        found[:] = settled(runner, message_id, set(statuses))
        return bool(found)

    wait_for(done, what=f"{message_id} to end {statuses}")
    return found


def test_a_retry_chain_shows_attempts_failed_then_completed(make_runner: RunnerFactory) -> None:
    runner = make_runner(app_registry(), get_active_tenant_ids=lambda: ["t1"])
    runner.start()
    message_id = runner.dispatch("hist:job:flaky", {"fails": 2})
    runs = wait_runs(runner, message_id, "completed")
    assert [(r.attempt, r.status) for r in runs] == [(1, "failed"), (2, "failed"), (3, "completed")]
    first = runs[0]
    assert first.error_type == "ValueError"
    assert first.error_message == "attempt 1 <b>fails</b>"
    assert first.traceback is not None
    assert "ValueError" in first.traceback
    assert all(r.max_attempts == 3 and r.origin_id == message_id for r in runs)
    assert all(r.trigger == "manual" and r.worker and r.duration_ms is not None for r in runs)
    assert all(r.started_at and r.ended_at and r.enqueued_at for r in runs)
    assert runs[2].ended_at is not None
    assert runs[0].started_at is not None
    assert runs[2].ended_at >= runs[0].started_at


def test_a_job_that_fails_for_good_ends_dead_with_its_error_kept(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(app_registry(), get_active_tenant_ids=lambda: ["t1"])
    runner.start()
    message_id = runner.dispatch("hist:job:flaky", {"fails": 9})
    runs = wait_runs(runner, message_id, "dead")
    assert [r.status for r in runs] == ["failed", "failed", "dead"]
    note = runner.history.dead_note(message_id)
    assert note is not None
    assert (note["a"], note["et"], note["em"]) == (3, "ValueError", "attempt 3 <b>fails</b>")
    assert "ValueError" in note["tb"]


def test_every_start_path_leaves_records_with_its_trigger(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    registry = app_registry()
    runner = make_runner(registry, get_active_tenant_ids=lambda: ["t1", "t2"], **recorder.hooks())
    runner.start()
    manual = runner.dispatch("hist:job:ok")
    (event,) = runner.handle_event("thing.done")
    wrapper = runner.dispatch("hist:job:each")
    scheduler = Scheduler(runner.broker, registry, retention=runner.retention)
    scheduler.start()
    try:
        wait_for(lambda: bool(runner.runs("hist:job:tick", status="completed")), what="a tick")
    finally:
        scheduler.stop()
    recorder.wait_until(lambda r: len(r.of("complete", "hist:job:each")) == 3, what="fan-out")
    for message_id, trigger in ((manual, "manual"), (event, "event"), (wrapper, "manual")):
        assert [r.trigger for r in wait_runs(runner, message_id, "completed")] == [trigger]
    children = runner.runs(origin_id=wrapper)
    wait_for(lambda: len(runner.runs(origin_id=wrapper, status="completed")) == 3, what="kids")
    children = runner.runs(origin_id=wrapper, status="completed")
    assert sorted((r.trigger, r.tenant_id) for r in children) == [
        ("fanout", "t1"),
        ("fanout", "t2"),
        ("manual", None),
    ]
    assert [r.tenant_id for r in runner.runs(tenant_id="t1")] == ["t1"]
    (tick,) = runner.runs("hist:job:tick", status="completed", limit=1)
    assert tick.trigger == "cron"
    assert tick.scheduled_at is not None
    (boot,) = runner.runs("hist:job:boot")
    assert (boot.trigger, boot.status) == ("boot", "completed")


def test_a_boot_gate_leaves_a_record_per_attempt(make_runner: RunnerFactory) -> None:
    feature = Feature("gated")

    @feature.job("gate", boot_gate=True, retries=1)
    def gate(payload: dict[str, Any], ctx: JobContext) -> None:
        raise RuntimeError(f"schema too old (attempt {ctx.attempt})")

    runner = make_runner(Registry([feature]))
    with pytest.raises(BootGateError):
        runner.start()
    viewer = make_runner(Registry([feature]))
    runs = viewer.runs("gated:job:gate")
    assert sorted((r.attempt, r.status, r.trigger) for r in runs) == [
        (1, "failed", "gate"),
        (2, "dead", "gate"),
    ]
    assert runs[0].error_message == "schema too old (attempt 2)"


def test_a_timed_out_attempt_is_recorded_as_failed(make_runner: RunnerFactory) -> None:
    runner = make_runner(app_registry(), get_active_tenant_ids=lambda: [], timeout_check_ms=50)
    runner.start()
    message_id = runner.dispatch("hist:job:slow")
    (run,) = wait_runs(runner, message_id, "dead")
    assert run.error_type == "TimeLimitExceeded"


def test_a_sequential_hand_off_keeps_the_origin_and_leaves_no_record_of_its_own(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    feature = Feature("seq")

    @feature.job("sync", concurrency="sequential")
    def sync(payload: dict[str, Any], ctx: JobContext) -> None: ...

    runner = make_runner(Registry([feature]), sequential_retry_delay_ms=50)
    redis_client.set(f"kumiko:{prefix}:lock:seq:job:sync", "someone-else", px=300)
    runner.start()
    origin = runner.dispatch("seq:job:sync")
    wait_for(lambda: bool(runner.runs(origin_id=origin, status="completed")), what="the run")
    (run,) = runner.runs(origin_id=origin)
    assert run.message_id != origin
    assert (run.origin_id, run.trigger, run.status) == (origin, "requeue", "completed")
    assert runner.run_record(origin) == []


def test_payloads_are_kept_only_when_asked(make_runner: RunnerFactory) -> None:
    plain = make_runner(app_registry(), get_active_tenant_ids=lambda: [])
    plain.start()
    first = plain.dispatch("hist:job:ok", {"card": "4111"})
    (run,) = wait_runs(plain, first, "completed")
    assert run.payload is None
    plain.stop()
    keeping = make_runner(app_registry(), get_active_tenant_ids=lambda: [], record_payloads=True)
    keeping.start()
    second = keeping.dispatch("hist:job:ok", {"card": "4111"})
    (run,) = wait_runs(keeping, second, "completed")
    assert run.payload == {"card": "4111"}


def test_records_expire_by_status(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(
        app_registry(),
        get_active_tenant_ids=lambda: [],
        retention=Retention(completed_age_s=1, failed_age_s=3_600),
    )
    runner.start()
    ok = runner.dispatch("hist:job:ok")
    bad = runner.dispatch("hist:job:flaky", {"fails": 9})
    wait_runs(runner, ok, "completed")
    wait_runs(runner, bad, "dead")
    # A completed record lives completed_age_s; failed and dead ones failed_age_s.
    assert 0 < redis_client.pttl(f"kumiko:{prefix}:run:{ok}") <= 1_000
    assert 3_590_000 < redis_client.pttl(f"kumiko:{prefix}:run:{bad}") <= 3_600_000
    wait_for(lambda: runner.run_record(ok) == [], what="the completed record to expire")
    assert [r.status for r in runner.run_record(bad)] == ["failed", "failed", "dead"]


def put_many(
    runner: JobRunner, count: int, *, job: str, status: str, start_ms: int, tie: int = 1
) -> list[str]:
    """Write ``count`` records straight through the history's Lua (one pipeline); ``tie``
    records in a row share a start."""
    ids = []
    pipe = runner.broker.client.pipeline(transaction=False)
    history = runner.history
    completed_ttl, failed_ttl = 3_600_000, 3_600_000
    for n in range(count):
        message_id = f"m{n}-{uuid.uuid4().hex[:6]}"
        ids.append(message_id)
        write = record_write(
            {
                "j": job,
                "m": message_id,
                "o": message_id,
                "tr": "manual",
                "a": 1,
                "ma": 1,
                "st": start_ms + n // tie,
                "en": start_ms + n // tie,
            },
            status,  # type: ignore[arg-type]
            runner.settings,
        )
        history.lua.run_put(
            keys=[f"{history.root}run:{message_id}"],
            args=[
                history.root,
                message_id,
                1,
                job,
                status,
                "",
                message_id,
                start_ms + n // tie,
                write.record,
                completed_ttl,
                failed_ttl,
                runner.settings.history_cap,
                4,
            ],
            client=pipe,
        )
    pipe.execute()
    return ids


def test_the_cap_drops_the_oldest_completed_records_first(make_runner: RunnerFactory) -> None:
    runner = make_runner(app_registry(), get_active_tenant_ids=lambda: [], history_cap=100)
    now_ms = int(time.time() * 1000)
    failed = put_many(runner, 30, job="hist:job:flaky", status="failed", start_ms=now_ms - 5_000)
    completed = put_many(runner, 100, job="hist:job:ok", status="completed", start_ms=now_ms)
    # 130 written under a cap of 100: the 30 oldest completed went, every failed one stayed
    kept = runner.runs(limit=1_000)
    assert len(kept) == 100
    assert {r.message_id for r in kept if r.status == "failed"} == set(failed)
    assert {r.message_id for r in kept if r.status == "completed"} == set(completed[30:])


def test_a_query_over_a_large_history_pages_newest_first(make_runner: RunnerFactory) -> None:
    runner = make_runner(app_registry(), get_active_tenant_ids=lambda: [], history_cap=1_000_000)
    now_ms = int(time.time() * 1000) - 60_000
    put_many(runner, 8_000, job="hist:job:ok", status="completed", start_ms=now_ms)
    failed = put_many(runner, 2_000, job="hist:job:flaky", status="failed", start_ms=now_ms)
    latest = runner.runs("hist:job:flaky", status="failed", limit=50)
    assert [r.message_id for r in latest] == failed[::-1][:50]
    older = runner.runs("hist:job:flaky", status="failed", limit=50, before=latest[-1])
    assert [r.message_id for r in older] == failed[::-1][50:100]
    since = datetime.fromtimestamp((now_ms + 1_990) / 1000, UTC)
    assert len(runner.runs("hist:job:flaky", since=since, limit=100)) == 10


def walk(runner: JobRunner, page: int, **filters: Any) -> list[JobRun]:
    """Every run the filters match, page by page, each page after the last of the one before."""
    seen: list[JobRun] = []
    before: JobRun | None = None
    while True:
        runs = runner.runs(limit=page, before=before, **filters)
        seen += runs
        if len(runs) < page:
            return seen
        before = runs[-1]


def test_walking_pages_over_shared_start_times_yields_each_record_exactly_once(
    make_runner: RunnerFactory,
) -> None:
    # Given: 2,000 completed and 600 failed records, 25 to each start instant (ties across
    # page boundaries, and across the status indexes a job's listing merges)
    runner = make_runner(app_registry(), get_active_tenant_ids=lambda: [], history_cap=1_000_000)
    now_ms = int(time.time() * 1000) - 60_000
    ok = put_many(runner, 2_000, job="hist:job:ok", status="completed", start_ms=now_ms, tie=25)
    flaky = put_many(runner, 300, job="hist:job:flaky", status="failed", start_ms=now_ms, tie=25)
    flaky += put_many(runner, 300, job="hist:job:flaky", status="completed", start_ms=now_ms)

    # When: each listing is walked with pages of 37
    everything = walk(runner, 37)
    of_flaky = walk(runner, 37, job="hist:job:flaky")
    failed = walk(runner, 37, status="failed")

    # Then: each record exactly once, newest first by (start, run id)
    for runs, expected in ((everything, ok + flaky), (of_flaky, flaky), (failed, flaky[:300])):
        ids = [r.message_id for r in runs]
        assert len(ids) == len(set(ids)) == len(expected)
        assert set(ids) == set(expected)
        keys = [r.order_key for r in runs]
        assert keys == sorted(keys, reverse=True)
    # and a page after a time leaves out every record that started at or after it
    cut = everything[100]
    after_time = runner.runs(limit=1_000, before=cut.started_at)
    assert after_time
    assert all(r.order_ms < cut.order_ms for r in after_time)
    # and a message's attempts are listed newest first
    assert [r.run_id for r in runner.runs(message_id=ok[0])] == [f"{ok[0]}:1"]


def test_every_run_history_index_expires(make_runner: RunnerFactory) -> None:
    runner = make_runner(app_registry(), get_active_tenant_ids=lambda: ["t1"])
    runner.start()
    runner.dispatch("hist:job:each")
    wait_for(
        lambda: len(runner.runs("hist:job:each", status="completed")) == 2,
        what="the wrapper and its child to complete",
    )
    client = runner.broker.client
    indexes = [
        key
        for pattern in ("runs:job:*", "runs:status:*", "runs:tenant:*", "runs:origin:*")
        for key in client.scan_iter(match=f"{runner.history.root}{pattern}", count=1000)
    ]
    assert any(b":runs:tenant:" in key for key in indexes)
    assert any(b":runs:origin:" in key for key in indexes)
    for key in indexes:
        assert client.pttl(key) > 0, key


def test_a_worker_refreshes_an_index_ttl_once_a_minute_not_on_every_settle(
    make_runner: RunnerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(app_registry(), get_active_tenant_ids=lambda: [])
    runner.start()
    client = runner.broker.client
    indexes = [
        f"{runner.history.root}runs:job:hist:job:ok:completed",
        f"{runner.history.root}runs:status:completed",
    ]

    def run_one(count: int) -> None:
        runner.dispatch("hist:job:ok")
        wait_for(
            lambda: len(runner.runs("hist:job:ok", status="completed")) == count,
            what=f"{count} runs to complete",
        )

    # Given a first run, whose settle set both indexes' TTLs (the longest record age and 2
    # minutes), cut to a minute
    run_one(1)
    assert all(client.pttl(index) > 60_000 for index in indexes)
    for index in indexes:
        client.pexpire(index, 60_000)
    # When a second run ends within the minute, its settle vouches for them: left as they are
    run_one(2)
    assert all(0 < client.pttl(index) <= 60_000 for index in indexes)
    # Then once a minute has passed (here: no vouching), the next settle refreshes them
    monkeypatch.setattr(settling_module, "INDEX_VOUCH_S", 0.0)
    run_one(3)
    assert all(client.pttl(index) > 60_000 for index in indexes)


@pytest.mark.slow
def test_a_killed_workers_run_is_closed_when_its_message_is_redelivered(
    redis_url: str, redis_client: redis.Redis, prefix: str
) -> None:
    from tests.apps.crash_app import registry

    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT),
        KUMIKO_APP="tests.apps.crash_app:registry",
        KUMIKO_REDIS_URL=redis_url,
        KUMIKO_QUEUE_PREFIX=prefix,
        KUMIKO_HEARTBEAT_TIMEOUT_MS="1000",
        KUMIKO_MAINTENANCE_CHANCE="1000000",
    )
    command = [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "2"]
    viewer = JobRunner(registry, redis_url=redis_url, queue_prefix=prefix)
    message_id = viewer.dispatch("crash:job:once")
    first = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    try:
        # Given a worker killed in the middle of a run
        wait_for(lambda: redis_client.llen(f"kumiko:{prefix}:test:hanging") == 1, what="a run")
        (running,) = viewer.run_record(message_id)
        assert running.status == "running"
        assert running.ended_at is None
        os.killpg(first.pid, signal.SIGKILL)
    finally:
        first.wait()
    # When another worker takes the message over
    second = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    try:
        runs = wait_runs(viewer, message_id, "completed")
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        second.wait(timeout=30)
    # Then the attempt's record is closed, superseded by its second delivery
    assert [(r.attempt, r.status, r.deliveries) for r in runs] == [(1, "completed", 2)]
    viewer.stop()


def test_an_unknown_job_or_status_in_a_query_is_refused(make_runner: RunnerFactory) -> None:
    from kumiko_dramatiq import JobConfigError, UnknownJobError

    runner = make_runner(app_registry(), get_active_tenant_ids=lambda: [])
    with pytest.raises(UnknownJobError):
        runner.runs("hist:job:nope")
    with pytest.raises(JobConfigError, match="status"):
        runner.runs(status="exploded")  # type: ignore[arg-type]
    with pytest.raises(JobConfigError, match="since"):
        runner.runs(since=datetime.now() - timedelta(hours=1))
