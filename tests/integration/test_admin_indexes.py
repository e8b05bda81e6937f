"""Admin reads and actions that stay bounded on a big dataset: the indexes of held locks and
live dedup keys, ``cancel`` by the redis ids kumiko derives from a message id, ids withdrawn
from a queue without searching it, ``resume`` in bounded steps, and none of them walking the
keyspace or a queue (counted on a private redis-server with ``INFO commandstats``)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kumiko_dramatiq import Feature, JobContext, JobRunner, NotFoundError, Registry
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.ids import redis_message_id
from kumiko_dramatiq.options import lane_queue
from kumiko_dramatiq.testing import private_redis_server
from tests.conftest import Recorder, RunnerFactory, wait_for

NOTE = "idx:job:note"
FLAKY = "idx:job:flaky"
SEQ = "idx:job:seq"


def registry(release: threading.Event | None = None) -> Registry:
    idx = Feature("idx")

    @idx.job("note")
    def note(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    @idx.job("flaky", retries=2)
    def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
        if release is not None:
            release.wait(30)
        raise RuntimeError(f"attempt {ctx.attempt} failed")

    @idx.job("seq", concurrency="sequential")
    def seq(payload: dict[str, Any], ctx: JobContext) -> None:
        if release is not None:
            release.wait(30)

    return Registry([idx])


def members(reply: Any) -> set[str]:
    return {item.decode() for item in reply}


def queue_of(runner: JobRunner) -> str:
    return lane_queue(runner.queue_prefix, "worker")


# -- locks ------------------------------------------------------------------------------------


def test_a_lock_whose_holder_was_killed_is_listed_until_its_lease_runs_out_then_swept(
    make_runner: RunnerFactory, redis_client: redis.Redis
) -> None:
    # Given a lock held by a live lease, and one taken by a run that is in flight nowhere (its
    # worker was killed) with a 300 ms lease
    runner = make_runner(registry())
    kept = keys.sequential_lock(runner.queue_prefix, SEQ, "kept")
    runner.broker.lua.lock_acquire(keys=[kept], args=["m-kept:token", 60_000])
    dead = keys.sequential_lock(runner.queue_prefix, SEQ, None)
    assert runner.broker.lua.lock_acquire(keys=[dead], args=["m-dead:token", 300]) == 1

    # Then both are listed, the dead one flagged: no live worker holds it
    held = {lock.tenant_id: lock for lock in runner.locks()}
    assert (held[None].message_id, held[None].worker, held[None].worker_alive) == (
        "m-dead",
        None,
        False,
    )
    assert held[None].held_since is not None
    # and once its lease ran out it is listed no more, though its index entry is still there
    wait_for(
        lambda: [lock.tenant_id for lock in runner.locks()] == ["kept"],
        what="the lease to run out",
    )
    index = keys.locks_index(runner.queue_prefix)
    assert redis_client.zcard(index) == 2

    def run_out_by_redis_clock() -> bool:
        seconds, micros = redis_client.time()
        score = redis_client.zscore(index, SEQ)
        return score is not None and seconds * 1000 + micros // 1000 > score

    wait_for(run_out_by_redis_clock, what="Redis's clock past the lease")  # not ours
    # When the next run takes a lock, Then the run-out entry is swept
    other = keys.sequential_lock(runner.queue_prefix, SEQ, "acme")
    runner.broker.lua.lock_acquire(keys=[other], args=["m-next:token", 30_000])
    assert members(redis_client.zrange(index, 0, -1)) == {
        f"{SEQ}:tenant:4:kept",
        f"{SEQ}:tenant:4:acme",
    }
    since = members(redis_client.hkeys(keys.locks_since(runner.queue_prefix)))
    assert since == {f"{SEQ}:tenant:4:kept", f"{SEQ}:tenant:4:acme"}
    # and releases take their entries away (the empty index is gone)
    runner.broker.lua.lock_release(keys=[other], args=["m-next:token"])
    runner.broker.lua.lock_release(keys=[kept], args=["m-kept:token"])
    assert not redis_client.exists(index, keys.locks_since(runner.queue_prefix))


# -- dedup keys -------------------------------------------------------------------------------


def test_a_dedup_key_leaves_the_index_when_its_job_ends_and_an_expired_one_is_never_listed(
    make_runner: RunnerFactory, redis_client: redis.Redis, recorder: Recorder
) -> None:
    # Given two keyed messages waiting
    producer = make_runner(registry())
    kept = producer.dispatch(NOTE, dedup_key="kept")
    producer.dispatch(NOTE, dedup_key="lost")
    assert sorted(info.dedup_key for info in producer.dedup_keys()) == ["kept", "lost"]
    # When one record expires without its job ending (its message was lost for good)
    redis_client.pexpire(keys.dedup(producer.queue_prefix, NOTE, "lost"), 1)
    wait_for(
        lambda: [info.dedup_key for info in producer.dedup_keys()] == ["kept"],
        what="the expired key to drop out of the listing",
    )
    # and the other job runs and ends (the message of the lost record runs too: only its
    # record went)
    worker = make_runner(registry(), **recorder.hooks())
    worker.start()
    recorder.wait_until(lambda r: len(r.of("complete", NOTE)) == 2, what="the jobs to end")
    assert kept in {event.message_id for event in recorder.of("complete", NOTE)}
    # Then nothing is listed, and the index is gone with its last live entry
    wait_for(lambda: producer.dedup_keys() == [], what="its key to be freed")
    index = keys.dedup_index(producer.queue_prefix, NOTE)
    wait_for(lambda: redis_client.zcard(index) <= 1, what="the freed key out of the index")
    # once the lost record's expiry has passed (moved to the past here, as time would), the
    # next fresh record sweeps its entry away
    redis_client.zadd(index, {"lost": 1})
    producer.pause(NOTE)  # keep it waiting
    producer.dispatch(NOTE, dedup_key="fresh")
    assert members(redis_client.zrange(index, 0, -1)) == {"fresh"}
    assert redis_client.pttl(index) > 0


# -- cancel -----------------------------------------------------------------------------------


def test_a_cancelled_queued_message_never_runs_and_leaves_the_counts_at_once(
    make_runner: RunnerFactory, redis_client: redis.Redis, recorder: Recorder
) -> None:
    # Given three messages queued
    producer = make_runner(registry())
    first, cancelled, last = (producer.dispatch(NOTE, {"n": n}) for n in range(3))

    # When the middle one is cancelled
    assert producer.cancel(cancelled) is True

    # Then it no longer counts, its id staying in the list only until a fetch meets it
    assert producer.status().lanes[0].queued == 2
    queue = queue_of(producer)
    assert redis_client.llen(keys.queue_list(queue)) == 3
    assert [run.status for run in producer.run_record(cancelled)] == ["cancelled"]
    # a second cancel finds it ended; an unknown id is not found
    assert producer.cancel(cancelled) is False
    with pytest.raises(NotFoundError):
        producer.cancel(str(uuid.uuid4()))
    # When a worker runs the queue, Then only the other two run, and the withdrawn id is gone
    worker = make_runner(registry(), **recorder.hooks())
    worker.start()
    recorder.wait_until(lambda r: len(r.of("complete", NOTE)) == 2, what="the other two")
    worker.drain(timeout_s=20)
    assert {e.message_id for e in recorder.of("start")} == {first, last}
    assert redis_client.llen(keys.queue_list(queue)) == 0
    assert not redis_client.exists(keys.queue_withdrawn(queue))


def test_cancel_finds_a_retry_parked_behind_a_pause_and_resume_drops_it(
    make_runner: RunnerFactory, redis_client: redis.Redis, recorder: Recorder
) -> None:
    # Given a job whose first attempt fails while the job was paused meanwhile: its retry (no
    # backoff) is queued and then parked by the fetch
    release = threading.Event()
    worker = make_runner(registry(release), **recorder.hooks())
    worker.start()
    message_id = worker.dispatch(FLAKY)
    recorder.wait_until(lambda r: bool(r.of("start", FLAKY)), what="attempt 1")
    worker.pause(FLAKY)
    release.set()
    recorder.wait_until(lambda r: bool(r.of("failed", FLAKY)), what="attempt 1 to fail")
    wait_for(lambda: worker.status().lanes[0].parked == 1, what="the retry to be parked")
    # its redis id is the one kumiko derives for attempt 2
    parked = keys.parked(worker.queue_prefix, FLAKY)
    assert redis_client.lrange(parked, 0, -1) == [redis_message_id(message_id, 2).encode()]

    # When it is cancelled by its message id
    assert worker.cancel(message_id) is True

    # Then it no longer counts as parked, and resume drops it instead of running it
    assert worker.status().lanes[0].parked == 0
    assert worker.admin.resume(worker.job(FLAKY)) == (0, 0)
    assert redis_client.llen(parked) == 0
    assert not redis_client.exists(keys.parked_withdrawn(worker.queue_prefix, FLAKY))
    assert [run.status for run in worker.run_record(message_id)] == ["failed", "cancelled"]
    assert len(recorder.of("start", FLAKY)) == 1


def test_resume_puts_a_big_parked_backlog_back_in_steps_and_in_its_order(
    make_runner: RunnerFactory, redis_client: redis.Redis, recorder: Recorder
) -> None:
    # Given 2,500 messages of a paused job parked by a worker (more than two resume steps)
    worker = make_runner(registry(), **recorder.hooks())
    worker.pause(NOTE)
    ids = worker.dispatch_many(NOTE, [{"n": n} for n in range(2_500)])
    worker.start()
    wait_for(lambda: worker.status().lanes[0].parked == 2_500, what="all of them parked")
    worker.stop()

    # When the job is resumed (no worker consumes meanwhile)
    producer = make_runner(registry())
    assert producer.admin.resume(producer.job(NOTE)) == (2_500, 0)

    # Then they wait at the head of the queue in their parked order, none left parked
    queue = keys.queue_list(queue_of(producer))
    parked_order = [redis_message_id(message_id).encode() for message_id in ids]
    assert sorted(redis_client.lrange(queue, 0, -1)) == sorted(parked_order)
    assert redis_client.lrange(queue, 0, -1) == parked_order
    assert not redis_client.exists(keys.parked(producer.queue_prefix, NOTE))
    assert producer.status().paused == []


# -- bounded work ---------------------------------------------------------------------------


@pytest.fixture
def private_url() -> Iterator[str]:
    with private_redis_server() as url:
        yield url


WALKS = ("scan", "keys", "hscan", "sscan", "zscan", "lpos", "lrem", "lrange")


def calls_of(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(stat["calls"]) for name, stat in stats.items()}


def test_no_admin_read_or_action_walks_the_keyspace_or_a_queue(private_url: str) -> None:
    # Given a Redis shared with another app's 20,000 keys, 3,000 queued messages (a tenth
    # keyed), 100 delayed, a lock whose holder is gone and a dead letter's note
    client = redis.Redis.from_url(private_url)
    pipe = client.pipeline(transaction=False)
    for n in range(20_000):
        pipe.set(f"otherapp:session:{n}", "x")
    pipe.execute()
    runner = JobRunner(registry(), redis_url=private_url, queue_prefix="big")
    try:
        ids = runner.dispatch_many(NOTE, [{"n": n} for n in range(2_700)])
        keyed = runner.dispatch_many(
            NOTE, [{"n": n} for n in range(300)], dedup_keys=[f"k{n}" for n in range(300)]
        )
        delayed = runner.dispatch_many(NOTE, [{"n": n} for n in range(100)], delay_ms=600_000)
        lock = keys.sequential_lock("big", SEQ, None)
        runner.broker.lua.lock_acquire(keys=[lock], args=["m-gone:token", 30_000])
        client.config_resetstat()

        # When every admin read and action runs
        runner.status()
        runner.jobs()
        assert len(runner.locks()) == 1
        assert len(runner.dedup_keys(limit=1_000)) == 300
        page, cursor = runner.admin.dedup_page(NOTE, limit=100)
        assert len(page) == 100
        assert cursor is not None
        runner.dead_letters()
        assert runner.admin.waiting_state(ids[-1]) == "queued"
        assert runner.admin.waiting_state(delayed[-1]) == "delayed"
        assert runner.cancel(ids[-1])
        assert runner.cancel(keyed[150])
        assert runner.cancel(delayed[50])
        assert runner.cancel(ids[-1]) is False
        with pytest.raises(NotFoundError):
            runner.cancel(str(uuid.uuid4()))
        with pytest.raises(NotFoundError):
            runner.retry_dead(str(uuid.uuid4()))
        runner.admin.ids_starting_with(ids[-1][:6])

        # Then none of them walked the keyspace or a queue, and the counts are exact
        calls = calls_of(client)
        assert {name: calls[name] for name in WALKS if name in calls} == {}
        lane = runner.status().lanes[0]
        assert (lane.queued, lane.delayed) == (2_998, 99)
        assert len(runner.dedup_keys(limit=1_000)) == 299
    finally:
        runner.stop()
        client.close()
