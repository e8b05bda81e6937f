"""Stopping a running attempt on request: :class:`StopRequested`, :class:`StopWatch`.

``runner.stop_run(message_id)`` (:meth:`kumiko_dramatiq.ops.admin.Admin.stop_run`) sets a stop
request (``keys.stop_request``, TTL ``keys.STOP_REQUEST_TTL_MS``) for a message that is in
flight. Every runner that runs handlers has one :class:`StopWatch`: a daemon thread that lives
while the runner runs handlers (started by the first one, gone after :data:`IDLE_EXIT_S`
with none) and, every :data:`POLL_S`, reads the stop requests of the messages its handlers run
now in one ``MGET``: one command per poll and process, whatever the throughput, none per
message. A request it finds:

- sets the run's stop event first, so ``ctx.stop_requested`` is true from then on;
- interrupts the handler call with :class:`StopRequested` through its
  :class:`~kumiko_dramatiq.worker.interrupts.Interruptible`, as a timeout or a lost lease does:
  an asynchronous exception in a sync handler's thread (within milliseconds in Python code;
  when a blocking C call returns), a cancelled task for an ``async def`` handler;
- deletes the request (a Redis error there is logged: the request expires by itself).

So a stop reaches its run within ``POLL_S`` plus a round trip. The attempt then ends
``cancelled`` (``History``), is not retried (``Retries``), is final for its dedup key
(``Dedup`` frees it) and releases its sequential lock (``Sequential``), as any end does; no
failure hook is called (it did not fail).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import redis
from dramatiq.middleware import Interrupt

from kumiko_dramatiq.broker import keys

if TYPE_CHECKING:
    from kumiko_dramatiq.worker.execution import Execution

logger = logging.getLogger("kumiko_dramatiq")

#: How often a busy runner reads the stop requests of what it runs (seconds).
POLL_S = 0.25
#: The watch thread ends after this long with no handler running.
IDLE_EXIT_S = 10.0


class StopRequested(Interrupt):
    """Raised in a handler whose run ``runner.stop_run`` asked to stop: the attempt ends
    ``cancelled`` and is not retried. A Dramatiq ``Interrupt``, so ``except Exception`` in a
    handler does not catch it."""


class StopWatch:
    """The thread that brings stop requests to the runs of one runner (module docstring)."""

    def __init__(self, client: redis.Redis, queue_prefix: str) -> None:
        self._client = client
        self._prefix = queue_prefix
        self._cond = threading.Condition()
        self._runs: dict[int, Execution] = {}
        self._thread: threading.Thread | None = None

    def watch(self, execution: Execution) -> None:
        """Bring stop requests to ``execution`` until :meth:`forget` (in-memory only)."""
        with self._cond:
            self._runs[id(execution)] = execution
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._watch, name=f"kumiko-stops-{self._prefix}", daemon=True
                )
                self._thread.start()

    def forget(self, execution: Execution) -> None:
        with self._cond:
            self._runs.pop(id(execution), None)

    def _watch(self) -> None:
        idle_s = 0.0
        while True:
            with self._cond:
                self._cond.wait(POLL_S)
                runs = list(self._runs.values())
                if not runs:
                    idle_s += POLL_S
                    if idle_s >= IDLE_EXIT_S:
                        self._thread = None
                        return
                    continue
            idle_s = 0.0
            self.poll(runs)

    def poll(self, runs: list[Execution]) -> None:
        """Read the stop requests of ``runs`` (one ``MGET``) and stop those asked to."""
        names = [keys.stop_request(self._prefix, run.message_id) for run in runs]
        try:
            found = self._client.mget(names)
        except redis.RedisError as exc:
            logger.warning("could not read stop requests (%s); trying again", exc)
            return
        for run, name, value in zip(runs, names, found, strict=True):
            if value is None:
                continue
            run.stop.set()
            if run.interruptible.interrupt(StopRequested):
                logger.warning(
                    "%s %s: stop requested; interrupting the run (it ends cancelled)",
                    run.job.qualified_name,
                    run.message_id,
                    extra=run.log_fields(),
                )
            try:
                self._client.delete(name)
            except redis.RedisError as exc:
                logger.warning("could not delete the stop request %s (%s)", name, exc)
