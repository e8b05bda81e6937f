"""Delayed work on a schedule by due time: short delays and retries run behind a far-future
backlog, no worker holds a delayed message, counts are exact, cancel and run-now are cheap,
and what an older version (or a plain ``RedisBroker``) left on Dramatiq's ``.DQ`` list is
moved onto the schedule without loss, also while old writers keep writing there.

Timing here is only "not before its due time"; lateness is measured in
``benchmarks/delayed.py``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from typing import Any
from uuid import uuid4

import redis
from dramatiq.brokers.redis import RedisBroker

from kumiko_dramatiq import Backoff, Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.messages import build_message
from tests.conftest import Recorder, RunnerFactory, wait_for

FAR_MS = 3_600_000
SOON_MS = 300


def registry() -> Registry:
    feature = Feature("later")

    @feature.job("note")
    def note(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    @feature.job("flaky", retries=1, backoff=Backoff("fixed", delay_ms=SOON_MS))
    def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
        if ctx.attempt == 1:
            raise RuntimeError("the first attempt fails")

    return Registry([feature])


def delay_acks(client: redis.Redis, prefix: str) -> list[str]:
    """Ack sets of the worker lane's delay queue: where a worker would hold delayed messages."""
    return [str(key) for key in client.scan_iter(match=f"dramatiq:__acks__.*.{prefix}-worker.DQ")]


def write_old_style(runner: JobRunner, delay_ms: int, count: int) -> list[str]:
    """Write ``count`` delayed messages of ``later:job:note`` as Dramatiq's own ``RedisBroker``
    (and kumiko before the schedule) did: onto the ``.DQ`` list, with an ``eta``."""
    job = runner.registry.jobs["later:job:note"]
    ids = []
    for _ in range(count):
        message = build_message(
            job,
            {},
            queue_prefix=runner.broker.queue_prefix,
            trigger="manual",
            message_id=str(uuid4()),
        )
        RedisBroker.enqueue(runner.broker, message, delay=delay_ms)
        ids.append(str(message.message_id))
    return ids


def test_short_delays_and_retries_run_behind_a_far_future_backlog(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry(), **recorder.hooks())
    # Given 5,000 messages due in an hour (the worker reads none of them into memory)
    runner.dispatch_many("later:job:note", [{"far": n} for n in range(5_000)], delay_ms=FAR_MS)
    runner.start()
    # When short delays and failing jobs with a short backoff follow
    sent = time.time()
    soon = [runner.dispatch("later:job:note", {"soon": n}, delay_ms=SOON_MS) for n in range(5)]
    flaky = [runner.dispatch("later:job:flaky", {"n": n}) for n in range(5)]
    # Then every one of them runs (the retries too), none before its due time
    recorder.wait_until(
        lambda r: {e.message_id for e in r.of("complete")} >= {*soon, *flaky},
        what="the short delays and the retries",
    )
    completed = recorder.of("complete")
    assert {e.message_id for e in completed} == {*soon, *flaky}
    assert all(e.meta.attempt == 2 for e in completed if e.message_id in flaky)
    # the far ones wait on the schedule, counted exactly, held by no worker
    assert runner.status().lanes[0].delayed == 5_000
    assert redis_client.zcard(keys.queue_schedule(f"{prefix}-worker")) == 5_000
    assert delay_acks(redis_client, prefix) == []
    assert time.time() - sent >= SOON_MS / 1000


def test_a_delayed_message_never_runs_before_its_due_time(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    runner = make_runner(registry(), **recorder.hooks())
    runner.start()
    started = time.monotonic()
    delayed = runner.dispatch("later:job:note", delay_ms=1_000)
    recorder.wait_until(lambda r: bool(r.of("start")), what="the delayed message")
    assert time.monotonic() - started >= 1.0
    assert [e.message_id for e in recorder.of("start")] == [delayed]


def test_cancel_of_a_delayed_message_is_counted_at_once(make_runner: RunnerFactory) -> None:
    # Given a producer (no worker) with two delayed messages
    runner = make_runner(registry())
    kept = runner.dispatch("later:job:note", delay_ms=FAR_MS)
    dropped = runner.dispatch("later:job:note", delay_ms=FAR_MS)
    assert runner.status().lanes[0].delayed == 2
    # When one is cancelled
    assert runner.cancel(dropped) is True
    # Then the count is exact at once, and a second cancel finds it ended
    assert runner.status().lanes[0].delayed == 1
    assert runner.cancel(dropped) is False
    assert [run.status for run in runner.run_record(dropped)] == ["cancelled"]
    assert kept != dropped


def test_a_delayed_message_moved_now_runs_at_once(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    runner = make_runner(registry(), **recorder.hooks())
    runner.start()
    delayed = runner.dispatch("later:job:note", delay_ms=FAR_MS)
    # When it is moved to its queue now
    assert runner.admin.move_delayed_now(delayed) is True
    # Then it runs (same id, first attempt), and is no longer delayed
    recorder.wait_until(lambda r: bool(r.of("complete")), what="the moved message")
    (done,) = recorder.of("complete")
    assert (done.message_id, done.meta.attempt) == (delayed, 1)
    assert runner.admin.move_delayed_now(delayed) is False
    assert runner.status().lanes[0].delayed == 0


def test_drain_does_not_wait_for_a_cancelled_delayed_message(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry())
    runner.start()
    delayed = runner.dispatch("later:job:note", delay_ms=FAR_MS)
    assert runner.cancel(delayed) is True
    # its due time is an hour away: drain returns at once, with its cancelled run
    assert [run.status for run in runner.drain(timeout_s=10)] == ["cancelled"]


def test_messages_on_dramatiqs_delay_queue_list_are_scheduled_on_upgrade(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # Given messages an older version wrote onto Dramatiq's .DQ list: some due soon, some far
    runner = make_runner(registry(), **recorder.hooks())
    soon = write_old_style(runner, SOON_MS, 150)
    far = write_old_style(runner, FAR_MS, 30)
    dq_list = keys.queue_list(f"{prefix}-worker.DQ")
    assert redis_client.llen(dq_list) == 180
    # When the new version's worker starts
    runner.start()
    # Then every due one runs once, the far ones wait on the schedule, the list is empty
    recorder.wait_until(
        lambda r: len(r.of("complete")) >= len(soon), what="the old-style delayed messages"
    )
    wait_for(lambda: redis_client.llen(dq_list) == 0, what="the .DQ list to empty")
    assert sorted(e.message_id for e in recorder.of("complete")) == sorted(soon)
    schedule = keys.queue_schedule(f"{prefix}-worker")
    assert redis_client.zcard(schedule) == len(far)
    assert runner.status().lanes[0].delayed == len(far)


def test_a_rolling_deploy_loses_nothing_an_old_writer_puts_on_the_delay_queue_list(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a new worker that runs
    runner = make_runner(registry(), **recorder.hooks())
    runner.start()
    # When an old-style writer keeps writing delayed messages while it runs, beside new ones
    written: list[str] = []
    for _ in range(5):
        written += write_old_style(runner, SOON_MS, 10)
        written += write_old_style(runner, 0, 4)
        written.append(runner.dispatch("later:job:note", delay_ms=SOON_MS))
    # Then every one runs exactly once
    recorder.wait_until(
        lambda r: len(r.of("complete")) >= len(written), what="every delayed message"
    )
    assert sorted(e.message_id for e in recorder.of("complete")) == sorted(written)
    assert redis_client.llen(keys.queue_list(f"{prefix}-worker.DQ")) == 0
    runner.drain(timeout_s=10)
    assert sorted(e.message_id for e in recorder.of("complete")) == sorted(written)


def test_concurrent_movers_move_each_due_message_exactly_once(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given 3,000 messages on the schedule, all due
    runner = make_runner(registry())
    runner.dispatch_many("later:job:note", [{"n": n} for n in range(3_000)], delay_ms=0)
    queue, dq = f"{prefix}-worker", f"{prefix}-worker.DQ"
    # When four movers (as the delay-queue consumers of four processes) race in small batches,
    # and any one of them could die between two steps (each step is one script)
    broker = runner.broker

    def mover() -> None:
        while broker.move_due(dq, 97).moved:
            pass

    threads = [threading.Thread(target=mover) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Then each is on the queue exactly once, body and all, and nothing is left behind
    listed = [text(rid) for rid in redis_client.lrange(keys.queue_list(queue), 0, -1)]
    assert len(listed) == len(set(listed)) == 3_000
    assert redis_client.hlen(keys.queue_messages(queue)) == 3_000
    assert redis_client.zcard(keys.queue_schedule(queue)) == 0
    assert redis_client.hlen(keys.queue_messages(dq)) == 0
    assert runner.status().lanes[0].queued == 3_000


def test_a_delayed_message_a_dead_old_worker_held_is_scheduled_and_runs(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    # Given an old-style delayed message that a worker of the old version had fetched into its
    # memory (its id in that worker's ack set of the .DQ list) before it died
    runner = make_runner(registry(), heartbeat_timeout_ms=2_000, **recorder.hooks())
    (held,) = write_old_style(runner, SOON_MS, 1)
    dq_list = keys.queue_list(f"{prefix}-worker.DQ")
    rid = redis_client.lpop(dq_list)
    assert isinstance(rid, bytes)
    old_worker = f"old-{prefix}"
    redis_client.sadd(keys.consumer_acks(old_worker, f"{prefix}-worker.DQ"), rid)
    redis_client.zadd(keys.heartbeats(), {old_worker: 1})
    # When a new worker runs
    runner.start()
    # Then Dramatiq's maintenance gives it back to the list, it is scheduled, and it runs once
    recorder.wait_until(lambda r: bool(r.of("complete")), what="the held message")
    assert [e.message_id for e in recorder.of("complete")] == [held]
    assert redis_client.llen(dq_list) == 0


MOVER = """
import sys
from kumiko_dramatiq import JobRunner, Registry
broker = JobRunner(Registry([]), redis_url=sys.argv[1], queue_prefix=sys.argv[2]).broker
while True:
    broker.move_due(sys.argv[3], 7)
"""


def test_a_mover_killed_in_the_middle_loses_and_duplicates_nothing(
    make_runner: RunnerFactory, redis_client: redis.Redis, redis_url: str, prefix: str
) -> None:
    # Given 5,000 due messages on the schedule, and a process moving them 7 at a time
    runner = make_runner(registry())
    runner.dispatch_many("later:job:note", [{"n": n} for n in range(5_000)], delay_ms=0)
    queue, dq = f"{prefix}-worker", f"{prefix}-worker.DQ"
    mover = subprocess.Popen([sys.executable, "-c", MOVER, redis_url, prefix, dq])
    try:
        # When it is killed (kill -9) while it moves them
        wait_for(lambda: redis_client.llen(keys.queue_list(queue)) >= 300, what="moves")
        mover.send_signal(signal.SIGKILL)
        mover.wait()
        assert redis_client.zcard(keys.queue_schedule(queue)) > 0, "it moved them all first"
    finally:
        if mover.poll() is None:
            mover.kill()
            mover.wait()
    # and another mover finishes the work
    while runner.broker.move_due(dq, 500).moved:
        pass
    # Then each message is on the queue exactly once, with its body, and none is left behind
    listed = [text(rid) for rid in redis_client.lrange(keys.queue_list(queue), 0, -1)]
    assert len(listed) == len(set(listed)) == 5_000
    assert redis_client.hlen(keys.queue_messages(queue)) == 5_000
    assert redis_client.hlen(keys.queue_messages(dq)) == 0
    assert redis_client.zcard(keys.queue_schedule(queue)) == 0
