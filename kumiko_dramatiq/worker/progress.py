"""``ctx.progress`` of a runner's runs reaches Redis: :class:`ProgressWriter`, its reports.

Each attempt's context gets a :class:`ProgressReport` (``Runtime.context_for``; kept on the
execution as ``Execution.progress``). A report only keeps the latest value and note in memory
and, when its :class:`~kumiko_dramatiq.progress.Coalescer` says a write may be due, wakes the
writer: the handler never waits for Redis, and a report in a tight loop costs a lock and a
comparison.

- **The writer**: one daemon thread per runner, started by the first report, gone after
  :data:`IDLE_EXIT_S` with no reporting attempt. It writes what is due (the coalescing rule of
  :mod:`kumiko_dramatiq.progress`: the first report at once, later ones at most every
  ``WRITE_INTERVAL_S``, the latest by a trailing write, a refresh every ``REFRESH_S``), all
  due attempts of the runner in one pipelined round trip of ``SET key json PX ttl``, and
  sleeps until the next one is due or a report comes. Redis work: at most 2 writes a second
  per attempt reporting in a tight loop, one per ``REFRESH_S`` per attempt that reported and
  went quiet, none for an attempt that never reports.
- **The key**: :func:`~kumiko_dramatiq.broker.keys.progress` (per message id *and* attempt,
  so an attempt's end never deletes its retry's), JSON ``{"v": value, "n": note, "w":
  host:pid}``, TTL :data:`~kumiko_dramatiq.broker.keys.PROGRESS_TTL_MS`. ``runner.running()``
  reads the keys of the runs in flight in one ``MGET``
  (:func:`~kumiko_dramatiq.ops.history.with_progress`) and shows a value only when ``w`` is
  the worker running it.
- **The end**: the actor body closes the report when the handler call ends
  (``worker/actors.py``): no write after that, and if it wrote, the worker thread deletes the
  key (one ``DEL``) once a write in flight landed, so no write can follow the delete. A
  worker killed with ``kill -9`` leaves its keys to their TTL; a redelivery of the attempt on
  another worker does not show them (``w`` differs) and writes its own.
- **Faults**: a write Redis refuses is logged once per outage
  (:class:`~kumiko_dramatiq.broker.outage.Outage`) and taken again ``WRITE_INTERVAL_S``
  later; a failed delete leaves the key to its TTL. It never touches a lock, a lease, an
  in-flight entry or anything else of the run.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Final

import redis

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.outage import Outage
from kumiko_dramatiq.progress import Coalescer, Reported, merged

logger = logging.getLogger("kumiko_dramatiq")

#: The writer thread ends after this long with no attempt reporting (seconds).
IDLE_EXIT_S: Final = 10.0
#: The end of an attempt waits at most this long for a write of its progress in flight.
CLOSE_WAIT_S: Final = 10.0


class ProgressReport:
    """One attempt's progress on a worker: the ``ctx.progress`` sink (module docstring).
    Its state is guarded by its writer's lock."""

    def __init__(self, writer: ProgressWriter, key: str, worker: str) -> None:
        self._writer = writer
        self.key = key
        self.worker = worker
        self.latest: Reported = (None, None)
        self.coalescer = Coalescer()
        #: it ended: nothing is written any more
        self.closed = False
        #: a write of it was sent, so its end deletes the key
        self.written = False
        #: a write of it is in flight
        self.writing = False
        #: it reported at least once (an attempt that never does costs its end nothing)
        self.offered = False

    def report(self, value: float | None, note: str | None) -> None:
        self._writer.offer(self, value, note)

    def close(self) -> None:
        """The attempt ended (idempotent): drop its progress."""
        self._writer.close(self)

    def encoded(self) -> str:
        value, note = self.latest
        return json.dumps({"v": value, "n": note, "w": self.worker}, separators=(",", ":"))


class ProgressWriter:
    """Writes the progress of one runner's attempts (module docstring)."""

    def __init__(
        self, client: redis.Redis, queue_prefix: str, worker_identity: Callable[[], str]
    ) -> None:
        self._client = client
        self._prefix = queue_prefix
        self._identity = worker_identity
        self._cond = threading.Condition()
        self._reports: dict[int, ProgressReport] = {}
        self._thread: threading.Thread | None = None
        self._outage = Outage(f"progress writer of {queue_prefix}")
        #: progress writes sent (one ``SET`` each), since the runner was built
        self.writes = 0

    def open(self, message_id: str, attempt: int) -> ProgressReport:
        """The report of attempt ``attempt`` of ``message_id`` (no Redis, no thread until its
        first report)."""
        return ProgressReport(
            self, keys.progress(self._prefix, message_id, attempt), self._identity()
        )

    def offer(self, report: ProgressReport, value: float | None, note: str | None) -> None:
        with self._cond:
            if report.closed:
                return
            report.offered = True
            report.latest = merged(report.latest, value, note)
            if not report.coalescer.offer():
                return  # a write is pending already: the writer wakes for it
            self._reports[id(report)] = report
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name=f"kumiko-progress-{self._prefix}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def close(self, report: ProgressReport) -> None:
        if not report.offered:  # the common case: no lock taken (a later offer sees closed)
            report.closed = True
            return
        with self._cond:
            if report.closed:
                return
            report.closed = True
            self._reports.pop(id(report), None)
            self._cond.wait_for(lambda: not report.writing, timeout=CLOSE_WAIT_S)
            written = report.written
        if not written:
            return
        try:
            self._client.delete(report.key)
        except redis.RedisError as exc:
            logger.warning("could not delete the progress %s (%s); it expires", report.key, exc)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._reports:
                    if not self._cond.wait(IDLE_EXIT_S) and not self._reports:
                        self._thread = None
                        return
                    continue
                now = time.monotonic()
                due = []
                wake_at = math.inf
                for report in self._reports.values():
                    if report.coalescer.take(now):
                        report.writing = report.written = True
                        due.append((report, report.encoded()))
                    at = report.coalescer.due_at()
                    if at is not None:
                        wake_at = min(wake_at, at)
                if not due:
                    self._cond.wait(None if math.isinf(wake_at) else max(0.0, wake_at - now))
                    continue
            self._write(due)

    def _write(self, due: list[tuple[ProgressReport, str]]) -> None:
        """Send the writes ``due`` in one round trip; those Redis refuses are taken again."""
        landed = False
        try:
            pipe = self._client.pipeline(transaction=False)
            for report, value in due:
                pipe.set(report.key, value, px=keys.PROGRESS_TTL_MS)
            pipe.execute()
            landed = True
        except redis.RedisError as exc:
            self._outage.failed(exc)
        finally:
            with self._cond:
                for report, _ in due:
                    report.writing = False
                    if not landed:
                        report.coalescer.failed()
                self.writes += len(due)
                self._cond.notify_all()
        if landed:
            self._outage.succeeded()
