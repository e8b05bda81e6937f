"""The asyncio calls of ``JobRunner``: ``adispatch`` and its siblings.

Each ``a``-call is its sync twin run by :func:`~kumiko_dramatiq.aio.bridge.carry`: the same
validation, message building (one options function), guards, caps, hooks, return value and
errors, with every Redis command awaited on the running loop's own connection
(:class:`~kumiko_dramatiq.aio.clients.LoopClient`, made by :class:`LoopClients`). Several
loops in one process each get their own connection (a connection belongs to the loop that
opened it); sync callers keep the runner's sync pool, and both can share one runner.

``aresult`` waits without holding a thread: a waiter on the runner's one results
subscription (``ResultListener``) that wakes a future of its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from kumiko_dramatiq.aio.bridge import Courier, carry
from kumiko_dramatiq.aio.clients import LoopClient
from kumiko_dramatiq.broker.failover import PrimaryWatch
from kumiko_dramatiq.workflows.results import LOOKS_AT_ONCE, RECHECK_S

if TYPE_CHECKING:
    from kumiko_dramatiq.runner import JobRunner

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class _Loop:
    """What one event loop uses: its client (through a courier), its bound on looks, and the
    watch that closes the client when the loop shuts down (:func:`_closed_at_shutdown`)."""

    courier: Courier
    looks: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(LOOKS_AT_ONCE))
    shutdown: AsyncGenerator[None, None] | None = None


async def _until_shutdown(client: LoopClient) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        client.close()


def _closed_at_shutdown(client: LoopClient) -> AsyncGenerator[None, None]:
    """An async generator, started and left waiting, that closes ``client`` when its loop
    shuts down: ``asyncio.run`` (and uvicorn, anyio, ...) close every live async generator
    (``loop.shutdown_asyncgens``) before they close the loop, while it still runs. Keep it:
    the loop holds it weakly."""
    watch = _until_shutdown(client)
    step = watch.asend(None)
    with contextlib.suppress(StopIteration):
        step.send(None)
    return watch


class LoopClients:
    """A runner's async clients, one per event loop that called it (made at its first call,
    opening no connection until a command needs one)."""

    def __init__(self, redis_url: str, timeout_s: float, watch: PrimaryWatch | None) -> None:
        self._redis_url = redis_url
        self._timeout_s = timeout_s
        self._watch = watch
        self._lock = threading.Lock()
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Loop] = (
            weakref.WeakKeyDictionary()
        )

    def here(self) -> _Loop:
        """The running loop's (``RuntimeError`` outside of one). Its connection closes
        when the loop shuts down (``asyncio.run``'s end: :func:`_closed_at_shutdown`); a
        new loop's first call also shuts the connections of loops closed otherwise (each
        would stay open as long as the runner)."""
        loop = asyncio.get_running_loop()
        found = self._loops.get(loop)
        if found is None:
            with self._lock:
                found = self._loops.get(loop)
                if found is None:
                    self._forget_closed()
                    client = LoopClient(
                        self._redis_url, timeout_s=self._timeout_s, watch=self._watch
                    )
                    found = self._loops[loop] = _Loop(
                        Courier(client), shutdown=_closed_at_shutdown(client)
                    )
        return found

    def _forget_closed(self) -> None:
        for loop in [each for each in self._loops if each.is_closed()]:
            self._loops.pop(loop).courier.loop_client.sever()

    async def aclose(self) -> None:
        """Close the running loop's connection (a later call opens a new one)."""
        with self._lock:
            found = self._loops.pop(asyncio.get_running_loop(), None)
        if found is not None:
            found.courier.loop_client.close()

    def close(self) -> None:
        """Close every loop's connection from sync code (``JobRunner.stop``): on a loop that
        still runs, on its thread; else at once (:meth:`LoopClient.sever`)."""
        with self._lock:
            loops = list(self._loops.items())
            self._loops.clear()
        for loop, found in loops:
            client = found.courier.loop_client
            if loop.is_running():
                loop.call_soon_threadsafe(client.close)
            else:
                client.sever()


def asynchronous(
    call: Callable[Concatenate[JobRunner, P], R],
) -> Callable[Concatenate[JobRunner, P], Coroutine[Any, Any, R]]:
    """The ``a``-twin of the sync ``JobRunner`` method ``call``: the same call, carried on the
    running loop's client (see the module docstring)."""

    @functools.wraps(call)
    async def twin(self: JobRunner, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await carry(self.aio.here().courier, call, self, *args, **kwargs)

    twin.__doc__ = f"The asyncio twin of :meth:`{call.__name__}`: {call.__doc__}"
    return twin


class _Waker:
    """A result waiter's wake-up, set from the subscription's thread, awaited on its loop."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

    def set(self) -> None:
        self._loop.call_soon_threadsafe(self._event.set)

    async def wait(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout_s)
        self._event.clear()


async def aresult(runner: JobRunner, message_id: str, timeout_s: float) -> Any:
    """``runner.result``, awaited (its arguments already checked)."""
    results = runner.results
    here = runner.aio.here()

    async def look() -> Any:
        async with here.looks:
            return await carry(here.courier, results.look, message_id, bounded=False)

    deadline = time.monotonic() + timeout_s
    with runner._redis("reading a result"):
        found = await look()
        if not results.pending(found) or timeout_s <= 0:
            return results.outcome(message_id, found, timeout_s)
        waker = _Waker()
        results.listener.listen(message_id, ready_within_s=0, waker=waker)
        try:
            while True:
                found = results.announced(message_id) or await look()
                remaining = deadline - time.monotonic()
                if not results.pending(found) or remaining <= 0:
                    return results.outcome(message_id, found, timeout_s)
                await waker.wait(min(remaining, RECHECK_S))
        finally:
            results.listener.forget(message_id, waker)
