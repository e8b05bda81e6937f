"""Retries with delay on the dispatch and event paths, on the same message id."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from dramatiq.broker import Broker
from dramatiq.message import Message
from dramatiq.middleware import Middleware

from kumiko_dramatiq import (
    Backoff,
    Event,
    Feature,
    JobContext,
    Registry,
    build_message_options,
)
from tests.conftest import Recorder, RunnerFactory


class EnqueueLog(Middleware):
    """Records every (message, delay) the broker enqueues."""

    def __init__(self) -> None:
        self.entries: list[tuple[Message[Any], int | None]] = []
        self._lock = threading.Lock()

    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int | None) -> None:
        with self._lock:
            self.entries.append((message, delay))

    def retries_of(self, message_id: str) -> list[tuple[Message[Any], int | None]]:
        with self._lock:
            return [
                (m, d)
                for m, d in self.entries
                if m.message_id == message_id and m.options.get("kumiko_failures")
            ]


def always_fails(payload: dict[str, Any], ctx: JobContext) -> None:
    raise RuntimeError(f"attempt {ctx.attempt} fails")


def registry_with(**options: Any) -> Registry:
    feature = Feature("billing")
    feature.job("send", **options)(always_fails)
    return Registry([feature])


def failed_attempts(recorder: Recorder, message_id: str) -> list[int]:
    return [e.meta.attempt for e in recorder.of("failed") if e.message_id == message_id]


@pytest.mark.parametrize("path", ["dispatch", "event"])
def test_a_failing_job_is_retried_on_the_same_id_with_exponential_delays(
    path: str, make_runner: RunnerFactory, recorder: Recorder
) -> None:
    registry = registry_with(
        trigger=Event("invoice.due"), retries=3, backoff=Backoff("exponential", delay_ms=50)
    )
    runner = make_runner(registry, **recorder.hooks())
    log = EnqueueLog()
    runner.broker.add_middleware(log)
    runner.start()

    if path == "dispatch":
        message_id = runner.dispatch("billing:job:send", {"n": 1})
    else:
        [message_id] = runner.handle_event("invoice.due", {"n": 1})

    recorder.wait_until(lambda r: len(failed_attempts(r, message_id)) == 4, what="4 attempts")
    assert failed_attempts(recorder, message_id) == [1, 2, 3, 4]
    assert {e.message_id for e in recorder.of("start")} == {message_id}
    finals = [e.meta.final_attempt for e in recorder.of("failed")]
    assert finals == [False, False, False, True]
    assert all(e.meta.max_attempts == 4 for e in recorder.of("failed"))
    assert [d for _, d in log.retries_of(message_id) if d is not None] == [50, 100, 200]
    trigger = "manual" if path == "dispatch" else "event"
    assert {e.meta.trigger for e in recorder.of("start")} == {trigger}


def test_fixed_backoff_waits_the_same_delay_before_each_retry(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    runner = make_runner(
        registry_with(retries=2, backoff=Backoff("fixed", delay_ms=120)), **recorder.hooks()
    )
    log = EnqueueLog()
    runner.broker.add_middleware(log)
    runner.start()
    message_id = runner.dispatch("billing:job:send")
    recorder.wait_until(lambda r: len(failed_attempts(r, message_id)) == 3)
    assert [d for _, d in log.retries_of(message_id) if d is not None] == [120, 120]


def test_every_enqueued_message_carries_the_jobs_message_options(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    registry = registry_with(trigger=Event("invoice.due"), retries=1, backoff="fixed")
    runner = make_runner(registry, **recorder.hooks())
    log = EnqueueLog()
    runner.broker.add_middleware(log)
    runner.start()
    first = runner.dispatch("billing:job:send")
    [second] = runner.handle_event("invoice.due")
    recorder.wait_until(lambda r: len(r.of("failed")) == 4)

    expected = build_message_options(registry.jobs["billing:job:send"]).items()
    assert {m.message_id for m, _ in log.entries} == {first, second}
    assert all(expected <= m.options.items() for m, _ in log.entries)


def test_without_backoff_a_retry_goes_straight_back_onto_the_queue(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    runner = make_runner(registry_with(retries=2), **recorder.hooks())
    log = EnqueueLog()
    runner.broker.add_middleware(log)
    runner.start()
    message_id = runner.dispatch("billing:job:send")
    recorder.wait_until(lambda r: len(failed_attempts(r, message_id)) == 3)
    retries = log.retries_of(message_id)
    assert [d for _, d in retries] == [None, None]
    assert all(not m.queue_name.endswith(".DQ") for m, _ in retries)


def test_a_job_that_fails_then_succeeds_completes_on_its_retry(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    feature = Feature("billing")

    @feature.job("flaky", retries=2, backoff=Backoff("fixed", delay_ms=10))
    def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")

    runner = make_runner(Registry([feature]), **recorder.hooks())
    runner.start()
    message_id = runner.dispatch("billing:job:flaky")
    recorder.wait_until(lambda r: bool(r.of("complete")))
    [done] = recorder.of("complete")
    assert (done.message_id, done.meta.attempt, done.meta.final_attempt) == (message_id, 2, False)
    [failed] = recorder.of("failed")
    assert failed.meta.final_attempt is False


def test_a_final_failure_is_dead_lettered(
    make_runner: RunnerFactory, recorder: Recorder, redis_client: Any, prefix: str
) -> None:
    runner = make_runner(registry_with(retries=0), **recorder.hooks())
    runner.start()
    runner.dispatch("billing:job:send")
    recorder.wait_until(lambda r: bool(r.of("failed")))
    [failed] = recorder.of("failed")
    assert failed.meta.final_attempt is True
    from tests.conftest import wait_for

    wait_for(lambda: redis_client.zcard(f"dramatiq:{prefix}-worker.XQ") == 1, what="dead letter")


def test_a_timeout_counts_as_a_failed_attempt_and_is_retried(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    release = threading.Event()
    feature = Feature("reports")

    @feature.job("render", timeout_ms=200, retries=1)
    def render(payload: dict[str, Any], ctx: JobContext) -> None:
        # Python code that keeps running until the time limit interrupts it.
        while not release.wait(0.01):
            pass

    runner = make_runner(Registry([feature]), **recorder.hooks())
    runner.start()
    try:
        message_id = runner.dispatch("reports:job:render")
        recorder.wait_until(lambda r: len(r.of("failed")) == 2, timeout_s=30)
    finally:
        release.set()
    failures = recorder.of("failed")
    assert [e.message_id for e in failures] == [message_id, message_id]
    assert [type(e.exc).__name__ for e in failures] == ["TimeLimitExceeded"] * 2
    assert [e.meta.final_attempt for e in failures] == [False, True]


def test_an_async_handler_runs_and_its_failures_are_retried(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    feature = Feature("mail")
    seen: list[tuple[str | None, int]] = []

    @feature.job("send", retries=1)
    async def send(payload: dict[str, Any], ctx: JobContext) -> None:
        import asyncio

        await asyncio.sleep(0.01)
        seen.append((payload.get("to"), ctx.attempt))
        if ctx.attempt == 1:
            raise ConnectionError("smtp down")

    runner = make_runner(Registry([feature]), **recorder.hooks())
    runner.start()
    message_id = runner.dispatch("mail:job:send", {"to": "ada@example.com"})
    recorder.wait_until(lambda r: bool(r.of("complete")))
    assert seen == [("ada@example.com", 1), ("ada@example.com", 2)]
    assert [e.message_id for e in recorder.of("complete")] == [message_id]


@pytest.mark.slow
def test_a_worker_killed_before_acking_a_failed_attempt_neither_loses_nor_forks_the_retry(
    redis_url: str, prefix: str, redis_client: Any
) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import wait_for

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUMIKO_")}
    env.update(
        PYTHONPATH=str(root),
        KUMIKO_APP="tests.apps.fork_app:runner",
        KUMIKO_REDIS_URL=redis_url,
        KUMIKO_QUEUE_PREFIX=prefix,
        KUMIKO_HEARTBEAT_TIMEOUT_MS="1000",
        KUMIKO_MAINTENANCE_CHANCE="1000000",
    )
    os.environ.update(KUMIKO_REDIS_URL=redis_url, KUMIKO_QUEUE_PREFIX=prefix)
    try:
        from tests.apps.fork_app import runner
    finally:
        del os.environ["KUMIKO_REDIS_URL"], os.environ["KUMIKO_QUEUE_PREFIX"]
    runner.dispatch("fork:job:always_fails")
    command = [sys.executable, "-m", "dramatiq", "kumiko_dramatiq.app", "-p", "1", "-t", "2"]
    runs = f"kumiko:{prefix}:test:runs"
    # Given a worker that dies after attempt 2 failed and prepared attempt 3, before the ack,
    first = subprocess.Popen(command, cwd=root, env=env, stderr=subprocess.DEVNULL)
    try:
        first.wait(timeout=60)
    finally:
        first.kill()
    # when another worker takes over,
    second = subprocess.Popen(command, cwd=root, env=env, stderr=subprocess.DEVNULL)
    try:
        wait_for(
            lambda: redis_client.zcard(f"dramatiq:{prefix}-worker.XQ") >= 1,
            timeout_s=60,
            what="the final failure",
        )
        runner.broker.join(f"{prefix}-worker", timeout=30_000)
    finally:
        second.terminate()
        second.wait(timeout=30)
    runner.stop()
    # then attempt 2 runs again (a redelivery), and the chain goes on once: no fork.
    attempts = [int(a) for a in redis_client.lrange(runs, 0, -1)]
    assert attempts == [1, 2, 2, 3]
    assert redis_client.zcard(f"dramatiq:{prefix}-worker.XQ") == 1
