"""Per-job counts (``runner.job_counts()``): exact at every step of a message's life, kept by
the scripts that move messages, and exact over data written before they were kept (the
backfill, also while messages come and go)."""

from __future__ import annotations

import threading
import time
from typing import Any

import redis
from dramatiq.common import dq_name

from kumiko_dramatiq import Backoff, Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.broker import keys
from tests.conftest import RunnerFactory, wait_for

A = "tally:job:a"
B = "tally:job:b"
DIES = "tally:job:dies"
HOLD = "tally:job:hold"

release = threading.Event()


def noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


def dies(payload: dict[str, Any], ctx: JobContext) -> None:
    raise RuntimeError("boom")


def hold(payload: dict[str, Any], ctx: JobContext) -> None:
    while not release.is_set() and not ctx.stop_requested:
        time.sleep(0.01)


def registry() -> Registry:
    feature = Feature("tally")
    feature.job("a")(noop)
    feature.job("b")(noop)
    feature.job("dies", retries=1, backoff=Backoff("fixed", delay_ms=60_000))(dies)
    feature.job("hold")(hold)
    return Registry([feature])


def counts(runner: JobRunner, job: str) -> dict[str, int]:
    return runner.job_counts()[job]


def zero(**given: int) -> dict[str, int]:
    return {"queued": 0, "delayed": 0, "running": 0, "parked": 0, "dead": 0, **given}


def test_counts_follow_each_message_through_its_life(make_runner: RunnerFactory) -> None:
    release.clear()
    runner = make_runner(registry())
    assert runner.job_counts() == {job: zero() for job in (A, B, DIES, HOLD)}
    runner.dispatch_many(A, [{}] * 3)
    runner.dispatch(A, {}, delay_ms=600_000)
    cancelled = runner.dispatch(A, {})
    runner.dispatch(B, {})
    assert counts(runner, A) == zero(queued=4, delayed=1)
    assert runner.cancel(cancelled)
    assert counts(runner, A) == zero(queued=3, delayed=1)
    assert counts(runner, B) == zero(queued=1)
    runner.pause(B)
    runner.dispatch(DIES, {})
    held = runner.dispatch(HOLD, {})
    runner.start()
    wait_for(lambda: counts(runner, HOLD) == zero(running=1), what="hold running")
    wait_for(lambda: counts(runner, B) == zero(parked=1), what="b parked")
    wait_for(lambda: counts(runner, A) == zero(delayed=1), what="a drained")
    # the failed attempt backs off for a minute (delayed), then we let it come due
    wait_for(lambda: counts(runner, DIES) == zero(delayed=1), what="dies backing off")
    runner.resume(B)
    wait_for(lambda: counts(runner, B) == zero(), what="b ran")
    assert runner.stop_run(held)
    wait_for(lambda: counts(runner, HOLD) == zero(), what="hold stopped")
    assert runner.purge(A, state="delayed") == 1
    assert counts(runner, A) == zero()


def test_dead_letters_are_counted_until_retried_or_deleted(make_runner: RunnerFactory) -> None:
    feature = Feature("tally")
    feature.job("dies")(dies)
    runner = make_runner(Registry([feature]))
    first, second = runner.dispatch(DIES, {}), runner.dispatch(DIES, {})
    runner.start()
    wait_for(lambda: counts(runner, DIES)["dead"] == 2, what="two dead letters")
    assert runner.delete_dead(first)
    assert counts(runner, DIES)["dead"] == 1
    assert runner.retry_dead(second)
    wait_for(lambda: counts(runner, DIES)["dead"] == 1, what="dead again")
    assert runner.purge(DIES, state="dead") == 1
    assert counts(runner, DIES) == zero()


def test_older_data_is_counted_once_by_the_backfill_while_messages_come_and_go(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry())
    queue = f"{prefix}-worker"
    # given messages written before counts were kept (an older version wrote no counts
    # hash: its bodies are here, no ~mode, nothing counted)
    older = runner.dispatch_many(A, [{}] * 1_100)
    runner.dispatch_many(B, [{}] * 300, delay_ms=600_000)
    redis_client.delete(keys.queue_counts(queue))
    # when the backfill has taken its first steps ...
    step = runner.broker.lua.counts_backfill
    backfill_keys = [
        keys.queue_counts(queue),
        keys.queue_messages(queue),
        keys.queue_messages(dq_name(queue)),
        keys.dead_letter_messages(queue),
    ]
    assert step(keys=backfill_keys, args=[200]) == 0
    assert step(keys=backfill_keys, args=[200]) == 0
    # ... and meanwhile messages come and go, counted and not yet counted ones alike
    runner.dispatch_many(A, [{}] * 50)
    for message_id in older[:20] + older[-20:]:
        assert runner.cancel(message_id)
    assert runner.purge(B, state="delayed") == 300
    runner.dispatch(B, {}, delay_ms=600_000)
    # then the counts are exact once it is done
    assert counts(runner, A) == zero(queued=1_110)
    assert counts(runner, B) == zero(delayed=1)
    assert redis_client.exists(f"{keys.queue_counts(queue)}:seen") == 0
    runner.start()
    wait_for(lambda: counts(runner, A) == zero(), what="a drained")


def test_a_dataset_written_by_this_version_is_counted_from_its_first_message(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a fresh dataset, When messages are written (a batch, a delayed one, one at a time)
    runner = make_runner(registry())
    queue = f"{prefix}-worker"
    runner.dispatch_many(A, [{}] * 700)
    runner.dispatch(B, {}, delay_ms=600_000)
    runner.dispatch(A, {})
    # Then the counts were kept from the first body on: ready, no backfill to run
    assert redis_client.hget(keys.queue_counts(queue), "~mode") == b"r"
    step = runner.broker.lua.counts_backfill
    done = step(
        keys=[
            keys.queue_counts(queue),
            keys.queue_messages(queue),
            keys.queue_messages(dq_name(queue)),
            keys.dead_letter_messages(queue),
        ],
        args=[1],
    )
    assert done == 1
    assert counts(runner, A) == zero(queued=701)
    assert counts(runner, B) == zero(delayed=1)
