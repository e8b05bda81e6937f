"""Held messages: a worker claims its threads' next messages ahead (run-ahead), and a held
message is not running anywhere; cancel, purge, pause and stop_run ask its worker about it,
and a worker that cannot answer (frozen, killed) can never start it afterwards.

Real Redis, real workers: in-process runners whose handlers block on events, and CLI workers
(``tests/apps/hold_app.py``) that the tests freeze (SIGSTOP) and kill (SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kumiko_dramatiq import Feature, JobContext, JobRunner, Registry
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.replies import text
from tests.apps import hold_app
from tests.conftest import Recorder, RunnerFactory, wait_for

JOB = "holds:job:work"
ROOT = Path(__file__).resolve().parents[2]


class Gate:
    """Handlers that block until released, and the order they started in."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.release = threading.Event()
        self._cond = threading.Condition()

    def run(self, n: int) -> None:
        with self._cond:
            self.started.append(n)
            self._cond.notify_all()
        self.release.wait(30)

    def wait_started(self, count: int) -> None:
        deadline = time.monotonic() + 20
        with self._cond:
            while len(self.started) < count:
                left = deadline - time.monotonic()
                assert left > 0, f"only {self.started} started"
                self._cond.wait(left)


def _registry(gate: Gate, **options: Any) -> Registry:
    feature = Feature("holds")

    @feature.job("work", **options)
    def work(payload: dict[str, Any], ctx: JobContext) -> None:
        gate.run(int(payload["n"]))

    return Registry([feature])


def _entries(client: redis.Redis, prefix: str) -> dict[str, str]:
    return {text(k): text(v) for k, v in client.hgetall(keys.inflight(prefix)).items()}


def _held(client: redis.Redis, prefix: str) -> list[str]:
    return [rid for rid, entry in _entries(client, prefix).items() if entry.startswith("h")]


@pytest.fixture
def busy(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> Iterator[tuple[JobRunner, Gate, list[str]]]:
    """A runner of 2 threads whose 2 first jobs block, 6 dispatched: 2 run, 2 are held."""
    gate = Gate()
    runner = make_runner(_registry(gate), worker_threads=2)
    ids = [runner.dispatch(JOB, {"n": n}) for n in range(6)]
    runner.start()
    gate.wait_started(2)
    wait_for(lambda: len(_held(redis_client, prefix)) == 2, what="two held messages")
    yield runner, gate, ids
    gate.release.set()


def test_a_held_message_is_queued_not_running_anywhere(
    busy: tuple[JobRunner, Gate, list[str]],
) -> None:
    runner, gate, ids = busy
    # Given 2 threads running and 2 messages held ahead of them
    assert sorted(gate.started) == [0, 1]
    # Then only the 2 that started are running: in busy, the counts and the status
    assert sorted(run.message_id for run in runner.running()) == sorted(ids[:2])
    counts = runner.job_counts()[JOB]
    assert (counts["running"], counts["queued"]) == (2, 4)
    lane = runner.status().lanes[0]
    assert (lane.running, lane.queued) == (2, 4)


def test_a_thread_that_ends_a_job_starts_the_one_held_for_it(
    busy: tuple[JobRunner, Gate, list[str]],
) -> None:
    runner, gate, _ = busy
    # When the blocked jobs end
    gate.release.set()
    runs = runner.drain(timeout_s=20)
    # Then every message ran once, in order of dispatch per the two threads
    assert sorted(gate.started) == list(range(6))
    assert len(gate.started) == 6
    assert sorted(run.status for run in runs) == ["completed"] * 6


def test_cancel_of_a_held_message_is_confirmed_by_its_worker_and_it_never_starts(
    busy: tuple[JobRunner, Gate, list[str]], redis_client: redis.Redis, prefix: str
) -> None:
    runner, gate, ids = busy
    held_ids = list(ids[2:4])
    # When a held message is cancelled
    assert runner.cancel(held_ids[0]) is True
    # Then it is no longer held, and a second cancel finds it ended
    assert len(_held(redis_client, prefix)) <= 1
    assert runner.cancel(held_ids[0]) is False
    # and once the threads are free it never starts; its record says cancelled
    gate.release.set()
    runner.drain(timeout_s=20)
    assert 2 not in gate.started
    assert sorted(gate.started) == [0, 1, 3, 4, 5]
    assert [run.status for run in runner.run_record(held_ids[0])] == ["cancelled"]


def test_cancel_of_a_running_message_is_false(
    busy: tuple[JobRunner, Gate, list[str]],
) -> None:
    runner, _, ids = busy
    assert runner.cancel(ids[0]) is False


def test_stop_run_of_a_held_message_is_false_and_it_still_runs(
    busy: tuple[JobRunner, Gate, list[str]],
) -> None:
    runner, gate, ids = busy
    assert runner.stop_run(ids[2]) is False
    gate.release.set()
    runner.drain(timeout_s=20)
    assert [run.status for run in runner.run_record(ids[2])] == ["completed"]


def test_purge_removes_the_held_messages_too(
    busy: tuple[JobRunner, Gate, list[str]], redis_client: redis.Redis, prefix: str
) -> None:
    runner, gate, _ = busy
    # a dry run counts the held ones with the queued ones
    assert runner.purge(JOB, dry_run=True) == 4
    assert runner.purge(JOB) == 4
    assert _held(redis_client, prefix) == []
    gate.release.set()
    runner.drain(timeout_s=20)
    assert sorted(gate.started) == [0, 1]


def test_pause_puts_the_held_messages_back_unstarted(
    busy: tuple[JobRunner, Gate, list[str]], redis_client: redis.Redis, prefix: str
) -> None:
    runner, gate, _ = busy
    # When the job is paused while two of its messages are held
    runner.pause(JOB)
    assert _held(redis_client, prefix) == []
    # Then none of them starts while it is paused, however free the threads are
    gate.release.set()
    wait_for(lambda: runner.job_counts()[JOB]["parked"] == 4, what="four parked messages")
    assert sorted(gate.started) == [0, 1]
    # and all run once it is resumed
    runner.resume(JOB)
    runner.drain(timeout_s=20)
    assert sorted(gate.started) == list(range(6))


def test_a_held_message_of_a_capped_job_is_never_claimed_ahead(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given a job of at most 4 at once on 2 threads: a held message would take a slot
    gate = Gate()
    runner = make_runner(_registry(gate, max_running=4), worker_threads=2)
    for n in range(6):
        runner.dispatch(JOB, {"n": n})
    runner.start()
    gate.wait_started(2)
    # Then its worker holds none ahead: they wait in Redis, and 2 slots are taken, not 4
    assert _held(redis_client, prefix) == []
    slots = redis_client.zcard(keys.cap_slots(prefix, JOB))
    assert slots == 2
    gate.release.set()
    runner.drain(timeout_s=20)
    assert sorted(gate.started) == list(range(6))


# -- holders that cannot answer: CLI workers, frozen and killed ------------------------------
def _worker_env(redis_url: str, prefix: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT),
        KUMIKO_APP="tests.apps.hold_app:registry",
        KUMIKO_REDIS_URL=redis_url,
        KUMIKO_QUEUE_PREFIX=prefix,
        KUMIKO_HEARTBEAT_TIMEOUT_MS="1000",
        KUMIKO_MAINTENANCE_CHANCE="1000000",
    )
    return env


def _cli_worker(redis_url: str, prefix: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "1"]
    return subprocess.Popen(
        command, cwd=ROOT, env=_worker_env(redis_url, prefix), start_new_session=True
    )


def _started(client: redis.Redis, prefix: str) -> list[str]:
    return [text(m) for m in client.lrange(f"kumiko:{prefix}:test:started", 0, -1)]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["frozen", "killed"])
def test_cancel_answers_when_the_holder_cannot_and_the_message_never_starts(
    fault: str, redis_url: str, redis_client: redis.Redis, prefix: str
) -> None:
    producer = JobRunner(hold_app.registry, redis_url=redis_url, queue_prefix=prefix)
    first = producer.dispatch("hold:job:work", {"block": True})
    held = producer.dispatch("hold:job:work")
    last = producer.dispatch("hold:job:work")
    worker = _cli_worker(redis_url, prefix)
    second: subprocess.Popen[bytes] | None = None
    try:
        # Given a worker of one thread that runs the first message and holds the second
        wait_for(lambda: _started(redis_client, prefix) == [first], what="the first run")
        wait_for(lambda: len(_held(redis_client, prefix)) == 1, what="a held message")
        # When it freezes (or dies) and the held message is cancelled
        os.killpg(worker.pid, signal.SIGSTOP if fault == "frozen" else signal.SIGKILL)
        began = time.monotonic()
        assert producer.cancel(held) is True
        took = time.monotonic() - began
        if fault == "frozen":
            os.killpg(worker.pid, signal.SIGCONT)
        else:
            worker.wait()
            second = _cli_worker(redis_url, prefix)
        redis_client.set(f"kumiko:{prefix}:test:release", 1)
        # Then the rest runs, but the cancelled message never starts
        wait_for(lambda: last in _started(redis_client, prefix), 60, "the last message")
        assert held not in _started(redis_client, prefix)
        assert [run.status for run in producer.run_record(held)] == ["cancelled"]
        # (within the bound the contract gives, with room for a loaded machine)
        assert took < 5.0
    finally:
        for each in (worker, second):
            if each is not None and each.poll() is None:
                os.killpg(each.pid, signal.SIGCONT)
                os.killpg(each.pid, signal.SIGTERM)
                each.wait(timeout=30)
        producer.stop()


@pytest.mark.slow
def test_a_killed_workers_held_message_is_redelivered_like_a_queued_one(
    redis_url: str, redis_client: redis.Redis, prefix: str
) -> None:
    producer = JobRunner(hold_app.registry, redis_url=redis_url, queue_prefix=prefix)
    first = producer.dispatch("hold:job:work", {"block": True})
    held = producer.dispatch("hold:job:work")
    worker = _cli_worker(redis_url, prefix)
    try:
        wait_for(lambda: _started(redis_client, prefix) == [first], what="the first run")
        wait_for(lambda: len(_held(redis_client, prefix)) == 1, what="a held message")
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        redis_client.set(f"kumiko:{prefix}:test:release", 1)
        # When another worker takes over
        worker = _cli_worker(redis_url, prefix)
        wait_for(
            lambda: [r.status for r in producer.run_record(held)] == ["completed"],
            60,
            "the held message to complete",
        )
        # Then the held message ran once, and the one cut short by the kill ran again
        started = _started(redis_client, prefix)
        assert started.count(held) == 1
        assert started.count(first) == 2
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=30)
        producer.stop()


def test_the_worker_reports_the_start_of_a_held_message_in_its_next_call(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    # Given one thread, a message running and one held
    gate = Gate()
    recorder = Recorder()
    runner = make_runner(_registry(gate), worker_threads=1, on_job_start=recorder.on_job_start)
    ids = [runner.dispatch(JOB, {"n": n}) for n in range(3)]
    runner.start()
    gate.wait_started(1)
    wait_for(lambda: len(_held(redis_client, prefix)) == 1, what="a held message")
    # When the first ends, the held one starts and shows as running once reported
    gate.release.set()
    runner.drain(timeout_s=20)
    assert gate.started == [0, 1, 2]
    assert [e.message_id for e in recorder.events if e.kind == "start"] == ids
    assert _entries(redis_client, prefix) == {}
