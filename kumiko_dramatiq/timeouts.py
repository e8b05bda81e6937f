"""``timeout_ms``: what kumiko can interrupt, and what it records when it cannot.

A job's ``timeout_ms`` becomes its Dramatiq actor's ``time_limit``; :class:`Timeouts`
(Dramatiq's ``TimeLimit``, last in the chain so its clock covers only the handler) checks
running handlers every ``timeout_check_ms`` (default 1 s). When one is over its limit it
raises ``TimeLimitExceeded`` in the handler's thread as an *asynchronous exception*, which
CPython delivers only when that thread next runs Python bytecode:

- Python code (loops, pure-Python libraries, ``await`` points of an ``async def`` handler,
  whose wait kumiko runs in short slices) is interrupted within about ``timeout_check_ms``;
- a blocking call inside C code is NOT interrupted: ``time.sleep(5)``, a socket read without
  a timeout, a long C-extension call run to their end, and the exception lands right after.

Either way the attempt fails and is retried like any failure. A handler that finished over
its limit without being interrupted at all (the C call returned and the handler returned
before the exception landed) is failed by :func:`check_elapsed` with
:class:`~kumiko_dramatiq.errors.JobTimeoutError`: an attempt that overran never counts as
completed. Handlers that must stop sooner should use timeouts of their own (socket
timeouts, ``asyncio.wait_for``).

Each interruption is logged at WARNING naming the job, the message id and the attempt, not
only Dramatiq's thread id.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import TimeLimit

from .errors import JobTimeoutError
from .execution import Execution, execution_of
from .registry import JobDefinition

logger = logging.getLogger("kumiko_dramatiq")


def check_elapsed(job: JobDefinition, started: float) -> None:
    """Raise :class:`JobTimeoutError` if a handler started at ``started`` (monotonic seconds)
    has run longer than ``job``'s ``timeout_ms``."""
    timeout_ms = job.options.timeout_ms
    if timeout_ms is None:
        return
    elapsed_ms = int((time.monotonic() - started) * 1000)
    if elapsed_ms > timeout_ms:
        raise JobTimeoutError(job.qualified_name, timeout_ms, elapsed_ms)


class _NamingLog:
    """Stands in for the logger of Dramatiq's timeout manager: its "time limit exceeded"
    line names the job, message id and attempt running in the thread, not only its id."""

    def __init__(self, running: dict[int, Execution], fallback: Any) -> None:
        self._running = running
        self._fallback = fallback

    def warning(self, msg: str, *args: Any) -> None:
        execution = self._running.get(args[0]) if args else None
        if execution is None:
            self._fallback.warning(msg, *args)
            return
        logger.warning(
            "%s %s (attempt %d of %d) exceeded timeout_ms=%s: interrupting it",
            execution.job.qualified_name,
            execution.message_id,
            execution.meta.attempt,
            execution.meta.max_attempts,
            execution.job.options.timeout_ms,
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fallback, name)


#: Dramatiq's default ``time_limit`` (ms), which actors kumiko did not declare keep.
DRAMATIQ_TIME_LIMIT_MS = 600_000


class Timeouts(TimeLimit):
    """Dramatiq's ``TimeLimit`` whose interruption log names the kumiko run it interrupts.

    Reads each actor's ``time_limit``: a kumiko job's actor always declares one
    (``timeout_ms``, or infinity: no limit); any other actor (a plain ``@dramatiq.actor`` on a
    kumiko broker) keeps Dramatiq's: its own ``time_limit`` option, else Dramatiq's default of
    :data:`DRAMATIQ_TIME_LIMIT_MS`. Touches no Redis key. Last of the message middleware in
    the chain, so its clock covers the handler only.
    """

    def __init__(self, *, interval: int) -> None:
        super().__init__(time_limit=DRAMATIQ_TIME_LIMIT_MS, interval=interval)
        self._running: dict[int, Execution] = {}
        self._lock = threading.Lock()
        self.manager.logger = _NamingLog(self._running, self.manager.logger)

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        execution = execution_of(message)
        if execution is not None:
            with self._lock:
                self._running[threading.get_ident()] = execution
        super().before_process_message(broker, message)  # type: ignore[no-untyped-call]

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        super().after_process_message(  # type: ignore[no-untyped-call]
            broker, message, result=result, exception=exception
        )
        with self._lock:
            self._running.pop(threading.get_ident(), None)

    def after_skip_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        self.after_process_message(broker, message)
