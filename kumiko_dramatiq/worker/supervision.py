"""Supervision: a worker heals by itself after a Redis fault, and says how it is.

Three pieces, each owned by one worker process (no module-level state):

- :class:`Outage`: one activity's view of a Redis fault (a consumer's fetches, the deferred
  writes, the liveness refresh). The first failure is logged at WARNING, once per outage,
  not once per attempt; the retry waits a backoff that doubles from
  :data:`FIRST_BACKOFF_MS` up to :data:`MAX_BACKOFF_MS`, so the activity resumes within
  about a second of Redis answering again; the first success after failures is logged at
  INFO with how long the outage lasted.
- :class:`Deferred`: the worker's list of bookkeeping writes that Redis did not take (a
  dedup record's end, a sequential lock's release). Each is an idempotent write that checks
  its owner token in its own Lua script, so writing it late is safe; a daemon thread
  retries them in order, with :class:`Outage`'s backoff, until they land or the worker
  stops (what is still pending then is logged, each with the bound after which it frees
  itself). Acks (and the run records and retries they write) are retried by Dramatiq's own
  consumer thread instead, which holds the message until its ack lands.
- :class:`Supervisor`: a daemon thread per worker (started at worker boot by
  :class:`~kumiko_dramatiq.middleware.presence.Presence`) that, every
  :data:`CHECK_INTERVAL_S`, restarts a consumer thread of Dramatiq's worker that died (a
  Redis error Dramatiq's consumer loop does not survive ends it with
  ``Exception in thread ...``) and notes one that is stuck (no iteration for
  :func:`stuck_after_s`). Its :meth:`Supervisor.health` goes into the worker's liveness
  record, where ``runner.status()`` reads it (``healthy``, ``problems``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import redis
from dramatiq.worker import Worker

from kumiko_dramatiq.broker.outage import Outage
from kumiko_dramatiq.broker.seam import consumer_of, consumer_threads, restart_consumer

logger = logging.getLogger("kumiko_dramatiq")

#: How often the supervisor checks the consumer threads.
CHECK_INTERVAL_S: Final = 0.5


def stuck_after_s(worker_timeout_ms: int, socket_timeout_s: float | None) -> float:
    """How long a consumer may go without an iteration before it counts as stuck: well
    beyond its longest legitimate wait (an idle wait of ``2 * worker_timeout_ms`` plus a
    command that runs into the socket timeout), and never under 30 s. Pure."""
    longest_s = 2 * worker_timeout_ms / 1000 + (socket_timeout_s or 0.0)
    return max(30.0, 4 * longest_s)


@dataclass
class _Write:
    what: str
    write: Callable[[], Any]
    bound_ms: int


class Deferred:
    """Bookkeeping writes that failed while Redis was away, retried until they land.

    :meth:`add` takes an idempotent write (safe to apply late: its script checks the owner
    token) with a description and the bound after which its key frees itself anyway. The
    retry thread starts on the first :meth:`add` (a producer never starts one) and ends when
    the list is empty; :meth:`stop` makes a last attempt and logs what is left.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._pending: deque[_Write] = deque()
        self._mutex = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._outage = Outage(f"deferred bookkeeping writes of {name}")

    @property
    def pending(self) -> int:
        with self._mutex:
            return len(self._pending)

    def add(self, what: str, write: Callable[[], Any], *, bound_ms: int) -> None:
        """Retry ``write`` until it lands (``what`` names it in logs)."""
        with self._mutex:
            if self._stopping:
                logger.warning(
                    "%s has stopped: a bookkeeping write Redis did not take is left: %s; it "
                    "frees itself within %d ms",
                    self.name,
                    what,
                    bound_ms,
                )
                return
            self._pending.append(_Write(what, write, bound_ms))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"kumiko-deferred-{self.name}", daemon=True
                )
                self._thread.start()
            self._mutex.notify()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop retrying: one last attempt at each pending write, then log what is left."""
        with self._mutex:
            self._stopping = True
            self._mutex.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout_s)
        self._drain_once()
        with self._mutex:
            left, self._pending = list(self._pending), deque()
        for each in left:
            logger.warning(
                "%s stops with a bookkeeping write Redis did not take: %s; it frees itself "
                "within %d ms",
                self.name,
                each.what,
                each.bound_ms,
            )

    def _run(self) -> None:
        while True:
            with self._mutex:
                if self._stopping or not self._pending:
                    self._thread = None
                    return
            wait_s = self._drain_once()
            if wait_s:
                with self._mutex:
                    if not self._stopping:
                        self._mutex.wait(wait_s)

    def _drain_once(self) -> float:
        """Write the pending writes in order; stop at the first that fails. Returns the
        backoff to wait (0: the list is empty)."""
        while True:
            with self._mutex:
                if not self._pending:
                    return 0.0
                each = self._pending[0]
            try:
                each.write()
            except Exception as exc:
                if not _is_redis_error(exc):
                    logger.exception("a deferred bookkeeping write failed for good: %s", each.what)
                else:
                    return self._outage.failed(exc)
            else:
                self._outage.succeeded()
                logger.info("deferred bookkeeping written: %s", each.what)
            with self._mutex:
                if self._pending and self._pending[0] is each:
                    self._pending.popleft()


def _is_redis_error(exc: BaseException) -> bool:
    return isinstance(exc, redis.RedisError)


class Supervisor:
    """Keeps a Dramatiq worker's consumer threads running, and tells how they are.

    Every :data:`CHECK_INTERVAL_S` it looks at each consumer thread of ``worker``: one that
    ended while the worker runs is restarted (logged at ERROR, with how many times), one that
    has not iterated for ``stuck_after`` seconds is reported stuck. The check itself never
    raises (an error is logged and the next check goes on).
    """

    def __init__(self, worker: Worker, *, name: str, stuck_after: float) -> None:
        self.worker = worker
        self.name = name
        self.stuck_after = stuck_after
        self.restarts = 0
        self._down: dict[str, str] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"kumiko-supervisor-{self.name}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop supervising (before the worker stops its consumers: a stopped consumer is
        not restarted)."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def health(self) -> dict[str, Any]:
        """``consumers_down`` (count) and ``issues`` (one line each), for the liveness record."""
        with self._lock:
            issues = sorted(self._down.values())
        return {"consumers_down": len(issues), "issues": issues}

    def _run(self) -> None:
        while not self._stopping.wait(CHECK_INTERVAL_S):
            try:
                self.check()
            except Exception:
                logger.exception("the consumer supervisor's check failed; checking again")

    def check(self) -> None:
        """One round: restart dead consumer threads, note stuck ones."""
        down: dict[str, str] = {}
        now = time.monotonic()
        for queue_name, thread in list(consumer_threads(self.worker).items()):
            if self._stopping.is_set():
                return
            if not thread.is_alive():
                self.restarts += 1
                logger.error(
                    "the consumer of %s ended (restart %d of this worker): restarting it",
                    queue_name,
                    self.restarts,
                )
                down[queue_name] = f"consumer of {queue_name} ended; restarting it"
                restart_consumer(self.worker, queue_name)
                continue
            consumer = consumer_of(thread)
            active = getattr(consumer, "active_at", None)
            if isinstance(active, float) and now - active > self.stuck_after:
                down[queue_name] = (
                    f"consumer of {queue_name} is stuck: no fetch for {int(now - active)} s"
                )
        with self._lock:
            for queue_name in down.keys() - self._down.keys():
                if "stuck" in down[queue_name]:
                    logger.error("%s", down[queue_name])
            self._down = down
