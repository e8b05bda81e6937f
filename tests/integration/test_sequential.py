"""Sequential concurrency: one run at a time, a leased lock, hand-offs on a held lock.

Real Redis, real workers. Where a test needs "the lock is held by someone
else" without caring who, it writes the lock key itself, like a run on
another machine would.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from dramatiq.broker import Broker
from dramatiq.common import dq_name
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from dramatiq.middleware.time_limit import TimeLimitExceeded

from kumiko_dramatiq import (
    Backoff,
    Feature,
    JobContext,
    JobMeta,
    JobRunner,
    Registry,
    build_message_options,
)
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.keys import queue_messages
from kumiko_dramatiq.errors import SequentialLockError
from kumiko_dramatiq.ids import child_message_id, handoff_message_id
from tests.apps import sequential_app
from tests.conftest import Recorder, RunnerFactory, wait_for

JOB = "seq:job:work"
OTHER_HOLDER = "another-run:0000"
ROOT = Path(__file__).resolve().parents[2]

Handler = Callable[[dict[str, Any], JobContext], None]


def registry_of(handler: Handler, **options: Any) -> Registry:
    feature = Feature("seq")
    feature.job("work", concurrency="sequential", **options)(handler)
    return Registry([feature])


def noop(payload: dict[str, Any], ctx: JobContext) -> None:
    return None


class Enqueues(Middleware):
    """Records every message the broker actually enqueued, with its delay."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entries: list[tuple[Message[Any], int | None]] = []

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        with self._lock:
            self.entries.append((message, delay))

    def first(self, message_id: str) -> tuple[Message[Any], int | None] | None:
        with self._lock:
            return next((e for e in self.entries if e[0].message_id == message_id), None)

    def hand_offs(self, message_id: str) -> list[tuple[Message[Any], int | None]]:
        """The chain of hand-offs that started at ``message_id``, in order."""
        chain = []
        entry = self.first(handoff_message_id(message_id))
        while entry is not None:
            chain.append(entry)
            entry = self.first(handoff_message_id(entry[0].message_id))
        return chain

    def count(self, message_id: str) -> int:
        with self._lock:
            return sum(1 for m, _ in self.entries if m.message_id == message_id)


def lock_key(prefix: str, tenant_id: str | None = None) -> str:
    return keys.sequential_lock(prefix, JOB, tenant_id)


def drained(client: redis.Redis, prefix: str) -> bool:
    """No message of the worker lane is queued, delayed or unacked."""
    queue = f"{prefix}-worker"
    return all(client.hlen(queue_messages(name)) == 0 for name in (queue, dq_name(queue)))


def started_runner(
    make_runner: RunnerFactory, registry: Registry, recorder: Recorder, **options: Any
) -> tuple[JobRunner, Enqueues]:
    options.setdefault("sequential_retry_delay_ms", 100)
    runner = make_runner(registry, **recorder.hooks(), **options)
    enqueues = Enqueues()
    runner.broker.add_middleware(enqueues)
    runner.start()
    return runner, enqueues


# -- mutual exclusion -----------------------------------------------------
def test_twenty_dispatches_never_overlap_and_each_runs_once(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: redis.Redis, prefix: str
) -> None:
    guard = threading.Lock()
    running = [0]
    overlaps: list[int] = []
    intervals: list[tuple[float, float, int]] = []

    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        with guard:
            running[0] += 1
            if running[0] > 1:
                overlaps.append(payload["i"])
        start = time.monotonic()
        time.sleep(0.01)
        end = time.monotonic()
        with guard:
            running[0] -= 1
            intervals.append((start, end, payload["i"]))

    runner, _ = started_runner(make_runner, registry_of(work), recorder, worker_threads=8)
    for i in range(20):
        runner.dispatch(JOB, {"i": i})

    recorder.wait_until(lambda r: len(r.of("complete")) >= 20, timeout_s=60, what="20 runs")
    wait_for(lambda: drained(redis_client, prefix), what="drained queues")

    assert overlaps == []
    ordered = sorted(intervals)
    for (_, end, _), (start, _, _) in itertools.pairwise(ordered):
        assert end <= start
    assert sorted(i for _, _, i in intervals) == list(range(20))
    assert recorder.of("failed") == []
    assert not redis_client.exists(lock_key(prefix))


def test_per_tenant_locks_are_per_tenant(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, redis_client: redis.Redis
) -> None:
    # Given a per-tenant sequential job whose runs only finish once BOTH
    # tenants' runs are inside the handler at the same time
    barrier = threading.Barrier(2, timeout=15)
    held_own_lock: dict[str, bool] = {}

    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        assert ctx.tenant_id is not None
        held_own_lock[ctx.tenant_id] = bool(redis_client.exists(lock_key(prefix, ctx.tenant_id)))
        barrier.wait()

    started_runner(
        make_runner,
        registry_of(work, per_tenant=True),
        recorder,
        get_active_tenant_ids=lambda: ["acme", "globex"],
    )[0].dispatch(JOB)

    recorder.wait_until(
        lambda r: len([e for e in r.of("complete") if e.meta.tenant_id]) == 2, what="two tenants"
    )
    assert recorder.of("failed") == []
    assert held_own_lock == {"acme": True, "globex": True}
    children = [e for e in recorder.of("start") if e.meta.tenant_id]
    assert {e.meta.trigger for e in children} == {"fanout"}


def test_a_held_tenant_lock_delays_only_that_tenant(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, redis_client: redis.Redis
) -> None:
    redis_client.set(lock_key(prefix, "acme"), OTHER_HOLDER, px=60_000)
    runner, enqueues = started_runner(
        make_runner,
        registry_of(noop, per_tenant=True),
        recorder,
        get_active_tenant_ids=lambda: ["acme", "globex"],
    )
    wrapper = runner.dispatch(JOB)

    recorder.wait_until(
        lambda r: [e.meta.tenant_id for e in r.of("complete") if e.meta.tenant_id] == ["globex"],
        what="globex done",
    )
    # (globex may finish before acme's child has even met its lock: wait for its hand-off)
    acme_child = child_message_id(wrapper, "acme")
    wait_for(lambda: enqueues.hand_offs(acme_child) != [], what="acme's hand-off")
    assert [e.meta.tenant_id for e in recorder.of("start") if e.meta.tenant_id] == ["globex"]

    redis_client.delete(lock_key(prefix, "acme"))
    recorder.wait_until(
        lambda r: any(e.meta.tenant_id == "acme" for e in r.of("complete")), what="acme done"
    )
    acme = next(e for e in recorder.of("complete") if e.meta.tenant_id == "acme")
    assert acme.meta.trigger == "requeue"


# -- hand-offs ----------------------------------------------------------------
def test_a_held_lock_hands_off_to_a_new_message_with_the_same_payload(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, redis_client: redis.Redis
) -> None:
    payloads: list[dict[str, Any]] = []

    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        payloads.append(payload)

    registry = registry_of(work, retries=2, backoff="fixed")
    redis_client.set(lock_key(prefix), OTHER_HOLDER, px=60_000)
    runner, enqueues = started_runner(
        make_runner, registry, recorder, sequential_retry_delay_ms=150
    )
    original = runner.dispatch(JOB, {"invoice": 7})
    wait_for(lambda: enqueues.hand_offs(original) != [], what="a hand-off")
    redis_client.delete(lock_key(prefix))
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the requeued run")

    done = recorder.of("complete")[0]
    assert done.message_id != original
    assert done.meta.trigger == "requeue"
    assert (done.meta.attempt, done.meta.max_attempts) == (1, 3)
    assert payloads == [{"invoice": 7}]
    for message, delay in enqueues.hand_offs(original):
        assert build_message_options(registry.jobs[JOB]).items() <= message.options.items()
        assert message.args == ({"invoice": 7},)
        assert delay is not None
        assert delay >= 150


def test_a_hand_off_calls_no_hooks(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, redis_client: redis.Redis
) -> None:
    redis_client.set(lock_key(prefix), OTHER_HOLDER, px=60_000)
    runner, enqueues = started_runner(make_runner, registry_of(noop), recorder)
    original = runner.dispatch(JOB)
    wait_for(lambda: len(enqueues.hand_offs(original)) >= 2, what="two hand-offs")
    redis_client.delete(lock_key(prefix))
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the requeued run")
    wait_for(lambda: drained(redis_client, prefix), what="drained queues")

    ran = recorder.of("complete")[0].message_id
    assert [e.message_id for e in recorder.of("start")] == [ran]
    assert recorder.of("failed") == []


def test_a_hand_off_is_logged_at_info_not_as_an_error(
    make_runner: RunnerFactory,
    recorder: Recorder,
    prefix: str,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    redis_client.set(lock_key(prefix), OTHER_HOLDER, px=60_000)
    runner, enqueues = started_runner(make_runner, registry_of(noop), recorder)
    original = runner.dispatch(JOB)
    wait_for(lambda: len(enqueues.hand_offs(original)) >= 2, what="two hand-offs")
    redis_client.delete(lock_key(prefix))
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the requeued run")

    hand_off_logs = [r for r in caplog.records if "handed off to" in r.getMessage()]
    assert hand_off_logs
    assert {r.levelno for r in hand_off_logs} == {logging.INFO}
    assert original in hand_off_logs[0].getMessage()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_requeued_message_that_fails_once_is_retried_on_its_own_id_with_a_full_budget(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, redis_client: redis.Redis
) -> None:
    def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
        if ctx.trigger == "requeue" and ctx.attempt == 1:
            raise RuntimeError("first attempt of the requeued message fails")

    redis_client.set(lock_key(prefix), OTHER_HOLDER, px=60_000)
    runner, enqueues = started_runner(make_runner, registry_of(flaky, retries=1), recorder)
    original = runner.dispatch(JOB)
    wait_for(lambda: enqueues.hand_offs(original) != [], what="a hand-off")
    redis_client.delete(lock_key(prefix))
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the retried run")

    [failed] = recorder.of("failed")
    requeued = failed.message_id
    assert requeued != original
    assert requeued in {m.message_id for m, _ in enqueues.hand_offs(original)}
    assert (failed.meta.trigger, failed.meta.attempt, failed.meta.max_attempts) == ("requeue", 1, 2)
    assert failed.meta.final_attempt is False
    [done] = recorder.of("complete")
    assert (done.message_id, done.meta.trigger, done.meta.attempt) == (requeued, "requeue", 2)
    assert [(e.message_id, e.meta.attempt) for e in recorder.of("start")] == [
        (requeued, 1),
        (requeued, 2),
    ]


def test_a_retry_that_finds_the_lock_held_keeps_its_spent_attempts(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, redis_client: redis.Redis
) -> None:
    def fails_first(payload: dict[str, Any], ctx: JobContext) -> None:
        if ctx.trigger == "manual":
            raise RuntimeError("the first attempt fails")

    registry = registry_of(fails_first, retries=2, backoff=Backoff("fixed", delay_ms=1_500))
    runner, enqueues = started_runner(make_runner, registry, recorder)
    original = runner.dispatch(JOB)
    # When the first attempt failed and released its lock, another run takes it
    recorder.wait_until(lambda r: len(r.of("failed")) == 1, what="attempt 1 failed")
    wait_for(
        lambda: bool(redis_client.set(lock_key(prefix), OTHER_HOLDER, nx=True, px=60_000)),
        what="the lock freed by attempt 1",
    )
    # Then the retry (attempt 2) hands off, and the new message keeps attempt 2
    wait_for(lambda: enqueues.hand_offs(original) != [], what="a hand-off of the retry")
    redis_client.delete(lock_key(prefix))
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the requeued run")

    [done] = recorder.of("complete")
    assert done.message_id != original
    assert (done.meta.trigger, done.meta.attempt, done.meta.max_attempts) == ("requeue", 2, 3)
    assert [e.meta.attempt for e in recorder.of("start")] == [1, 2]


def test_the_hand_off_is_written_by_the_ack_and_leaves_no_guard(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, redis_client: redis.Redis
) -> None:
    # Given a held lock
    redis_client.set(lock_key(prefix), OTHER_HOLDER, px=60_000)
    runner, enqueues = started_runner(
        make_runner, registry_of(noop), recorder, sequential_retry_delay_ms=2_000
    )
    # When a message hands off
    original = runner.dispatch(JOB)
    wait_for(lambda: enqueues.hand_offs(original) != [], what="a hand-off")
    # Then the hand-off waits in the delay queue, the original is gone with its ack (one
    # Lua call wrote both: a crash before it leaves the original to be redelivered, which
    # checks the lock again), and no guard key is left behind
    requeued = handoff_message_id(original)
    delayed = [
        Message.decode(body if isinstance(body, bytes) else body.encode()).message_id
        for body in redis_client.hvals(queue_messages(dq_name(f"{prefix}-worker")))
    ]
    assert delayed == [requeued]
    assert redis_client.hlen(queue_messages(f"{prefix}-worker")) == 0
    assert list(redis_client.scan_iter(match=f"kumiko:{prefix}:enqueued:*")) == []
    # And once the lock is free, the hand-off runs, once
    redis_client.delete(lock_key(prefix))
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="one run")
    assert [e.message_id for e in recorder.of("start")] == [requeued]


def test_the_hand_off_id_is_noted_for_other_middleware(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, redis_client: redis.Redis
) -> None:
    seen: list[tuple[bool, str | None]] = []
    registry = registry_of(noop)
    redis_client.set(lock_key(prefix), OTHER_HOLDER, px=60_000)
    runner = make_runner(registry, sequential_retry_delay_ms=100)

    class Peek(Middleware):
        sees_handoffs = True  # added middleware see hand-offs only when they ask to

        def after_process_message(self, broker: Broker, message: Any, **_: Any) -> None:
            execution = runner.runtime.current()
            if execution is not None:
                seen.append((execution.handed_off, execution.handoff_id))

    runner.broker.add_middleware(Peek())
    runner.start()
    original = runner.dispatch(JOB)
    wait_for(lambda: seen != [], what="a processed message")

    assert seen[0] == (True, handoff_message_id(original))


def test_waiting_messages_re_check_the_lock_at_most_once_per_delay(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, redis_client: redis.Redis
) -> None:
    delay_ms = 200
    redis_client.set(lock_key(prefix), OTHER_HOLDER, px=60_000)
    runner, enqueues = started_runner(
        make_runner, registry_of(noop), recorder, sequential_retry_delay_ms=delay_ms
    )
    began = time.monotonic()
    originals = [runner.dispatch(JOB, {"i": i}) for i in range(5)]
    wait_for(
        lambda: all(len(enqueues.hand_offs(m)) >= 2 for m in originals),
        what="every waiter handed off twice",
    )
    wait_for(lambda: time.monotonic() - began > 1.5, what="a while of waiting")
    counts = [len(enqueues.hand_offs(m)) for m in originals]
    elapsed_ms = (time.monotonic() - began) * 1000
    redis_client.delete(lock_key(prefix))
    recorder.wait_until(lambda r: len(r.of("complete")) == 5, what="five runs")

    # Each hand-off waits at least delay_ms before it checks again
    assert all(count <= elapsed_ms / delay_ms + 1 for count in counts), counts


# -- Redis failures ---------------------------------------------------------------
@pytest.fixture
def lockless_user(redis_client: redis.Redis, prefix: str) -> Iterator[str]:
    """A Redis user that may touch every key of the test except its locks (and their index,
    ``kumiko:{prefix}:locks``).

    Request it before ``make_runner``, so the runner stops before the user goes.
    """
    user = f"kumiko-test-{prefix}"
    redis_client.acl_setuser(
        user,
        enabled=True,
        passwords=["+pw"],
        categories=["+@all"],
        channels=["*"],
        keys=["dramatiq", "dramatiq:*", f"kumiko:{prefix}:[^l]*"],
        reset=True,
    )
    yield user
    redis_client.acl_deluser(user)


def url_of(user: str, redis_url: str) -> str:
    scheme, _, rest = redis_url.partition("://")
    return f"{scheme}://{user}:pw@{rest}"


def test_a_redis_error_while_taking_the_lock_fails_the_attempt_without_running_it(
    lockless_user: str,
    make_runner: RunnerFactory,
    recorder: Recorder,
    prefix: str,
    redis_url: str,
    redis_client: redis.Redis,
) -> None:
    ran: list[int] = []

    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        ran.append(ctx.attempt)

    def on_job_failed(name: str, message_id: str, meta: JobMeta, exc: BaseException) -> None:
        # Redis "recovers" before the retry runs
        redis_client.acl_setuser(lockless_user, enabled=True, keys=[f"kumiko:{prefix}:lock*"])
        recorder.on_job_failed(name, message_id, meta, exc)

    runner = make_runner(
        registry_of(work, retries=1),
        redis_url=url_of(lockless_user, redis_url),
        on_job_start=recorder.on_job_start,
        on_job_complete=recorder.on_job_complete,
        on_job_failed=on_job_failed,
    )
    runner.start()
    original = runner.dispatch(JOB)
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the retried run")

    [failed] = recorder.of("failed")
    assert isinstance(failed.exc, SequentialLockError)
    assert JOB in str(failed.exc)
    assert (failed.message_id, failed.meta.attempt) == (original, 1)
    [done] = recorder.of("complete")
    assert (done.message_id, done.meta.attempt) == (original, 2)
    assert ran == [2]


def test_a_hand_off_redis_refuses_to_write_loses_nothing(
    make_runner: RunnerFactory,
    recorder: Recorder,
    prefix: str,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a delay queue Redis refuses to write to, and a held lock
    delayed_messages = queue_messages(dq_name(f"{prefix}-worker"))
    redis_client.set(delayed_messages, "not a hash")
    redis_client.set(lock_key(prefix), OTHER_HOLDER, px=60_000)
    first = make_runner(registry_of(noop), sequential_retry_delay_ms=100, heartbeat_timeout_ms=500)
    first.start()
    original = first.dispatch(JOB)
    # When its hand-off cannot be written, its settle fails as a whole (the hand-off is
    # written first, so nothing is): the message stays this worker's, unsettled
    wait_for(
        lambda: any("Redis fails" in r.getMessage() for r in caplog.records),
        what="the failed settle",
    )
    first.stop()
    assert redis_client.hlen(queue_messages(f"{prefix}-worker")) == 1
    # Then, Redis repaired and the lock free, the next worker recovers the message from the
    # dead one and runs it, on its first attempt
    redis_client.delete(delayed_messages, lock_key(prefix))
    second = make_runner(registry_of(noop), heartbeat_timeout_ms=500, **recorder.hooks())
    second.start()
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the recovered run")
    [done] = recorder.of("complete")
    assert (done.message_id, done.meta.attempt) == (original, 1)


# -- the lease ------------------------------------------------------------------
def test_a_run_longer_than_the_lock_ttl_keeps_its_lock(
    make_runner: RunnerFactory,
    recorder: Recorder,
    prefix: str,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A TTL renewed every 200 ms; the run below lasts over three TTLs
    monkeypatch.setenv("KUMIKO_LOCK_TTL_MS", "600")
    release = threading.Event()
    spans: dict[str, tuple[float, float]] = {}

    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        start = time.monotonic()
        if payload["name"] == "long":
            release.wait(timeout=30)
        spans[payload["name"]] = (start, time.monotonic())

    runner, enqueues = started_runner(make_runner, registry_of(work), recorder)
    runner.dispatch(JOB, {"name": "long"})
    recorder.wait_until(lambda r: len(r.of("start")) == 1, what="the long run")
    began = time.monotonic()
    token = redis_client.get(lock_key(prefix))
    waiting = runner.dispatch(JOB, {"name": "short"})

    # When the long run lasts several TTLs
    wait_for(lambda: time.monotonic() - began > 2.0, what="over three lock TTLs")
    wait_for(lambda: len(enqueues.hand_offs(waiting)) >= 2, what="the waiter handed off")
    # Then the lock is still the long run's, and the waiter never started
    assert token is not None
    assert redis_client.get(lock_key(prefix)) == token
    assert len(recorder.of("start")) == 1

    release.set()
    recorder.wait_until(lambda r: len(r.of("complete")) == 2, what="both runs")
    assert spans["long"][1] <= spans["short"][0]


def test_a_run_ended_by_timeout_ms_releases_the_lock(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, redis_client: redis.Redis
) -> None:
    def stalls(payload: dict[str, Any], ctx: JobContext) -> None:
        deadline = time.monotonic() + 30
        while payload.get("stall") and time.monotonic() < deadline:
            time.sleep(0.02)

    runner, _ = started_runner(make_runner, registry_of(stalls, timeout_ms=300), recorder)
    runner.dispatch(JOB, {"stall": True})
    recorder.wait_until(lambda r: len(r.of("failed")) == 1, what="the time limit")
    assert isinstance(recorder.of("failed")[0].exc, TimeLimitExceeded)
    # Released at once, far sooner than the 30 s TTL would free it
    wait_for(lambda: not redis_client.exists(lock_key(prefix)), timeout_s=10, what="release")

    runner.dispatch(JOB, {"stall": False})
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the next run")
    assert recorder.of("complete")[0].meta.trigger == "manual"


def test_a_plain_parallel_job_takes_no_lock(
    make_runner: RunnerFactory, recorder: Recorder, prefix: str, redis_client: redis.Redis
) -> None:
    feature = Feature("seq")
    seen_keys: list[list[bytes]] = []

    @feature.job("work")
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        seen_keys.append(list(redis_client.scan_iter(match=f"kumiko:{prefix}:lock:*")))

    runner, enqueues = started_runner(make_runner, Registry([feature]), recorder)
    original = runner.dispatch(JOB)
    recorder.wait_until(lambda r: len(r.of("complete")) == 1, what="the run")
    assert seen_keys == [[]]
    assert enqueues.hand_offs(original) == []


# -- a worker killed with SIGKILL --------------------------------------------
def _events(client: redis.Redis, prefix: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(sequential_app.events_key(prefix), 0, -1)]


def _spawn_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "1"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_a_lock_held_by_a_killed_worker_expires_and_another_worker_runs_the_job(
    make_runner: RunnerFactory,
    prefix: str,
    redis_url: str,
    redis_client: redis.Redis,
    workers: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    env = {
        **os.environ,
        "KUMIKO_APP": "tests.apps.sequential_app:registry",
        "KUMIKO_REDIS_URL": redis_url,
        "KUMIKO_QUEUE_PREFIX": prefix,
        "KUMIKO_LOCK_TTL_MS": "3000",
        "PYTHONPATH": str(ROOT),
    }
    lock = keys.sequential_lock(prefix, sequential_app.JOB, None)
    producer = make_runner(sequential_app.registry)

    # Given a worker process that runs the job and holds its lock
    workers.append(_spawn_worker(env, tmp_path / "first.log"))
    producer.dispatch(sequential_app.JOB, {"name": "held", "hold": True})
    wait_for(lambda: _events(redis_client, prefix) != [], what="the held run to start")
    holder_pid = _events(redis_client, prefix)[0]["pid"]
    assert redis_client.exists(lock)

    # When that worker is killed with SIGKILL
    os.killpg(workers[0].pid, signal.SIGKILL)
    workers[0].wait(timeout=10)
    assert redis_client.exists(lock), "the dead worker's lease outlives it until its TTL"
    redis_client.set(sequential_app.release_key(prefix), 1)

    # Then another worker runs the job once the lease expired
    producer.dispatch(sequential_app.JOB, {"name": "next"})
    workers.append(_spawn_worker(env, tmp_path / "second.log"))
    wait_for(
        lambda: any(
            e["name"] == "next" and e["event"] == "end" for e in _events(redis_client, prefix)
        ),
        timeout_s=30,
        what="the next run in the second worker",
    )
    nexts = [e for e in _events(redis_client, prefix) if e["name"] == "next"]
    assert [e["event"] for e in nexts] == ["start", "end"]
    assert nexts[0]["pid"] != holder_pid
    wait_for(lambda: not redis_client.exists(lock), what="the second worker's release")
