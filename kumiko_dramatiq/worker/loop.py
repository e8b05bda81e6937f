"""Running ``async def`` handlers from Dramatiq's worker threads.

Dramatiq's ``AsyncIO`` middleware owns one process-global event loop, which
several runners in one process cannot share safely. Each runner gets its own
:class:`EventLoopThread`, started on first use. A worker thread waits for its
coroutine in short slices, so Dramatiq's ``TimeLimit`` can interrupt the wait;
an interrupted wait cancels the coroutine.
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
        future = asyncio.run_coroutine_threadsafe(coro, self._ensure_started())
        try:
            while not future.done():
                concurrent.futures.wait([future], timeout=_WAIT_SLICE_S)
            return future.result()
        except BaseException:
            future.cancel()
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
