"""Priorities and fair keys: the order in which a lane's waiting messages start.

Real Redis, real workers. Messages are dispatched while no worker runs, then one worker with
one thread starts them one at a time, so the order of the start hooks is the order the
claims decided.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis

from kumiko_dramatiq import Feature, JobConfigError, JobContext, PayloadError, Registry
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.codec import fair_digest
from tests.conftest import Recorder, RunnerFactory, wait_for

JOB = "order:job:work"
URGENT = "order:job:urgent"


def registry(**options: Any) -> Registry:
    feature = Feature("order")

    @feature.job("work", **options)
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        pass

    @feature.job("urgent", priority=0)
    def urgent(payload: dict[str, Any], ctx: JobContext) -> None:
        pass

    @feature.job("late", priority=9)
    def late(payload: dict[str, Any], ctx: JobContext) -> None:
        pass

    return Registry([feature])


def started(recorder: Recorder) -> list[str]:
    return [event.message_id for event in recorder.of("start")]


def run_all(runner: Any, recorder: Recorder, count: int) -> list[str]:
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == count, timeout_s=30)
    return started(recorder)


def test_lowest_priority_number_starts_first_fifo_within_a_level(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    runner = make_runner(registry(priority=5), worker_threads=1, **recorder.hooks())
    fives = [runner.dispatch(JOB, {"n": n}) for n in range(5)]
    nine = runner.dispatch("order:job:late")
    zeros = [runner.dispatch(URGENT, {"n": n}) for n in range(3)]
    three = runner.dispatch(JOB, {"n": 99}, priority=3)
    order = run_all(runner, recorder, 10)
    assert order == [*zeros, three, *fives, nine]


def test_priority_reaches_delayed_messages_from_their_due_time(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry(priority=5), worker_threads=1, **recorder.hooks())
    delayed = runner.dispatch(JOB, {"n": "delayed"}, delay_ms=50, priority=1)
    queue = keys.queue_schedule(f"{prefix}-worker")
    wait_for(lambda: redis_client.zcard(queue) == 1)
    later = [runner.dispatch(JOB, {"n": n}) for n in range(3)]
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == 4, timeout_s=30)
    assert set(started(recorder)) == {delayed, *later}


def test_fair_keys_take_turns(make_runner: RunnerFactory, recorder: Recorder) -> None:
    runner = make_runner(registry(), worker_threads=1, **recorder.hooks())
    flood = [runner.dispatch(JOB, {"n": n}, fair_key="big") for n in range(20)]
    others = [runner.dispatch(JOB, {"n": n}, fair_key=f"t{n}") for n in range(5)]
    plain = runner.dispatch(JOB, {"n": "plain"})
    order = run_all(runner, recorder, 26)
    # one round: each other key (and the messages without one) starts within the first 7
    first = order[:7]
    assert all(message_id in first for message_id in [*others, plain])
    assert [m for m in order if m in flood] == flood


def test_a_child_takes_its_tenants_turn(make_runner: RunnerFactory, recorder: Recorder) -> None:
    runner = make_runner(registry(), worker_threads=1, **recorder.hooks())
    flood = [runner.dispatch(JOB, {"n": n}, fair_key="acme") for n in range(10)]
    mine = runner.dispatch(JOB, {"n": "globex"}, fair_key="globex")
    order = run_all(runner, recorder, 11)
    assert order.index(mine) <= 1
    assert [m for m in order if m in flood] == flood


def test_bad_priority_and_fair_key_are_refused_nothing_enqueued(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry())
    bad: Any
    for bad in (10, -1, True, "1", 1.0):
        with pytest.raises(PayloadError, match="priority"):
            runner.dispatch(JOB, {}, priority=bad)
    for bad in ("", "a\x00b", 5):
        with pytest.raises(PayloadError, match="fair_key"):
            runner.dispatch(JOB, {}, fair_key=bad)
    assert runner.admin.queued(limit=10) == []
    for bad in (10, -1, True, None, "0"):
        with pytest.raises(JobConfigError, match="priority"):
            registry(priority=bad)


def test_queued_shows_priority_and_fair_key(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry(priority=4))
    plain = runner.dispatch(URGENT)
    keyed = runner.dispatch(JOB, {}, fair_key="acme")
    late = runner.dispatch(JOB, {}, priority=7, delay_ms=60_000)
    listed = {m.message_id: m for m in runner.admin.queued(limit=10)}
    assert (listed[plain].priority, listed[plain].fair_key) == (0, None)
    assert (listed[keyed].priority, listed[keyed].fair_key) == (4, "acme")
    assert (listed[late].priority, listed[late].fair_key) == (7, None)


class PerKey:
    """Runs of each fair key at once, the most seen, and the most overall."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.total = 0
        self.total_peak = 0

    def enter(self, key: str) -> None:
        with self.lock:
            self.running[key] = self.running.get(key, 0) + 1
            self.peak[key] = max(self.peak.get(key, 0), self.running[key])
            self.total += 1
            self.total_peak = max(self.total_peak, self.total)

    def leave(self, key: str) -> None:
        with self.lock:
            self.running[key] -= 1
            self.total -= 1


def per_key_registry(seen: PerKey, **options: Any) -> Registry:
    feature = Feature("order")
    release = threading.Event()

    @feature.job("work", **options)
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        seen.enter(payload["key"])
        try:
            release.wait(0.05)
        finally:
            seen.leave(payload["key"])

    return Registry([feature])


@pytest.mark.parametrize("max_running", [None, 3])
def test_max_running_per_key_caps_each_key_across_workers(
    make_runner: RunnerFactory, recorder: Recorder, max_running: int | None
) -> None:
    seen = PerKey()
    registry = per_key_registry(seen, max_running_per_key=2, max_running=max_running)
    runners = [make_runner(registry, worker_threads=4, **recorder.hooks()) for _ in range(2)]
    for n in range(8):
        for key in ("acme", "globex"):
            runners[0].dispatch(JOB, {"key": key, "n": n}, fair_key=key)
    for n in range(4):
        runners[0].dispatch(JOB, {"key": "", "n": n})  # the messages without a key: one key
    for runner in runners:
        runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == 20, timeout_s=60)
    assert max(seen.peak.values()) == 2
    assert seen.total_peak <= (max_running or 8)
    assert all(event.meta.attempt == 1 for event in recorder.of("start"))


def test_max_running_per_key_is_validated() -> None:
    for bad in (0, -1, True, "2", 1.5):
        with pytest.raises(JobConfigError, match="max_running_per_key"):
            per_key_registry(PerKey(), max_running_per_key=bad)


def test_purge_and_drain_see_the_messages_in_order(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    runner = make_runner(registry(priority=2), worker_threads=2, **recorder.hooks())
    for n in range(30):
        runner.dispatch(JOB, {"n": n}, fair_key=f"k{n % 3}")
    kept = runner.dispatch(URGENT)
    assert runner.status().lanes[0].queued == 31
    assert runner.purge(JOB, state="queued", dry_run=True) == 30
    assert runner.purge(JOB, state="queued") == 30
    assert runner.status().lanes[0].queued == 1
    runner.start()
    runner.drain(timeout_s=30)
    assert started(recorder) == [kept]
    # the order's keys are gone once nothing waits in it
    left = {
        key.decode().removeprefix(f"dramatiq:{prefix}-worker:")
        for key in redis_client.scan_iter(match=f"dramatiq:{prefix}-worker:*", count=1000)
    }
    assert left <= {"counts", "bell"}


def test_drain_waits_for_messages_in_order(make_runner: RunnerFactory, recorder: Recorder) -> None:
    runner = make_runner(registry(priority=6), worker_threads=2, **recorder.hooks())
    ids = [runner.dispatch(JOB, {"n": n}, fair_key=f"k{n % 4}") for n in range(40)]
    runner.start()
    runner.drain(timeout_s=30)
    assert {event.message_id for event in recorder.of("complete")} == set(ids)


def test_batch_children_and_tenant_children_take_the_priority_given(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    feature = Feature("order")

    @feature.job("work", priority=5)
    def work(payload: dict[str, Any], ctx: JobContext) -> None: ...

    @feature.job("tenants", per_tenant=True, priority=5)
    def tenants(payload: dict[str, Any], ctx: JobContext) -> None: ...

    runner = make_runner(
        Registry([feature]),
        worker_threads=1,
        get_active_tenant_ids=lambda: ["acme", "globex"],
        **recorder.hooks(),
    )
    backlog = [runner.dispatch(JOB, {"n": n}) for n in range(5)]
    batch = runner.dispatch_batch([(JOB, {"b": 1}), (JOB, {"b": 2})], priority=1)
    runner.dispatch("order:job:tenants", {}, priority=2)
    recorder_count = 5 + 2 + 1 + 2  # the backlog, the batch, the wrapper, its children
    runner.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == recorder_count, timeout_s=30)
    order = started(recorder)
    children = [e.message_id for e in recorder.of("start") if e.meta.tenant_id is not None]
    batch_children = [m for m in order if m not in backlog and m not in children][:2]
    assert runner.batch(batch).total == 2
    # the batch's children (1), then the wrapper and its children (2), then the backlog (5)
    assert order[:2] == batch_children
    assert set(order[3:5]) == set(children)
    assert order[5:] == backlog


def test_messages_waiting_for_their_keys_slot_can_be_cancelled_and_purged(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    feature = Feature("order")
    release = threading.Event()

    @feature.job("work", max_running_per_key=1)
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        release.wait(30)

    runner = make_runner(Registry([feature]), worker_threads=4, **recorder.hooks())
    first = runner.dispatch(JOB, {"n": 0}, fair_key="acme")
    runner.start()
    recorder.wait_until(lambda r: len(r.of("start")) == 1)
    waiting = [runner.dispatch(JOB, {"n": n}, fair_key="acme") for n in (1, 2, 3)]
    group = keys.cap_wait(prefix, f"{JOB}:fair:{fair_digest('acme')}")
    wait_for(lambda: redis_client.llen(group) == 3, what="three waiting for acme's slot")
    other = runner.dispatch(JOB, {"n": "globex"}, fair_key="globex")
    recorder.wait_until(lambda r: any(e.message_id == other for e in r.of("start")))
    assert runner.cancel(waiting[0])
    assert runner.purge(JOB, state="queued") == 2
    release.set()
    runner.drain(timeout_s=30)
    assert {e.message_id for e in recorder.of("complete")} == {first, other}
    assert redis_client.llen(group) == 0


def test_the_async_calls_take_priority_and_fair_key(make_runner: RunnerFactory) -> None:
    runner = make_runner(registry())

    async def dispatch() -> list[str]:
        one = await runner.adispatch(JOB, {}, priority=3, fair_key="acme")
        many = await runner.adispatch_many(JOB, [{}, {}], priority=7)
        await runner.aclose()
        return [one, *many]

    one, *many = asyncio.run(dispatch())
    listed = {m.message_id: m for m in runner.admin.queued(limit=10)}
    assert (listed[one].priority, listed[one].fair_key) == (3, "acme")
    assert [listed[m].priority for m in many] == [7, 7]
    with pytest.raises(PayloadError, match="priority"):
        asyncio.run(runner.adispatch(JOB, {}, priority=11))
