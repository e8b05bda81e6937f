"""The cron scheduler against a real Redis: each tick enqueued exactly once.

Without a worker, every tick message stays in its lane queue's message hash, so
counting the messages there counts the enqueues (a duplicate would be a second
entry with the same message id).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis
from dramatiq.message import Message

from kumiko_dramatiq import Cron, Feature, JobContext, JobRunner, Registry, build_message_options
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.keys import queue_list, queue_messages
from kumiko_dramatiq.ids import cron_tick_id
from kumiko_dramatiq.scheduler import Scheduler
from tests.apps import cron_app
from tests.conftest import Recorder, RunnerFactory, wait_for

ROOT = Path(__file__).resolve().parents[2]
SECOND = timedelta(seconds=1)


def _scheduler(runner: JobRunner) -> Scheduler:
    """A scheduler for ``runner``'s registry, broker and retention."""
    return Scheduler(runner.broker, runner.registry, retention=runner.retention)


def noop(payload: dict[str, Any], ctx: JobContext) -> None:
    pass


def queued(client: redis.Redis, queue: str) -> list[Message[Any]]:
    """Every message in ``queue``'s message hash."""
    raws: list[bytes] = client.hvals(queue_messages(queue))  # type: ignore[assignment]
    return [Message.decode(raw) for raw in raws]


def tick_of(message: Message[Any]) -> datetime:
    return datetime.fromisoformat(message.options["kumiko_scheduled_at"])


def ticks(client: redis.Redis, prefix: str) -> list[datetime]:
    return sorted(tick_of(m) for m in queued(client, f"{prefix}-worker"))


def assert_each_tick_once(messages: list[Message[Any]]) -> list[datetime]:
    """No message id twice, each id its tick's id; returns the sorted ticks."""
    per_id = Counter(str(m.message_id) for m in messages)
    assert max(per_id.values()) == 1, [i for i, n in per_id.items() if n > 1]
    for message in messages:
        assert message.message_id == cron_tick_id(message.actor_name, tick_of(message))
    return sorted(tick_of(m) for m in messages)


def assert_contiguous(found: list[datetime]) -> None:
    gaps = [(a, b) for a, b in pairwise(found) if b - a != SECOND]
    assert not gaps, f"ticks missing: {gaps}"


def sleep_until(instant: datetime) -> None:
    """Let wall-clock time pass (an outage), not a way to wait for an event."""
    time.sleep(max(0.0, (instant - datetime.now(UTC)).total_seconds()))


@pytest.fixture
def scheduler_env(redis_url: str, prefix: str) -> dict[str, str]:
    return {
        **os.environ,
        "KUMIKO_APP": "tests.apps.cron_app:registry",
        "KUMIKO_REDIS_URL": redis_url,
        "KUMIKO_QUEUE_PREFIX": prefix,
        "PYTHONPATH": str(ROOT),
    }


@pytest.fixture
def spawn(scheduler_env: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    """``spawn()`` starts ``python -m kumiko_dramatiq.scheduler``; returns (process, log path)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"scheduler-{len(procs)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kumiko_dramatiq.scheduler"],
                env=scheduler_env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        procs.append(proc)
        return proc, log

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def started(log: Path) -> bool:
    return b"kumiko scheduler" in log.read_bytes() and b"started" in log.read_bytes()


# -- many schedulers, one enqueue per tick ------------------------------------------------------


@pytest.mark.slow
def test_three_schedulers_enqueue_every_tick_exactly_once(
    spawn: Any, redis_client: redis.Redis, prefix: str
) -> None:
    # Given three scheduler processes on one dataset, running side by side for ~4 s
    runs = [spawn() for _ in range(3)]
    wait_for(lambda: all(started(log) for _, log in runs), what="three schedulers started")
    all_running = datetime.now(UTC)
    time.sleep(4)  # the scenario itself: three replicas ticking together
    for proc, _ in runs:
        proc.send_signal(signal.SIGTERM)
    assert [proc.wait(timeout=20) for proc, _ in runs] == [0, 0, 0]

    # Then every tick of the window is in the queue exactly once, under its tick id
    queue = f"{prefix}-worker"
    messages = queued(redis_client, queue)
    assert redis_client.llen(queue_list(queue)) == len(messages)
    found = assert_each_tick_once(messages)
    assert_contiguous(found)
    assert found[0] < all_running + SECOND
    assert found[-1] >= all_running + 3 * SECOND
    assert {m.actor_name for m in messages} == {cron_app.JOB}


# -- the CLI ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_scheduler_with_status_0(
    spawn: Any, redis_client: redis.Redis, prefix: str, signum: signal.Signals
) -> None:
    proc, log = spawn()
    wait_for(lambda: bool(ticks(redis_client, prefix)), what="a first tick")
    proc.send_signal(signum)
    assert proc.wait(timeout=20) == 0
    assert b"stopped" in log.read_bytes()


@pytest.mark.parametrize(
    "app", [None, "tests.apps.no_such_app:registry", "tests.apps.cron_app:nothing", "bad"]
)
def test_a_bad_kumiko_app_is_one_line_and_status_2(
    scheduler_env: dict[str, str], app: str | None
) -> None:
    env = {k: v for k, v in scheduler_env.items() if k != "KUMIKO_APP"}
    if app is not None:
        env["KUMIKO_APP"] = app
    done = subprocess.run(
        [sys.executable, "-m", "kumiko_dramatiq.scheduler"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("kumiko-scheduler: ")
    assert "KUMIKO_APP" in lines[0]


# -- the tick message -------------------------------------------------------------------------


def test_a_tick_carries_the_job_options_trigger_and_scheduled_time(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(cron_app.registry)
    scheduler = _scheduler(runner)
    scheduler.start()
    try:
        wait_for(lambda: bool(ticks(redis_client, prefix)), what="a first tick")
    finally:
        scheduler.stop()

    message = queued(redis_client, f"{prefix}-worker")[0]
    job = cron_app.registry.jobs[cron_app.JOB]
    tick = tick_of(message)
    assert build_message_options(job).items() <= message.options.items()
    assert message.options["kumiko_trigger"] == "cron"
    assert tick.utcoffset() is not None
    assert message.actor_name == cron_app.JOB
    assert message.message_id == cron_tick_id(cron_app.JOB, tick)


def test_the_last_enqueued_tick_is_recorded(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    scheduler = _scheduler(make_runner(cron_app.registry))
    scheduler.start()
    try:
        wait_for(lambda: len(ticks(redis_client, prefix)) >= 2, what="two ticks")
    finally:
        scheduler.stop()
    recorded = redis_client.get(keys.cron_last_tick(prefix, cron_app.JOB))
    assert recorded is not None
    assert int(recorded) == int(max(ticks(redis_client, prefix)).timestamp())
    assert redis_client.pttl(keys.cron_last_tick(prefix, cron_app.JOB)) > 0


def test_cron_jobs_of_every_lane_are_scheduled(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    feature = Feature("lanes")
    feature.job("api_tick", trigger=Cron("* * * * * *"), run_in="api")(noop)
    scheduler = _scheduler(make_runner(Registry([feature])))  # a worker-lane runner
    scheduler.start()
    try:
        wait_for(lambda: bool(queued(redis_client, f"{prefix}-api")), what="an api-lane tick")
    finally:
        scheduler.stop()
    assert queued(redis_client, f"{prefix}-api")[0].actor_name == "lanes:job:api_tick"


def test_a_per_tenant_cron_job_ticks_its_wrapper(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    feature = Feature("tenants")
    feature.job("nightly", trigger=Cron("* * * * * *"), per_tenant=True)(noop)
    registry = Registry([feature])
    scheduler = _scheduler(make_runner(registry))
    scheduler.start()
    try:
        wait_for(lambda: bool(ticks(redis_client, prefix)), what="a first tick")
    finally:
        scheduler.stop()
    message = queued(redis_client, f"{prefix}-worker")[0]
    assert message.actor_name == registry.jobs["tenants:job:nightly"].wrapper_actor_name
    assert "kumiko_tenant_id" not in message.options
    assert message.message_id == cron_tick_id("tenants:job:nightly", tick_of(message))


# -- misfires ---------------------------------------------------------------------------------


def outage_then_restart(
    runner: Any, redis_client: redis.Redis, prefix: str
) -> tuple[datetime, datetime, list[datetime]]:
    """Run a scheduler until it enqueued a tick, stop it for four ticks, restart it just
    after a second boundary and let it tick twice. Returns (last tick before the outage,
    restart instant, ticks enqueued after the outage)."""
    first = _scheduler(runner)
    first.start()
    try:
        wait_for(lambda: bool(ticks(redis_client, prefix)), what="a first tick")
    finally:
        first.stop()
    last = max(ticks(redis_client, prefix))
    sleep_until(last + 4 * SECOND + timedelta(milliseconds=100))
    restart = datetime.now(UTC)
    second = _scheduler(runner)
    second.start()
    try:
        wait_for(
            lambda: max(ticks(redis_client, prefix)) >= restart + 2 * SECOND,
            what="ticks after the restart",
        )
    finally:
        second.stop()
    return last, restart, [t for t in ticks(redis_client, prefix) if t > last]


@pytest.mark.slow
def test_a_restart_within_grace_coalesces_the_missed_ticks_into_one(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    last, restart, after = outage_then_restart(make_runner(cron_app.registry), redis_client, prefix)
    latest_missed = restart.replace(microsecond=0)
    assert latest_missed - last >= 4 * SECOND
    # Then of the missed ticks only the latest ran, and every tick after it
    assert after[0] == latest_missed
    assert_contiguous(after)
    assert_each_tick_once(queued(redis_client, f"{prefix}-worker"))


@pytest.mark.slow
def test_a_restart_with_misfire_skip_skips_the_missed_ticks(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    feature = Feature("skipper")
    feature.job("tick", trigger=Cron("* * * * * *", misfire="skip"))(noop)
    last, restart, after = outage_then_restart(
        make_runner(Registry([feature])), redis_client, prefix
    )
    # Then the first tick after the outage is the first one after the restart
    assert after[0] > restart
    assert after[0] - last >= 5 * SECOND


# -- in a JobRunner ---------------------------------------------------------------------------


def test_a_cron_job_with_retries_reaches_attempt_2_on_its_tick_id(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    feature = Feature("flaky")

    @feature.job("tick", trigger=Cron("* * * * * *"), retries=1)
    def tick(payload: dict[str, Any], ctx: JobContext) -> None:
        if ctx.attempt == 1:
            raise RuntimeError("the first attempt fails")

    runner = make_runner(Registry([feature]), run_scheduler=True, **recorder.hooks())
    runner.start()
    recorder.wait_until(lambda r: bool(r.of("complete")), what="a completed cron run")
    runner.stop()

    done = recorder.of("complete")[0]
    assert done.meta.attempt == 2
    assert done.meta.trigger == "cron"
    assert done.meta.scheduled_at is not None
    assert done.message_id == cron_tick_id("flaky:job:tick", done.meta.scheduled_at)
    failures = [e.meta.attempt for e in recorder.of("failed") if e.message_id == done.message_id]
    assert failures == [1]


def test_stopping_the_runner_stops_its_scheduler(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    runner = make_runner(cron_app.registry, run_scheduler=True, **recorder.hooks())
    runner.start()
    recorder.wait_until(lambda r: bool(r.of("complete")), what="a cron run")
    runner.stop()
    assert not [t for t in threading.enumerate() if t.name == "APScheduler"]


def test_a_tick_whose_reply_was_lost_is_not_called_missed_and_runs_once(
    make_runner: RunnerFactory,
    redis_client: redis.Redis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a scheduler whose first two tick writes reach Redis but lose their reply (the
    # connection drops after the command ran: a stalled Redis, a killed connection)
    scheduler = _scheduler(make_runner(cron_app.registry))
    real_step = scheduler.broker.enqueue_step
    lost = [2]

    def step_then_lose_the_reply(*args: Any, **kwargs: Any) -> Any:
        reply = real_step(*args, **kwargs)
        if lost[0] > 0:
            lost[0] -= 1
            raise redis.ConnectionError("Connection lost after the command ran")
        return reply

    monkeypatch.setattr(scheduler.broker, "enqueue_step", step_then_lose_the_reply)
    # When it runs for a few ticks
    with caplog.at_level("ERROR", logger="kumiko_dramatiq"):
        scheduler.start()
        try:
            wait_for(lambda: lost[0] == 0 and len(ticks(redis_client, prefix)) >= 4, what="ticks")
        finally:
            scheduler.stop()
    # Then it never said a tick was not enqueued: it said it could not confirm it, and each
    # tick is on the queue exactly once, none missing
    said = [record.getMessage() for record in caplog.records]
    assert not [line for line in said if "NOT enqueued" in line]
    assert len([line for line in said if "not confirmed" in line]) == 2
    assert_contiguous(assert_each_tick_once(queued(redis_client, f"{prefix}-worker")))
