"""Interrupting a running handler from another thread: :class:`Interruptible`.

One :class:`Interruptible` stands for one call of a handler (the actor body of one delivery:
``Execution.interruptible``). The worker thread runs the handler through :meth:`run`; any
other thread may :meth:`~Interruptible.interrupt` it with an exception type, at most once:

- while the handler runs, the exception is raised in the worker thread as an *asynchronous
  exception* (the mechanism of Dramatiq's ``TimeLimit``, :mod:`kumiko_dramatiq.broker.seam`):
  CPython raises it the next time that thread runs Python bytecode. Python code is
  interrupted within a few milliseconds; a blocking call inside C code (``time.sleep``, a
  socket read without a timeout, a C extension) is not, and the exception lands when the call
  returns;
- an ``async def`` handler runs in the runner's event loop while the worker thread waits for
  it (:class:`~kumiko_dramatiq.worker.loop.EventLoopThread`): the interruption lands in that
  wait, which cancels the handler's task and waits until the task has really ended (its
  ``finally`` blocks ran) before it re-raises; the task sees ``CancelledError`` at its
  current ``await``;
- before the handler starts, the interruption is kept, and :meth:`run` raises it at once
  without calling the handler;
- after the handler ended, nothing happens (``interrupt`` returns ``False``). An interruption
  sent just as the handler returned, and not yet raised, is dropped when :meth:`run` leaves
  (never raised in code after the handler: the middleware's after-hooks).

So ``running`` (the handler is executing, or its task is still winding down) and ``raised``
(it ended by an exception, its own or the interruption) tell a watchdog
(:class:`~kumiko_dramatiq.worker.fencing.Fence`) and the middleware what happened.
``interrupted_by`` is the exception type sent, if any. Exceptions used to interrupt should
derive from Dramatiq's ``Interrupt`` (a ``BaseException``), so that a handler's
``except Exception`` does not swallow them.

Used for a lease that could not be renewed (``LeaseLost``); a "stop this run" command and
concurrency slots interrupt the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from kumiko_dramatiq.broker.seam import clear_pending_in_thread, raise_in_thread

T = TypeVar("T")

_PENDING, _RUNNING, _ENDED = 0, 1, 2


class Interruptible:
    """One handler call that another thread may interrupt (see the module docstring)."""

    __slots__ = ("_lock", "_state", "_thread", "interrupted_by", "raised")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = _PENDING
        self._thread = 0
        #: the exception type :meth:`interrupt` sent, if any
        self.interrupted_by: type[BaseException] | None = None
        #: whether the call ended by an exception (known once it ended)
        self.raised = False

    @property
    def running(self) -> bool:
        """Whether the handler is executing now (or its task is still winding down)."""
        return self._state == _RUNNING

    @property
    def ended(self) -> bool:
        return self._state == _ENDED

    def run(self, call: Callable[[], T]) -> T:
        """Run ``call`` in the calling thread, interruptible by :meth:`interrupt`."""
        with self._lock:
            if self._state != _PENDING:
                raise RuntimeError("an Interruptible runs one call")
            pending = self.interrupted_by
            self._thread = threading.get_ident()
            self._state = _RUNNING
        if pending is not None:
            self._leave(raised=True)
            raise pending()
        raised = True
        try:
            result = call()
            raised = False
            return result
        finally:
            # An interruption sent as the call ended may land in here, before _leave drops it:
            # retry until _leave ran (it drops any still pending).
            while True:
                try:
                    self._leave(raised)
                    break
                except BaseException:  # only an interruption that came too late
                    continue

    def _leave(self, raised: bool) -> None:
        with self._lock:
            if self._state == _ENDED:
                return
            self._state = _ENDED
            self.raised = raised
            if self.interrupted_by is not None:
                clear_pending_in_thread(self._thread)

    def interrupt(self, exception: type[BaseException]) -> bool:
        """Interrupt the call with ``exception`` (see the module docstring). ``True`` if it
        was sent (the call runs, or has not started yet); ``False`` if the call ended already
        or was interrupted before."""
        with self._lock:
            if self._state == _ENDED or self.interrupted_by is not None:
                return False
            self.interrupted_by = exception
            if self._state == _RUNNING:
                raise_in_thread(self._thread, exception)
            return True
