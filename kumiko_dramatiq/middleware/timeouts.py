"""``timeout_ms``: what kumiko can interrupt, and what it records when it cannot.

A job's ``timeout_ms`` becomes its Dramatiq actor's ``time_limit``; Dramatiq's own
``TimeLimit`` (:func:`time_limit`, last of the message middleware in the chain, so its clock
covers only the handler) checks
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

Each interruption is logged at WARNING by ``TimeLimit``'s own logger, naming the job, the
message id and the attempt, not only Dramatiq's thread id.
Every actor kumiko declares carries a ``time_limit`` (``timeout_ms``, or infinity: no
limit); any other actor (a plain ``@dramatiq.actor`` on a kumiko broker) keeps Dramatiq's:
its own ``time_limit`` option, else Dramatiq's default of :data:`DRAMATIQ_TIME_LIMIT_MS`.
Touches no Redis key.
"""

from __future__ import annotations

import time

from dramatiq.middleware import TimeLimit

from kumiko_dramatiq.broker.seam import name_interruptions
from kumiko_dramatiq.errors import JobTimeoutError
from kumiko_dramatiq.registry import JobDefinition
from kumiko_dramatiq.worker.execution import execution_of
from kumiko_dramatiq.worker.runtime import Runtime

#: Dramatiq's default ``time_limit`` (ms), which actors kumiko did not declare keep.
DRAMATIQ_TIME_LIMIT_MS = 600_000


def check_elapsed(job: JobDefinition, started: float) -> None:
    """Raise :class:`JobTimeoutError` if a handler started at ``started`` (monotonic seconds)
    has run longer than ``job``'s ``timeout_ms``."""
    timeout_ms = job.options.timeout_ms
    if timeout_ms is None:
        return
    elapsed_ms = int((time.monotonic() - started) * 1000)
    if elapsed_ms > timeout_ms:
        raise JobTimeoutError(job.qualified_name, timeout_ms, elapsed_ms)


def time_limit(runtime: Runtime) -> TimeLimit:
    """Dramatiq's ``TimeLimit`` for a kumiko chain: Dramatiq's default limit for actors that
    declare none, checked every ``timeout_check_ms``; an interruption of a kumiko run is
    logged naming its job, message id and attempt."""
    middleware = TimeLimit(
        time_limit=DRAMATIQ_TIME_LIMIT_MS, interval=runtime.settings.timeout_check_ms
    )

    def name(thread: int) -> str | None:
        execution = execution_of(runtime.broker.running.get(thread))
        if execution is None:
            return None
        return (
            f"{execution.job.qualified_name} {execution.message_id} (attempt "
            f"{execution.meta.attempt} of {execution.meta.max_attempts}) exceeded "
            f"timeout_ms={execution.job.options.timeout_ms}: interrupting it"
        )

    name_interruptions(middleware, name)
    return middleware
