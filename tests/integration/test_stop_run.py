"""What runs now (``runner.running``) and stopping it (``runner.stop_run``): the request reaches
the worker, the handler is interrupted (sync as by a timeout, async cancelled), the attempt ends
``cancelled``, is not retried, and frees its lock and dedup key."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import redis

from kumiko_dramatiq import Feature, JobContext, JobRunner, NotFoundError, Registry
from kumiko_dramatiq.broker import keys
from tests.conftest import Recorder, RunnerFactory, wait_for

SYNC = "halt:job:sync"
ASYNC = "halt:job:async"
COOP = "halt:job:coop"
SEQ = "halt:job:seq"
QUICK = "halt:job:quick"


class Seen:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.stop_flags: list[bool] = []
        self.ended: list[str] = []


def registry_of(seen: Seen) -> Registry:
    feature = Feature("halt")

    @feature.job("sync", retries=3)
    def sync(payload: dict[str, Any], ctx: JobContext) -> None:
        seen.started.set()
        try:
            while True:  # Python code: an asynchronous exception lands at once
                time.sleep(0.01)
        finally:
            seen.stop_flags.append(ctx.stop_requested)

    @feature.job("async", retries=3)
    async def run_async(payload: dict[str, Any], ctx: JobContext) -> None:
        seen.started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.ended.append("cancelled")
            raise

    @feature.job("coop", retries=3)
    def coop(payload: dict[str, Any], ctx: JobContext) -> None:
        seen.started.set()
        try:
            while not ctx.stop_requested:
                time.sleep(0.01)
        except BaseException:
            seen.ended.append("interrupted")
            raise

    @feature.job("seq", retries=3, concurrency="sequential")
    def seq(payload: dict[str, Any], ctx: JobContext) -> None:
        seen.started.set()
        while True:
            time.sleep(0.01)

    @feature.job("quick")
    def quick(payload: dict[str, Any], ctx: JobContext) -> None:
        return None

    return Registry([feature])


def statuses(runner: JobRunner, message_id: str) -> list[str]:
    return [run.status for run in runner.run_record(message_id)]


def stop_and_wait(runner: JobRunner, message_id: str) -> None:
    wait_for(lambda: any(r.message_id == message_id for r in runner.running()), what="running")
    assert runner.stop_run(message_id) is True
    wait_for(lambda: statuses(runner, message_id) == ["cancelled"], what="cancelled record")


def test_running_lists_the_attempt_with_its_worker_and_start(make_runner: RunnerFactory) -> None:
    seen = Seen()
    runner = make_runner(registry_of(seen))
    runner.start()
    message_id = runner.dispatch(SYNC, {})
    assert seen.started.wait(20)
    wait_for(lambda: bool(runner.running(SYNC)), what="a running attempt")
    (run,) = runner.running(SYNC)
    assert (run.message_id, run.status, run.attempt) == (message_id, "running", 1)
    assert run.worker
    assert run.started_at is not None
    assert runner.running(QUICK) == []
    stop_and_wait(runner, message_id)


def test_a_stopped_sync_handler_ends_cancelled_and_is_not_retried(
    make_runner: RunnerFactory, recorder: Recorder
) -> None:
    seen = Seen()
    runner = make_runner(registry_of(seen), **recorder.hooks())
    runner.start()
    message_id = runner.dispatch(SYNC, {})
    assert seen.started.wait(20)
    stop_and_wait(runner, message_id)
    # then the handler saw the request, and no retry follows
    assert seen.stop_flags == [True]
    runner.drain(timeout_s=20)
    assert statuses(runner, message_id) == ["cancelled"]
    assert recorder.of("failed") == []
    assert recorder.of("complete") == []
    assert runner.dead_letters() == []
    assert runner.running() == []


def test_a_stopped_async_handler_is_cancelled(make_runner: RunnerFactory) -> None:
    seen = Seen()
    runner = make_runner(registry_of(seen))
    runner.start()
    message_id = runner.dispatch(ASYNC, {})
    assert seen.started.wait(20)
    stop_and_wait(runner, message_id)
    assert seen.ended == ["cancelled"]


def test_a_handler_that_checks_stop_requested_ends_cancelled(make_runner: RunnerFactory) -> None:
    seen = Seen()
    runner = make_runner(registry_of(seen))
    runner.start()
    message_id = runner.dispatch(COOP, {})
    assert seen.started.wait(20)
    stop_and_wait(runner, message_id)


def test_a_stopped_run_frees_its_dedup_key_and_its_lock(
    make_runner: RunnerFactory, redis_client: redis.Redis, prefix: str
) -> None:
    seen = Seen()
    runner = make_runner(registry_of(seen))
    runner.start()
    message_id = runner.dispatch(SEQ, {}, dedup_key="k1")
    assert seen.started.wait(20)
    wait_for(lambda: bool(runner.locks()), what="the lock taken")
    stop_and_wait(runner, message_id)
    wait_for(lambda: runner.locks() == [], what="the lock released")
    assert runner.dedup_keys(SEQ) == []
    # the key is free: a new dispatch with it is a new message
    assert runner.dispatch(QUICK, {}, dedup_key="k1") != message_id
    assert redis_client.exists(keys.stop_request(prefix, message_id)) == 0


def test_stop_run_of_a_message_that_does_not_run(make_runner: RunnerFactory) -> None:
    seen = Seen()
    runner = make_runner(registry_of(seen))
    waiting = runner.dispatch(QUICK, {})
    # given a queued message (no worker): known, not running
    assert runner.stop_run(waiting) is False
    with pytest.raises(NotFoundError):
        runner.stop_run("0" * 8 + "-0000-4000-8000-" + "0" * 12)
    runner.start()
    runner.drain(timeout_s=20)
    # an ended one: False
    assert runner.stop_run(waiting) is False
