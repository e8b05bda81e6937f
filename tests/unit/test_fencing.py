"""The interruption facility (kumiko_dramatiq.worker.interrupts) and the fence
(kumiko_dramatiq.worker.fencing), without Redis: real threads, synchronised on events."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from dramatiq.middleware import Interrupt

from kumiko_dramatiq.worker.fencing import (
    END_PROCESS_AT,
    INTERRUPT_AT,
    Fence,
    LeaseLost,
    fence_deadlines,
    lost_deadlines,
)
from kumiko_dramatiq.worker.interrupts import Interruptible
from kumiko_dramatiq.worker.loop import EventLoopThread


class Stop(Interrupt):
    pass


def python_loop(started: threading.Event, limit_s: float = 30) -> str:
    """Python code that runs until interrupted (or ``limit_s``)."""
    started.set()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(0.001)
    return "ran to its end"


def in_thread(target: Any) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(target())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


# -- Interruptible -------------------------------------------------------------------------
def test_an_interrupted_call_raises_the_exception_in_its_thread() -> None:
    run, started = Interruptible(), threading.Event()
    thread, outcome = in_thread(lambda: run.run(lambda: python_loop(started)))
    started.wait(10)
    assert run.running
    assert run.interrupt(Stop) is True
    thread.join(10)
    assert isinstance(outcome[0], Stop)
    assert (run.ended, run.raised, run.interrupted_by) == (True, True, Stop)


def test_an_interruption_before_the_call_starts_raises_without_calling_it() -> None:
    run, called = Interruptible(), []
    assert run.interrupt(Stop) is True
    with pytest.raises(Stop):
        run.run(lambda: called.append(1))
    assert called == []
    assert run.raised


def test_an_interruption_after_the_call_ended_does_nothing() -> None:
    run = Interruptible()
    assert run.run(lambda: 42) == 42
    assert run.interrupt(Stop) is False
    assert (run.raised, run.interrupted_by) == (False, None)


def test_a_call_is_interrupted_once() -> None:
    run, started = Interruptible(), threading.Event()
    thread, outcome = in_thread(lambda: run.run(lambda: python_loop(started)))
    started.wait(10)
    assert run.interrupt(Stop) is True
    assert run.interrupt(LeaseLost) is False
    thread.join(10)
    assert isinstance(outcome[0], Stop)


def test_a_call_that_raised_by_itself_is_not_taken_for_interrupted() -> None:
    run = Interruptible()

    def fails() -> None:
        raise ValueError("own")

    with pytest.raises(ValueError, match="own"):
        run.run(fails)
    assert (run.raised, run.interrupted_by) == (True, None)


def test_a_blocking_c_call_is_interrupted_only_when_it_returns() -> None:
    run, blocked, release = Interruptible(), threading.Event(), threading.Event()

    def blocking() -> str:
        blocked.set()
        release.wait(30)  # a C call: the exception cannot land inside it
        return "returned"

    thread, outcome = in_thread(lambda: run.run(blocking))
    blocked.wait(10)
    run.interrupt(Stop)
    assert run.running  # still inside the C call
    release.set()
    thread.join(10)
    assert not run.running
    assert isinstance(outcome[0], Stop) or outcome[0] == "returned"


def test_an_async_handler_is_cancelled_and_has_ended_when_the_wait_returns() -> None:
    loop, run, started = EventLoopThread("test"), Interruptible(), threading.Event()
    cleaned: list[str] = []

    async def handler() -> None:
        started.set()
        try:
            while True:
                await asyncio.sleep(0.01)
        finally:
            await asyncio.sleep(0.05)  # winding down takes a while
            cleaned.append("finally ran")

    try:
        thread, outcome = in_thread(lambda: run.run(lambda: loop.run(handler())))
        started.wait(10)
        run.interrupt(Stop)
        thread.join(10)
        assert isinstance(outcome[0], Stop)
        assert cleaned == ["finally ran"]  # before the worker thread moved on
        assert run.ended
    finally:
        loop.stop()


async def _tasks_besides_this() -> int:
    return len(asyncio.all_tasks() - {asyncio.current_task()})


def test_an_interruption_landing_as_the_task_is_scheduled_still_cancels_it() -> None:
    # The asynchronous exception lands at the first bytecode after the handler's task was
    # scheduled (here: raised by the scheduling call itself, once it scheduled): the task
    # is cancelled and has ended when the wait returns, as for one landing later.
    loop, started = EventLoopThread("test"), threading.Event()
    cleaned: list[str] = []
    real = loop._ensure_started()

    class LandsAfterScheduling:
        def __init__(self) -> None:
            self.first = True

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def call_soon_threadsafe(self, callback: Any, *args: Any) -> Any:
            handle = real.call_soon_threadsafe(callback, *args)
            if self.first:
                self.first = False
                raise Stop()
            return handle

    async def handler() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.append("finally ran")

    loop._ensure_started = LandsAfterScheduling  # type: ignore[assignment, method-assign]
    try:
        with pytest.raises(Stop):
            loop.run(handler())
        # no task of the handler is left running (with the exception landing outside the
        # wait, it would sleep on)
        assert asyncio.run_coroutine_threadsafe(_tasks_besides_this(), real).result(10) == 0
        assert cleaned == (["finally ran"] if started.is_set() else [])
    finally:
        loop._ensure_started = lambda: real  # type: ignore[method-assign]
        loop.stop()


def test_an_async_handler_returns_its_result_and_raises_its_error() -> None:
    loop = EventLoopThread("test")

    async def answer() -> int:
        return 42

    async def fails() -> None:
        raise ValueError("own")

    try:
        assert loop.run(answer()) == 42
        with pytest.raises(ValueError, match="own"):
            loop.run(fails())
    finally:
        loop.stop()


# -- deadlines -------------------------------------------------------------------------------
def test_a_lease_is_fenced_before_it_can_expire_counted_from_the_send() -> None:
    interrupt_at, end_at = fence_deadlines(100.0, 30_000)
    assert (interrupt_at, end_at) == (100.0 + 30 * INTERRUPT_AT, 100.0 + 30 * END_PROCESS_AT)
    assert 100.0 < interrupt_at < end_at < 130.0


def test_a_lease_found_gone_is_fenced_at_once() -> None:
    interrupt_at, end_at = lost_deadlines(50.0, 10_000)
    assert interrupt_at == 50.0
    assert end_at == pytest.approx(50.0 + 10 * (END_PROCESS_AT - INTERRUPT_AT))


# -- the fence ---------------------------------------------------------------------------------
def test_the_fence_interrupts_a_run_at_its_deadline_and_gives_its_lease_up_first() -> None:
    ended: list[str] = []
    fence, run, started, given_up = (
        Fence("t", end_process=ended.append),
        Interruptible(),
        threading.Event(),
        [],
    )
    thread, outcome = in_thread(lambda: run.run(lambda: python_loop(started)))
    started.wait(10)
    now = time.monotonic()
    fence.guard(
        "k",
        run,
        interrupt_at=now + 0.05,
        end_at=now + 30,
        what="job 1",
        on_interrupt=lambda: given_up.append(run.running),
    )
    thread.join(10)
    assert isinstance(outcome[0], LeaseLost)
    assert given_up == [True]
    assert ended == []


def test_a_renewal_moves_the_deadline() -> None:
    ended: list[str] = []
    fence, run, started = Fence("t", end_process=ended.append), Interruptible(), threading.Event()
    thread, outcome = in_thread(lambda: run.run(lambda: python_loop(started, limit_s=0.5)))
    started.wait(10)
    now = time.monotonic()
    fence.guard("k", run, interrupt_at=now + 0.1, end_at=now + 30, what="job 1")
    assert fence.extend("k", interrupt_at=now + 60, end_at=now + 90) is True
    thread.join(10)
    assert outcome == ["ran to its end"]
    fence.release("k")
    assert fence.extend("k", interrupt_at=now, end_at=now) is False


def test_a_run_stuck_in_a_c_call_ends_the_process_and_one_that_stopped_does_not() -> None:
    ended: list[str] = []
    fence = Fence("t", end_process=ended.append)
    stuck, blocked, release = Interruptible(), threading.Event(), threading.Event()

    def blocking() -> None:
        blocked.set()
        release.wait(30)

    thread, _ = in_thread(lambda: stuck.run(blocking))
    blocked.wait(10)
    stopped, started = Interruptible(), threading.Event()
    other, _ = in_thread(lambda: stopped.run(lambda: python_loop(started)))
    started.wait(10)
    now = time.monotonic()
    fence.guard("stuck", stuck, interrupt_at=now, end_at=now + 0.2, what="stuck run")
    fence.guard("stopped", stopped, interrupt_at=now, end_at=now + 0.2, what="stopped run")
    other.join(10)
    deadline = time.monotonic() + 10
    while not ended and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    thread.join(10)
    assert len(ended) == 1
    assert ended[0].startswith("stuck run: still running")
    assert "ending this worker process" in ended[0]


def test_a_run_that_ended_by_itself_is_left_alone() -> None:
    ended: list[str] = []
    fence, run = Fence("t", end_process=ended.append), Interruptible()
    run.run(lambda: None)
    now = time.monotonic()
    fence.guard("k", run, interrupt_at=now, end_at=now + 0.05, what="done run")
    # a later run the fence does interrupt: once it is, the earlier deadlines were handled
    later, started = Interruptible(), threading.Event()
    thread, outcome = in_thread(lambda: later.run(lambda: python_loop(started)))
    started.wait(10)
    fence.guard("later", later, interrupt_at=now + 0.1, end_at=now + 30, what="later run")
    thread.join(10)
    assert isinstance(outcome[0], LeaseLost)
    assert ended == []
    assert run.interrupted_by is None
