"""Running ``async def`` handlers from Dramatiq's worker threads.

Dramatiq's ``AsyncIO`` middleware owns one process-global event loop, which
several runners in one process cannot share safely. Each runner gets its own
:class:`EventLoopThread`, started on first use. A worker thread waits for its
coroutine in short slices, so an interruption (Dramatiq's ``TimeLimit``, kumiko's
:class:`~kumiko_dramatiq.worker.interrupts.Interruptible`) lands in the wait; an
interrupted wait cancels the coroutine's task and waits until the task has ended (its
``finally`` blocks ran, in slices too) before it re-raises: when the worker thread moves on,
the handler is no longer running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_WAIT_SLICE_S = 0.05


class EventLoopThread:
    """One asyncio loop in a daemon thread; :meth:`run` blocks until a coroutine ends."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _ensure_started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name=f"kumiko-loop-{self._name}", daemon=True
                )
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` as a task of the loop and return its result (or raise its error);
        interrupted, cancel the task, wait until it ended, re-raise."""
        loop = self._ensure_started()
        outcome: concurrent.futures.Future[T] = concurrent.futures.Future()
        ended = threading.Event()
        tasks: list[asyncio.Task[T]] = []

        def settle(task: asyncio.Task[T]) -> None:
            ended.set()
            if task.cancelled():
                outcome.cancel()
            elif (error := task.exception()) is not None:
                outcome.set_exception(error)
            else:
                outcome.set_result(task.result())

        def start() -> None:
            task = loop.create_task(coro)
            tasks.append(task)
            task.add_done_callback(settle)

        def cancel() -> None:
            # runs after start() if that was scheduled (the loop runs callbacks in order): an
            # interruption that landed before it was leaves no task, and nothing to wait for
            if not tasks:
                coro.close()
                ended.set()
            for task in tasks:
                task.cancel()

        try:
            # inside the try: an interruption landing right after the task was scheduled, as
            # it starts, still cancels it and waits for its end
            loop.call_soon_threadsafe(start)
            while not outcome.done():
                concurrent.futures.wait([outcome], timeout=_WAIT_SLICE_S)
            return outcome.result()
        except BaseException:
            loop.call_soon_threadsafe(cancel)
            while not ended.wait(_WAIT_SLICE_S) and loop.is_running():
                pass
            raise

    def stop(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.close()
