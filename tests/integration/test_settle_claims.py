"""The settle that claims: a consumer's ack also claims its next messages (``lua/settle.lua``
with ``include/lane_claim.lua``), so a steadily draining consumer sends no fetch of its own.

Real Redis, a runner's broker and consumer driven by hand (no worker threads): each test
takes deliveries from the consumer as Dramatiq's worker would, acks them, and reads what
the ack claimed in Redis (the worker's ack set, the in-flight hash) and in the consumer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis

from kumiko_dramatiq import Feature, JobContext, Registry
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.consumer import KumikoConsumer
from kumiko_dramatiq.broker.delivery import Delivery, LaneFetch
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.runner import JobRunner
from tests.conftest import Recorder, RunnerFactory, wait_for

JOB = "claims:job:work"


def _registry(**options: Any) -> Registry:
    feature = Feature("claims")

    @feature.job("work", **options)
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        pass

    return Registry([feature])


def _counted_fetches(runner: JobRunner, monkeypatch: pytest.MonkeyPatch) -> list[LaneFetch]:
    """Every ``fetch_lane`` call the consumer makes from now on, recorded."""
    fetches: list[LaneFetch] = []
    fetch_lane: Callable[..., tuple[LaneFetch, Any, float]] = runner.broker.fetch_lane

    def counting(*args: Any, **kwargs: Any) -> tuple[LaneFetch, Any, float]:
        result = fetch_lane(*args, **kwargs)
        fetches.append(result[0])
        return result

    monkeypatch.setattr(runner.broker, "fetch_lane", counting)
    return fetches


def _take(consumer: KumikoConsumer) -> Delivery:
    """The next delivery, as Dramatiq's consumer thread takes it."""
    for _ in range(50):
        delivery = next(consumer)
        if delivery is not None:
            assert isinstance(delivery, Delivery)
            return delivery
    raise AssertionError("no delivery")


def _acks(client: redis.Redis, runner: JobRunner, queue: str) -> set[str]:
    broker = runner.broker
    return {text(rid) for rid in client.smembers(keys.consumer_acks(broker.broker_id, queue))}


def _ack(consumer: KumikoConsumer, delivery: Delivery) -> None:
    """Ack ``delivery`` as Dramatiq's worker thread does, and wait until its settle (sent by
    the consumer's settler thread) landed."""
    consumer.ack(delivery)
    assert consumer.settler.flush(10)


def _entries(client: redis.Redis, prefix: str) -> dict[str, str]:
    return {text(k): text(v) for k, v in client.hgetall(keys.inflight(prefix)).items()}


def _setup(
    make_runner: RunnerFactory, registry: Registry, prefix: str, messages: int, prefetch: int
) -> tuple[JobRunner, str, KumikoConsumer]:
    runner = make_runner(registry)
    for n in range(messages):
        runner.dispatch(JOB, {"n": n})
    queue = registry.jobs[JOB].queue_name(prefix)
    consumer = runner.broker.consume(queue, prefetch=prefetch, timeout=200)
    return runner, queue, consumer


def test_a_fetch_claims_one_message_to_run_per_free_thread_and_one_ahead(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a consumer of one thread (prefetch 2), 4 queued
    runner, queue, consumer = _setup(make_runner, _registry(), prefix, 4, prefetch=2)
    first = _take(consumer)
    # Then its fetch claimed two: one running for its free thread, one held ahead of it
    entries = _entries(redis_client, prefix)
    assert set(entries) == _acks(redis_client, runner, queue)
    assert entries[first.redis_message_id].startswith("1|")
    (ahead,) = [rid for rid in entries if rid != first.redis_message_id]
    assert entries[ahead].startswith("h1|")
    assert entries[ahead].endswith(runner.broker.worker_identity())
    assert redis_client.llen(keys.queue_list(queue)) == 2


def test_a_settle_claims_the_consumers_next_messages_and_they_are_in_flight(
    make_runner: RunnerFactory,
    redis_client: redis.Redis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a consumer that holds two messages at a time (prefetch 2: one thread), 4 queued
    runner, queue, consumer = _setup(make_runner, _registry(), prefix, 4, prefetch=2)
    fetches = _counted_fetches(runner, monkeypatch)
    first = _take(consumer)
    assert len(fetches) == 1
    before = _acks(redis_client, runner, queue)
    # When it is settled
    _ack(consumer, first)
    # Then that settle claimed the next one for this worker, in flight like a fetched one
    acks = _acks(redis_client, runner, queue)
    assert len(acks) == 2
    (claimed,) = acks - before
    assert first.redis_message_id not in acks
    assert claimed in _entries(redis_client, prefix)
    assert redis_client.hget(keys.inflight(prefix), first.redis_message_id) is None
    assert redis_client.llen(keys.queue_list(queue)) == 1
    # and the consumer hands them out without a fetch of its own, and so on to the last
    taken = [first.redis_message_id]
    for _ in range(3):
        delivery = _take(consumer)
        taken.append(delivery.redis_message_id)
        _ack(consumer, delivery)
    assert len(fetches) == 1
    assert taken[2] == claimed
    assert len(set(taken)) == 4
    assert _acks(redis_client, runner, queue) == set()
    assert redis_client.hlen(keys.inflight(prefix)) == 0


def test_a_stopping_or_closed_consumer_claims_nothing(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner, queue, consumer = _setup(make_runner, _registry(), prefix, 5, prefetch=2)
    first = _take(consumer)
    claimed = _acks(redis_client, runner, queue) - {first.redis_message_id}
    # a worker shutting down: its consumers are woken and claim nothing more
    runner.broker.wake_consumers()
    _ack(consumer, first)
    assert _acks(redis_client, runner, queue) == claimed
    assert redis_client.llen(keys.queue_list(queue)) == 3
    # a consumer closed by Dramatiq (it gave back what it held) claims nothing either
    runner.broker.wakeups.resume()
    second = runner.broker.consume(queue, prefetch=2, timeout=200)
    taken = _take(second)
    second.requeue([])
    _ack(second, taken)
    assert _acks(redis_client, runner, queue) == claimed
    assert redis_client.llen(keys.queue_list(queue)) == 2


def test_a_settle_claims_nothing_while_its_consumer_fetches(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # one claim at a time per consumer: the room each computes is then true
    runner, queue, consumer = _setup(make_runner, _registry(), prefix, 4, prefetch=2)
    first = _take(consumer)
    claimed = _acks(redis_client, runner, queue) - {first.redis_message_id}
    with consumer._claim_lock:  # the consumer's own fetch is under way
        _ack(consumer, first)
    assert _acks(redis_client, runner, queue) == claimed
    assert redis_client.llen(keys.queue_list(queue)) == 2


def test_a_freed_slot_goes_to_its_oldest_waiter_claimed_by_the_settling_consumer(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a job capped at one run, one running and two waiting for its slot
    runner, queue, consumer = _setup(make_runner, _registry(max_running=1), prefix, 3, prefetch=8)
    first = _take(consumer)
    assert first.slot is not None
    waiters = [text(rid) for rid in redis_client.lrange(keys.cap_wait(prefix, JOB), 0, -1)]
    assert len(waiters) == 2
    redis_client.delete(keys.queue_bell(queue))
    # When the run ends
    _ack(consumer, first)
    # Then its settle gave the slot to the oldest waiter, claimed for this consumer (no
    # doorbell rung for another consumer to fetch it)
    assert _acks(redis_client, runner, queue) == {waiters[0]}
    assert redis_client.exists(keys.queue_bell(queue)) == 0
    slots = redis_client.zrange(keys.cap_slots(prefix, JOB), 0, -1)
    assert [text(token) for token in slots] == [f"{waiters[0]}#1"]
    second = _take(consumer)
    assert second.redis_message_id == waiters[0]
    assert second.slot == (keys.cap_slots(prefix, JOB), f"{waiters[0]}#1")
    _ack(consumer, second)
    third = _take(consumer)
    assert third.redis_message_id == waiters[1]
    _ack(consumer, third)
    assert redis_client.zcard(keys.cap_slots(prefix, JOB)) == 0
    assert _acks(redis_client, runner, queue) == set()


def _waiting_on_the_doorbell(runner: JobRunner, consumer: KumikoConsumer) -> bool:
    return consumer.broker.wakeups.waits(id(consumer))


def test_a_claim_wakes_its_consumer_waiting_on_the_doorbell(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a consumer holding one run of a capped job, its other message waiting for the
    # slot, and the consumer idle on the doorbell (a long wait)
    runner, queue, consumer = _setup(make_runner, _registry(max_running=1), prefix, 2, prefetch=8)
    consumer.timeout = 30_000
    first = _take(consumer)
    redis_client.delete(keys.queue_bell(queue))
    waited = threading.Event()

    def idle() -> None:
        assert next(consumer) is None  # nothing to fetch: waits on the doorbell
        waited.set()

    thread = threading.Thread(target=idle, daemon=True)
    thread.start()
    wait_for(lambda: _waiting_on_the_doorbell(runner, consumer), 10, "the wait on the doorbell")
    # When the run ends, its settle claims the waiter
    _ack(consumer, first)
    # Then the wait ends at once (not after its 60 s), and the waiter is handed out
    assert waited.wait(10)
    thread.join(10)
    second = _take(consumer)
    assert second.slot is not None
    _ack(consumer, second)


def test_a_consumer_that_took_all_there_was_waits_for_the_doorbell_not_a_fetch(
    make_runner: RunnerFactory,
    redis_client: redis.Redis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a consumer whose fetch took the one message there was (less than its room), the
    # doorbell's token of that message's enqueue taken too
    runner, queue, consumer = _setup(make_runner, _registry(), prefix, 1, prefetch=8)
    fetches = _counted_fetches(runner, monkeypatch)
    consumer.timeout = 30_000
    first = _take(consumer)
    assert len(fetches) == 1
    redis_client.delete(keys.queue_bell(queue))
    turned = threading.Event()

    def turn() -> None:
        assert next(consumer) is None
        turned.set()

    thread = threading.Thread(target=turn, daemon=True)
    thread.start()
    wait_for(lambda: _waiting_on_the_doorbell(runner, consumer), 10, "the wait on the doorbell")
    # Then its next turn sent no fetch: it waits on the doorbell
    assert len(fetches) == 1
    # When a dispatch rings the doorbell, the wait ends and the next turn fetches again
    second_id = runner.dispatch(JOB, {"n": 1})
    assert turned.wait(10)
    thread.join(10)
    second = _take(consumer)
    assert second.message_id == second_id
    assert len(fetches) == 2
    _ack(consumer, first)
    _ack(consumer, second)


def test_a_running_worker_hands_a_freed_slot_on_without_fetching(
    make_runner: RunnerFactory, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a job capped at one run at a time, 12 of its messages queued, a started worker
    runner = make_runner(_registry(max_running=1), **recorder.hooks())
    ids = [runner.dispatch(JOB, {"n": n}) for n in range(12)]
    fetches = _counted_fetches(runner, monkeypatch)
    runner.start()
    # When they all run
    recorder.wait_until(lambda r: len(r.of("complete")) == 12, timeout_s=30)
    # Then one after another, in arrival order, each taken by the settle of the run before
    # it (handed to a worker thread at once), not by a fetch of its own
    assert [event.message_id for event in recorder.of("start")] == ids
    assert len(fetches) < 6


def test_a_slot_freed_while_the_worker_runs_another_run_of_the_job_goes_to_its_claim(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a job capped at two runs, both run by this consumer, one message waiting
    runner, queue, consumer = _setup(make_runner, _registry(max_running=2), prefix, 3, prefetch=8)
    first, second = _take(consumer), _take(consumer)
    waiting = [text(rid) for rid in redis_client.lrange(keys.cap_wait(prefix, JOB), 0, -1)]
    assert len(waiting) == 1
    redis_client.delete(keys.queue_bell(queue))
    # When one run ends while the other goes on
    _ack(consumer, first)
    # Then its settle claims the waiter with the freed slot for this consumer (its worker
    # thread has just finished: the fastest hand-over), without ringing the doorbell
    assert _acks(redis_client, runner, queue) == {second.redis_message_id, *waiting}
    assert redis_client.exists(keys.queue_bell(queue)) == 0
    assert redis_client.llen(keys.cap_wait(prefix, JOB)) == 0
    third = _take(consumer)
    assert third.redis_message_id == waiting[0]
    _ack(consumer, second)
    _ack(consumer, third)
