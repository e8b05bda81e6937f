"""Schedules as data: ``runner.schedules`` and the schedulers that fire them. Real Redis;
the schedulers' loops (``ScheduleLoop``) are polled by the tests, several at once where a tick
must be enqueued once, so every wait is for a tick's time to come, never a sleep."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

import pytest
import redis

from kumiko_dramatiq import (
    Cron,
    Feature,
    JobConfigError,
    JobContext,
    NotFoundError,
    PayloadError,
    Registry,
)
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.scheduler import Scheduler
from kumiko_dramatiq.schedules import ScheduleLoop, Schedules
from tests.conftest import Recorder, RunnerFactory, wait_for

JOB = "reports:job:build"
CODE = "reports:job:nightly"


def registry(release: threading.Event | None = None) -> Registry:
    feature = Feature("reports")

    @feature.job("build")
    def build(payload: dict[str, Any], ctx: JobContext) -> None:
        if release is not None:
            release.wait(30)

    @feature.job("nightly", trigger=Cron("0 3 * * *", timezone="Europe/Berlin"))
    def nightly(payload: dict[str, Any], ctx: JobContext) -> None: ...

    return Registry([feature])


def loops(runner: Any, count: int) -> list[ScheduleLoop]:
    """``count`` schedulers' loops over the runner's dataset, each with its own store."""
    return [
        ScheduleLoop(
            Schedules(
                runner.broker,
                runner.registry,
                max_payload_bytes=runner.settings.max_payload_bytes,
                guard_ttl_ms=600_000,
            ),
            f"scheduler-{n}",
        )
        for n in range(count)
    ]


def wait_due(runner: Any, schedule_id: str) -> None:
    """Until ``schedule_id``'s next tick has come (on Redis's clock)."""

    def due() -> bool:
        seconds, micros = runner.broker.client.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        return any(sid == schedule_id for sid, _ in runner.schedules.due(now_ms))

    wait_for(due, timeout_s=10, what=f"{schedule_id} due")


def queued_ids(runner: Any) -> list[str]:
    return [m.message_id for m in runner.admin.queued(limit=100)]


def test_upsert_get_list_and_the_same_upsert_changes_nothing(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry())
    acme = runner.schedules.upsert(
        "acme-nightly",
        JOB,
        cron=Cron("0 3 * * *", timezone="Europe/Berlin"),
        payload={"tenant": "acme"},
        overlap="skip",
    )
    poll = runner.schedules.upsert("poll", JOB, every_ms=30_000)
    assert (acme.cron, acme.timezone, acme.payload, acme.overlap) == (
        "0 3 * * *",
        "Europe/Berlin",
        {"tenant": "acme"},
        "skip",
    )
    assert acme.owner == poll.owner == "runtime"
    assert acme.next_fire is not None
    assert acme.next_fire.astimezone(UTC).hour in (1, 2)  # 03:00 in Berlin
    assert poll.every_ms == 30_000
    again = runner.schedules.upsert(
        "acme-nightly",
        JOB,
        cron=Cron("0 3 * * *", timezone="Europe/Berlin"),
        payload={"tenant": "acme"},
        overlap="skip",
    )
    assert again == acme == runner.schedules.get("acme-nightly")
    listed = runner.schedules.list()
    # by next fire: every 30 s, then the two at 03:00 in Berlin (ties by id)
    assert [s.id for s in listed] == ["poll", "acme-nightly", CODE]
    code = next(s for s in listed if s.id == CODE)
    assert (code.owner, code.job_name, code.cron) == ("code", CODE, "0 3 * * *")
    changed = runner.schedules.upsert("poll", JOB, every_ms=60_000, paused=True)
    assert (changed.every_ms, changed.paused, changed.next_fire) == (60_000, True, None)


def test_bad_input_is_refused_and_nothing_written(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry())
    upsert = runner.schedules.upsert
    with pytest.raises(JobConfigError, match="names a job no feature declares"):
        upsert("s", "reports:job:nope", every_ms=5_000)
    with pytest.raises(JobConfigError, match="cron or every_ms"):
        upsert("s", JOB)
    with pytest.raises(JobConfigError, match="cron or every_ms"):
        upsert("s", JOB, cron=Cron("* * * * *"), every_ms=5_000)
    with pytest.raises(JobConfigError, match="every_ms must be an integer >= 1000"):
        upsert("s", JOB, every_ms=999)
    with pytest.raises(JobConfigError, match="overlap"):
        upsert("s", JOB, every_ms=5_000, overlap="sometimes")
    with pytest.raises(JobConfigError, match="schedule id"):
        upsert("", JOB, every_ms=5_000)
    with pytest.raises(PayloadError):
        upsert("s", JOB, every_ms=5_000, payload=["not", "an", "object"])  # type: ignore[arg-type]
    with pytest.raises(JobConfigError, match="declared in code"):
        upsert(CODE, JOB, every_ms=5_000)
    with pytest.raises(JobConfigError, match="declared in code"):
        runner.schedules.remove(CODE)
    with pytest.raises(NotFoundError):
        runner.schedules.get("s")
    assert not redis_client.exists(keys.schedules(prefix), keys.schedules_due(prefix))


def test_each_tick_is_enqueued_once_however_many_schedulers_fire_it(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(registry())
    runner.schedules.upsert("poll", JOB, every_ms=1_000, payload={"feed": 7})
    schedulers = loops(runner, 3)
    for _ in range(2):  # two ticks
        wait_due(runner, "poll")
        barrier = threading.Barrier(3)
        results: list[Any] = []

        def fire(loop: ScheduleLoop, barrier: threading.Barrier, results: list[Any]) -> None:
            barrier.wait()
            results.extend(loop.poll())

        threads = [
            threading.Thread(target=fire, args=(loop, barrier, results)) for loop in schedulers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(r.outcome for r in results if r.schedule_id == "poll").count("enqueued") == 1
    queued = runner.admin.queued(limit=10)
    assert len(queued) == 2
    assert all(m.payload == {"feed": 7} for m in queued)
    assert runner.schedules.get("poll").last_fire is not None


def test_no_tick_after_pause_or_remove_returned_and_resume_goes_on(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(registry())
    (loop,) = loops(runner, 1)
    runner.schedules.upsert("poll", JOB, every_ms=1_000)
    runner.schedules.upsert("other", JOB, every_ms=1_000)
    assert runner.schedules.pause("poll")
    assert not runner.schedules.pause("poll")  # paused already
    assert runner.schedules.get("poll").next_fire is None
    wait_due(runner, "other")  # the paused one's tick would have come by now
    fired = loop.poll()
    assert [r.schedule_id for r in fired] == ["other"]
    assert runner.schedules.resume("poll")
    wait_due(runner, "poll")
    assert [r.outcome for r in loop.poll() if r.schedule_id == "poll"] == ["enqueued"]
    assert runner.schedules.remove("poll")
    assert not runner.schedules.remove("poll")
    wait_due(runner, "other")
    assert all(r.schedule_id == "other" for r in loop.poll())


def test_overlap_skip_skips_a_tick_while_the_last_run_waits_or_runs(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(registry())
    (loop,) = loops(runner, 1)
    runner.schedules.upsert("slow", JOB, every_ms=1_000, overlap="skip")
    wait_due(runner, "slow")
    assert [r.outcome for r in loop.poll()] == ["enqueued"]
    wait_due(runner, "slow")
    assert [r.outcome for r in loop.poll()] == ["skipped"]  # the first still queued
    assert len(queued_ids(runner)) == 1
    assert runner.broker.client.hget(keys.cron_skipped(runner.queue_prefix), JOB) == b"1"


def test_overlap_buffer_one_keeps_one_tick_behind_a_running_one(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    release = threading.Event()
    runner = make_runner(registry(release), **recorder.hooks())
    (loop,) = loops(runner, 1)
    runner.schedules.upsert("slow", JOB, every_ms=1_000, overlap="buffer_one")
    wait_due(runner, "slow")
    assert [r.outcome for r in loop.poll()] == ["enqueued"]
    runner.start()
    recorder.wait_until(lambda r: len(r.of("start")) == 1)
    outcomes = []
    for _ in range(2):
        wait_due(runner, "slow")
        outcomes += [r.outcome for r in loop.poll()]
    assert outcomes == ["buffered", "skipped"]  # one waits behind the run, the next is dropped
    release.set()
    recorder.wait_until(lambda r: len(r.of("complete")) == 2)


def test_trigger_runs_once_now_and_code_schedules_pause(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry(), **recorder.hooks())
    runner.schedules.upsert("acme", JOB, every_ms=3_600_000, payload={"tenant": "acme"})
    message_id = runner.schedules.trigger("acme")
    assert runner.schedules.pause(CODE)
    assert runner.schedules.get(CODE).paused
    assert redis_client.sismember(keys.schedules_paused(prefix), CODE)
    code_run = runner.schedules.trigger(CODE)
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == 2)
    assert {e.message_id for e in recorder.of("complete")} == {message_id, code_run}
    assert runner.schedules.resume(CODE)
    assert runner.schedules.get(CODE).next_fire is not None
    assert datetime.now(UTC) < runner.schedules.get(CODE).next_fire  # type: ignore[operator]


def test_ticks_missed_while_no_scheduler_ran_are_coalesced_or_skipped(
    make_runner: RunnerFactory,
) -> None:
    runner = make_runner(registry())
    (loop,) = loops(runner, 1)
    runner.schedules.upsert("coalesce", JOB, cron=Cron("* * * * * *", grace_s=2))
    runner.schedules.upsert("skip", JOB, cron=Cron("* * * * * *", misfire="skip", grace_s=1))
    wait_due(runner, "coalesce")
    wait_due(runner, "skip")
    seconds, micros = runner.broker.client.time()
    later = int(seconds) * 1000 + int(micros) // 1000 + 5_000  # as if no scheduler ran for 5 s
    store = loop.schedules
    due = dict(store.due(later))
    coalesced = store.fire("coalesce", due["coalesce"], later, "test")
    skipped = store.fire("skip", due["skip"], later, "test")
    assert coalesced.outcome == "enqueued"
    assert coalesced.tick is not None
    assert later - 1_000 < coalesced.tick.timestamp() * 1000 <= later  # the latest tick
    assert skipped.outcome == "missed"
    assert len(runner.admin.queued(limit=10)) == 1
    assert store.fire("coalesce", due["coalesce"], later, "test").outcome == "gone"  # fired


def test_a_code_cron_with_overlap_skip_skips_ticks_while_its_run_waits(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    feature = Feature("reports")

    @feature.job("every_second", trigger=Cron("* * * * * *", overlap="skip"))
    def every_second(payload: dict[str, Any], ctx: JobContext) -> None: ...

    job = "reports:job:every_second"
    runner = make_runner(Registry([feature]))
    assert runner.schedules.get(job).overlap == "skip"
    scheduler = Scheduler(runner.broker, runner.registry, retention=runner.retention)
    scheduler.start()  # and no worker: the first tick's run waits
    try:
        skipped = keys.cron_skipped(prefix)
        wait_for(lambda: int(redis_client.hget(skipped, job) or 0) >= 2, what="two skipped")
    finally:
        scheduler.stop()
    assert len(runner.admin.queued(limit=10)) == 1
