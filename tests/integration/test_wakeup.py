"""Wake-up: an idle worker starts work when it arrives, not when its poll comes round.

Each worker here polls rarely (``idle_wait_ms=10_000``: an idle consumer looks again only
after 20 s), so a job that starts within a few seconds was started by the doorbell. The
bounds are far from the poll interval on purpose: no tight timing in tests.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from kumiko_dramatiq import Backoff, Feature, JobContext, Registry
from tests.conftest import Recorder, RunnerFactory, wait_for

#: a poll interval no test could wait out: 2 x idle wait, bounded by the socket timeout
SLOW_POLL = {"idle_wait_ms": 10_000, "boot_redis_timeout_ms": 30_000}
#: far below SLOW_POLL's 20 s, far above any normal start
WITHIN_S = 5


def registry() -> Registry:
    feature = Feature("wake")

    @feature.job("now")
    def now(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    @feature.job("flaky", retries=1, backoff=Backoff("fixed", delay_ms=300))
    def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
        if ctx.attempt == 1:
            raise RuntimeError("the first attempt fails")

    return Registry([feature])


def blocked_waits(client: redis.Redis, queue_name: str) -> list[dict[str, Any]]:
    """The connections blocked (flag ``b``) on ``queue_name``'s doorbell."""
    return [
        entry
        for entry in client.client_list()
        if entry.get("name") == f"kumiko-bell:{queue_name}" and "b" in entry.get("flags", "")
    ]


def wait_until_idle(client: redis.Redis, prefix: str) -> None:
    wait_for(
        lambda: bool(blocked_waits(client, f"{prefix}-worker")),
        what="the lane consumer waiting on its doorbell",
    )


def test_an_idle_worker_starts_a_job_at_once(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a started worker whose consumer waits on its doorbell
    runner = make_runner(registry(), **SLOW_POLL, **recorder.hooks())
    runner.start()
    for n in range(1, 4):
        wait_until_idle(redis_client, prefix)
        # When a job is dispatched
        runner.dispatch("wake:job:now")
        # Then it starts long before the next poll
        recorder.wait_until(lambda r: len(r.of("complete")) == n, timeout_s=WITHIN_S)  # noqa: B023


def test_delayed_jobs_and_retries_start_when_due_on_an_idle_worker(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry(), **SLOW_POLL, **recorder.hooks())
    runner.start()
    wait_until_idle(redis_client, prefix)
    # When a delayed job and a job whose retry waits 300 ms are dispatched to an idle worker
    sent = time.monotonic()
    delayed_id = runner.dispatch("wake:job:now", delay_ms=300)
    flaky_id = runner.dispatch("wake:job:flaky")
    # Then both complete, the delayed one not before its delay, long before any poll
    recorder.wait_until(lambda r: len(r.of("complete")) == 2, timeout_s=WITHIN_S)
    assert {e.message_id for e in recorder.of("complete")} == {delayed_id, flaky_id}
    assert time.monotonic() - sent >= 0.3
    [failed] = recorder.of("failed")
    assert failed.message_id == flaky_id


def test_a_worker_shutting_down_ends_its_consumers_waits(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given an idle worker whose consumers wait on their doorbells (for up to 20 s)
    runner = make_runner(registry(), **SLOW_POLL)
    runner.start()
    wait_until_idle(redis_client, prefix)
    # When its broker is told the worker shuts down (Worker.stop's first step)
    runner.broker.wake_consumers()
    # Then no consumer waits any more: Dramatiq's loop sees the stop at once
    wait_for(
        lambda: (
            blocked_waits(redis_client, f"{prefix}-worker") == []
            and blocked_waits(redis_client, f"{prefix}-worker.DQ") == []
        ),
        timeout_s=WITHIN_S,
        what="the waits to end",
    )


def test_a_killed_wait_costs_at_most_one_poll(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # Given an idle worker polling every 2 x 300 ms
    runner = make_runner(registry(), idle_wait_ms=300, **recorder.hooks())
    runner.start()
    wait_until_idle(redis_client, prefix)
    # When its blocked connection is killed (a lost wake-up) and a job is dispatched
    for entry in blocked_waits(redis_client, f"{prefix}-worker"):
        redis_client.client_kill_filter(_id=entry["id"])
    runner.dispatch("wake:job:now")
    # Then the job still runs
    recorder.wait_until(lambda r: len(r.of("complete")) == 1)


@pytest.mark.parametrize("delay_ms", [None, 60_000])
def test_the_doorbell_holds_one_token_however_many_enqueues(
    delay_ms: int | None, make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given no worker listening
    runner = make_runner(registry())
    # When many jobs are enqueued, one by one and in bulk
    for _ in range(20):
        runner.dispatch("wake:job:now", delay_ms=delay_ms)
    runner.dispatch_many("wake:job:now", [{}] * 100, delay_ms=delay_ms)
    # Then the queue's doorbell holds one token, which expires by itself
    queue = f"{prefix}-worker" + ("" if delay_ms is None else ".DQ")
    bell = f"dramatiq:{queue}:bell"
    assert redis_client.lrange(bell, 0, -1) == [b"1"]
    assert 0 < int(redis_client.pttl(bell)) <= 60_000
