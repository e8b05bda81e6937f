"""Fencing: a sequential run whose worker is cut off from Redis stops before its lease can
expire, so no other run overlaps it, and comes back later without spending an attempt.

The cut is real: the worker under test reaches Redis through a TCP proxy
(:class:`tests.partition.TcpProxy`) that black-holes its traffic, as a network cut without
resets does; every other runner talks to Redis directly. Every run notes its start and end
(monotonic time, one process) in a ledger.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import redis

from kumiko_dramatiq import Feature, JobContext, JobMeta, JobRunner, Registry
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.ids import handoff_message_id
from kumiko_dramatiq.worker.fencing import FENCE_EXIT_STATUS, Fence, LeaseLost
from tests.apps import fence_app
from tests.conftest import Recorder, RunnerFactory, wait_for
from tests.partition import TcpProxy

JOB = "fence:job:hold"
ROOT = Path(__file__).resolve().parents[2]
LOCK_TTL_MS = 2_000


@dataclass
class Run:
    runner: str
    message_id: str
    attempt: int
    started: float
    ended: float | None = None
    error: str | None = None


@dataclass
class Ledger:
    """Every run of the job: who ran it, when it started and ended (monotonic), and how."""

    runs: list[Run] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def start(self, runner: str, ctx: JobContext) -> Run:
        run = Run(runner, ctx.message_id, ctx.attempt, time.monotonic())
        with self.cond:
            self.runs.append(run)
            self.cond.notify_all()
        return run

    def end(self, run: Run, error: BaseException | None) -> None:
        with self.cond:
            run.ended = time.monotonic()
            run.error = None if error is None else type(error).__name__
            self.cond.notify_all()

    def wait(self, what: str, predicate: Any, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not predicate(self.runs):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out waiting for {what}: {self.runs}")
                self.cond.wait(remaining)


def registry_of(ledger: Ledger, name: str, release: threading.Event, *, async_: bool) -> Registry:
    """The job: a run whose payload says ``hold`` runs (in Python code, interruptible) until
    ``release`` is set; each run notes itself in ``ledger`` under ``name``."""
    feature = Feature("fence")
    if async_:

        async def hold_async(payload: dict[str, Any], ctx: JobContext) -> None:
            run = ledger.start(name, ctx)
            error: BaseException | None = None
            try:
                while payload.get("hold") and not release.is_set():
                    await asyncio.sleep(0.01)
            except BaseException as exc:
                error = exc
                raise
            finally:
                ledger.end(run, error)

        feature.job("hold", concurrency="sequential")(hold_async)
    else:

        def hold(payload: dict[str, Any], ctx: JobContext) -> None:
            run = ledger.start(name, ctx)
            error: BaseException | None = None
            try:
                while payload.get("hold") and not release.is_set():
                    time.sleep(0.01)
            except BaseException as exc:
                error = exc
                raise
            finally:
                ledger.end(run, error)

        feature.job("hold", concurrency="sequential")(hold)
    return Registry([feature])


@pytest.fixture
def proxy(redis_url: str) -> Iterator[TcpProxy]:
    """A proxy to the test Redis (request it before ``make_runner``: it outlives the runners)."""
    with TcpProxy(urlparse(redis_url).port or 6379) as started:
        yield started


def through(proxy: TcpProxy, redis_url: str) -> str:
    return proxy.url(int(urlparse(redis_url).path.strip("/") or 0))


def no_process_ending(runner: JobRunner) -> list[str]:
    """Make the runner's fence record instead of ending this (the test's) process."""
    ended: list[str] = []
    runner.runtime.fence = Fence(runner.queue_prefix, end_process=ended.append)
    return ended


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_run_cut_off_from_redis_stops_before_its_lease_expires_and_no_run_overlaps_it(
    async_: bool,
    proxy: TcpProxy,
    make_runner: RunnerFactory,
    redis_url: str,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given worker A, behind the proxy, running the sequential job and holding its lease
    ledger, release, recorder = Ledger(), threading.Event(), Recorder()
    a = make_runner(
        registry_of(ledger, "a", release, async_=async_),
        redis_url=through(proxy, redis_url),
        lock_ttl_ms=LOCK_TTL_MS,
        boot_redis_timeout_ms=500,
        **recorder.hooks(),
    )
    ended = no_process_ending(a)
    a.start()
    held = a.dispatch(JOB, {"hold": True})
    ledger.wait("A's run", lambda runs: any(r.runner == "a" for r in runs))
    lock = keys.sequential_lock(prefix, JOB, None)
    assert redis_client.get(lock) is not None

    # When A is cut off from Redis, and worker B (on Redis directly) is asked for a run too
    proxy.cut()
    b = make_runner(
        registry_of(ledger, "b", release, async_=async_),
        lock_ttl_ms=LOCK_TTL_MS,
        sequential_retry_delay_ms=100,
        **recorder.hooks(),
    )
    b.start()
    b.dispatch(JOB, {"hold": False})

    # Then A's run is interrupted (LeaseLost) before its lease expired, and B's run starts
    # only after A's ended: they never overlap
    ledger.wait("B's run", lambda runs: any(r.runner == "b" and r.ended for r in runs))
    [a_run] = [r for r in ledger.runs if r.runner == "a"]
    [b_run] = [r for r in ledger.runs if r.runner == "b"]
    assert a_run.error in ("LeaseLost", "CancelledError")
    assert a_run.ended is not None
    assert a_run.ended <= b_run.started
    assert ended == []

    # And once the link is back, A's run comes back (the message goes back to its queue) and
    # runs again on its first attempt: no attempt spent, no failure hook
    release.set()
    proxy.heal()
    ledger.wait(
        "the fenced run again",
        lambda runs: any(r.message_id == held and r.ended and r.error is None for r in runs),
    )
    again = [r for r in ledger.runs if r.message_id == held]
    assert [r.attempt for r in again] == [1, 1]
    assert recorder.of("failed") == []
    assert b.dead_letters() == []
    recorder.wait_until(lambda r: held in {e.message_id for e in r.of("complete")})
    b.drain(timeout_s=30)
    assert [run.attempt for run in b.run_record(held) if run.status == "completed"] == [1]


def test_a_fenced_run_does_not_release_the_lock_it_no_longer_owns(
    proxy: TcpProxy,
    make_runner: RunnerFactory,
    redis_url: str,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    # Given worker A behind the proxy holding the lock, cut off
    ledger, release = Ledger(), threading.Event()
    a = make_runner(
        registry_of(ledger, "a", release, async_=False),
        redis_url=through(proxy, redis_url),
        lock_ttl_ms=LOCK_TTL_MS,
        boot_redis_timeout_ms=500,
    )
    no_process_ending(a)
    a.start()
    a.dispatch(JOB, {"hold": True})
    ledger.wait("A's run", lambda runs: bool(runs))
    proxy.cut()
    ledger.wait("A's run interrupted", lambda runs: runs[0].ended is not None)
    # When another owner takes the lock once A's lease expired, and A's link comes back
    lock = keys.sequential_lock(prefix, JOB, None)
    wait_for(lambda: redis_client.set(lock, "another-run:0000", nx=True, px=60_000) is True)
    proxy.heal()
    # Then A's message goes back to its queue, finds the lock held and hands off: A never
    # deleted the other owner's lock
    wait_for(
        lambda: (
            redis_client.llen(keys.queue_list(f"{prefix}-worker")) == 0
            and redis_client.get(lock) == b"another-run:0000"
            and len(a.runs()) == 0
            and a.status().lanes[0].delayed >= 1
        ),
        what="A's message back and handed off",
    )
    assert redis_client.get(lock) == b"another-run:0000"
    release.set()


# -- a handler inside a C call ends its worker process ------------------------------------
def _events(client: redis.Redis, prefix: str) -> list[dict[str, Any]]:
    key = fence_app.events_key(prefix)
    return [json.loads(raw) for raw in client.lrange(key, 0, -1)]


def _ended(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (it ran its last instruction)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone (reaped while it was read: ESRCH)
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


@pytest.mark.slow
def test_a_handler_in_a_blocking_c_call_ends_its_worker_process_before_its_lease_expires(
    proxy: TcpProxy,
    redis_url: str,
    redis_client: redis.Redis,
    prefix: str,
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(ROOT),
        KUMIKO_APP="tests.apps.fence_app:runner",
        KUMIKO_REDIS_URL=through(proxy, redis_url),
        KUMIKO_QUEUE_PREFIX=prefix,
        FENCE_EVENTS_URL=redis_url,
    )
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "1"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # Given a CLI worker whose sequential run sits in time.sleep (a C call)
        with JobRunner(fence_app.runner.registry, redis_url=redis_url, queue_prefix=prefix) as p:
            p.dispatch(fence_app.JOB)
        wait_for(lambda: _events(redis_client, prefix) != [], what="the stuck run to start")
        lock = keys.sequential_lock(prefix, fence_app.JOB, None)
        assert redis_client.get(lock) is not None

        # When its worker is cut off from Redis
        proxy.cut()

        # Then the worker process ends (the run could not be interrupted) while the lock it
        # held has not expired yet: no other run could have started beside it. (The lock is
        # read the moment that process is gone, not once Dramatiq's main process noticed.)
        [event] = _events(redis_client, prefix)
        wait_for(lambda: _ended(event["pid"]), timeout_s=60, what="the worker process to end")
        remaining_ms = redis_client.pttl(lock)
        worker.wait(timeout=60)
        text = log.read_text(errors="replace")
        assert worker.returncode == FENCE_EXIT_STATUS, text[-3000:]
        assert remaining_ms > 0, text[-3000:]
        [line] = [
            line
            for line in text.splitlines()
            if "CRITICAL" in line and "ending this worker" in line
        ]
        assert fence_app.JOB in line
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def test_lease_lost_is_not_an_exception_a_handler_catches_by_accident() -> None:
    assert not issubclass(LeaseLost, Exception)


def test_a_fenced_run_calls_on_job_start_but_no_other_hook(
    proxy: TcpProxy, make_runner: RunnerFactory, redis_url: str
) -> None:
    ledger, release = Ledger(), threading.Event()
    calls: list[tuple[str, str, int]] = []

    def note(kind: str) -> Any:
        def hook(job: str, message_id: str, meta: JobMeta, *exc: BaseException) -> None:
            calls.append((kind, message_id, meta.attempt))

        return hook

    a = make_runner(
        registry_of(ledger, "a", release, async_=False),
        redis_url=through(proxy, redis_url),
        lock_ttl_ms=LOCK_TTL_MS,
        boot_redis_timeout_ms=500,
        on_job_start=note("start"),
        on_job_complete=note("complete"),
        on_job_failed=note("failed"),
    )
    no_process_ending(a)
    a.start()
    held = a.dispatch(JOB, {"hold": True})
    ledger.wait("A's run", lambda runs: bool(runs))
    proxy.cut()
    ledger.wait("A's run interrupted", lambda runs: runs[0].ended is not None)
    assert calls == [("start", held, 1)]
    release.set()
    proxy.heal()
    ledger.wait("the run again", lambda runs: len(runs) == 2 and runs[1].ended is not None)
    # The message comes back under its id (no attempt spent) as soon as Redis answers; when
    # that is before the lease it could not renew has expired, it finds the lock held and
    # hands off (no attempt spent either), and the hand-off runs: the completion hook names
    # the id that ran
    wait_for(lambda: any(kind == "complete" for kind, _, _ in calls), what="the completion hook")
    ran = [message_id for kind, message_id, _ in calls if kind == "start"][1]
    assert calls == [("start", held, 1), ("start", ran, 1), ("complete", ran, 1)]
    assert ran in (held, *handoff_chain(held, 5))


def handoff_chain(message_id: str, length: int) -> list[str]:
    """The ids of ``length`` successive hand-offs from ``message_id``."""
    chain = []
    for _ in range(length):
        message_id = handoff_message_id(message_id)
        chain.append(message_id)
    return chain
