"""Progress of a running attempt: what ``ctx.progress(value, note)`` accepts, when it is written.

A handler reports how far its attempt is, ``value`` from 0.0 to 1.0, and a short ``note``;
either may be ``None``, which keeps the one reported before (``ctx.progress(note="upload")``
leaves the value as it was). Bad input raises :class:`~kumiko_dramatiq.errors.PayloadError`
(a ``ValueError``) before anything is kept, one line naming the job, what is wrong and the
value (:func:`check_progress`)::

    reports:job:render: progress value must be a number from 0.0 to 1.0, got 1.5

Who keeps what is reported: on a worker, the runner's
:class:`~kumiko_dramatiq.worker.progress.ProgressWriter` (in Redis, coalesced as below, read by
``runner.running()``); in ``testing.run_job``, an :class:`InMemoryProgress` (every report, no
Redis).

**Coalescing** (:class:`Coalescer`, pure: the times are handed in). A report is due at once
when the attempt wrote none yet, or its last write is :data:`WRITE_INTERVAL_S` old; else it
waits, and is due :data:`WRITE_INTERVAL_S` after the last write, when the latest report is
written (a trailing write; every report in between is folded into it). So reports in a tight
loop cost at most one write per :data:`WRITE_INTERVAL_S` (two a second) per attempt, and the
latest lands within :data:`WRITE_INTERVAL_S` plus a round trip. With no new report, what was
written is written again every :data:`REFRESH_S`, so its key (TTL
:data:`~kumiko_dramatiq.broker.keys.PROGRESS_TTL_MS`, three refreshes) lives while the attempt
runs and expires by itself when its worker dies.
"""

from __future__ import annotations

import math
import numbers
import threading
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from kumiko_dramatiq.errors import PayloadError
from kumiko_dramatiq.limits import unicode_problem

#: A note is at most this many characters.
MAX_NOTE_CHARS: Final = 200
#: Writes of one attempt's progress are at least this far apart (seconds).
WRITE_INTERVAL_S: Final = 0.5
#: An attempt's progress is written again this long after its last write, to refresh its TTL.
REFRESH_S: Final = 60.0

#: (value, note) as last reported; ``None`` where nothing was reported yet.
Reported = tuple[float | None, str | None]


class ProgressSink(Protocol):
    """Where a :class:`~kumiko_dramatiq.context.JobContext` hands checked reports."""

    def report(self, value: float | None, note: str | None) -> None: ...


def check_progress(job_name: str, value: Any, note: Any) -> Reported:
    """``(value, note)`` as kept (``value`` a float), or :class:`PayloadError` naming
    ``job_name``: a value that is not a real number from 0.0 to 1.0 (``bool`` and NaN are
    not), a note that is not a ``str`` of at most :data:`MAX_NOTE_CHARS` characters of
    valid Unicode without control characters."""
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise PayloadError(
                job_name, "progress value", "must be a number from 0.0 to 1.0 (or None)", value
            )
        number = float(value)
        if math.isnan(number) or not 0.0 <= number <= 1.0:
            raise PayloadError(
                job_name, "progress value", "must be a number from 0.0 to 1.0", value
            )
        value = number
    if note is not None:
        problem = note_problem(note)
        if problem is not None:
            raise PayloadError(job_name, "progress note", problem, note)
    return value, note


def note_problem(note: Any) -> str | None:
    """Why ``note`` is not a progress note, or ``None``."""
    if not isinstance(note, str):
        return "must be a str (or None)"
    if len(note) > MAX_NOTE_CHARS:
        return f"must be at most {MAX_NOTE_CHARS} characters (it has {len(note)})"
    problem = unicode_problem(note)
    if problem is not None:
        return problem
    if any(unicodedata.category(char) == "Cc" for char in note):
        return "must not contain control characters (one line)"
    return None


def merged(latest: Reported, value: float | None, note: str | None) -> Reported:
    """The progress after a report of ``(value, note)``: ``None`` keeps what ``latest`` has."""
    return (latest[0] if value is None else value, latest[1] if note is None else note)


def progress_label(value: float | None, note: str | None) -> str:
    """How ``kumiko busy`` shows a progress: ``"42% note"`` (the percentage rounded down, so
    100% means done), either part alone, ``""`` for none."""
    percent = None if value is None else f"{math.floor(value * 100)}%"
    return " ".join(part for part in (percent, note) if part)


@dataclass
class Coalescer:
    """When one attempt's progress is written (the module docstring's rule). The caller
    passes the time (``now_s``, any monotonic clock) and does the writing."""

    interval_s: float = WRITE_INTERVAL_S
    refresh_s: float = REFRESH_S
    #: when the last write was taken, ``None`` before the first
    last_write_s: float | None = None
    #: a report came after the last write
    pending: bool = False

    def offer(self) -> bool:
        """Note a report; ``True`` when it is the first since the last write (the writer's
        next wake-up may have to move)."""
        first = not self.pending
        self.pending = True
        return first

    def due_at(self) -> float | None:
        """When the next write is due (``-inf``: now), ``None`` when none ever is (nothing
        reported yet)."""
        if self.last_write_s is None:
            return -math.inf if self.pending else None
        return self.last_write_s + (self.interval_s if self.pending else self.refresh_s)

    def take(self, now_s: float) -> bool:
        """Whether a write is due at ``now_s``; if so it counts as done at ``now_s``."""
        due = self.due_at()
        if due is None or now_s < due:
            return False
        self.last_write_s = now_s
        self.pending = False
        return True

    def failed(self) -> None:
        """The write taken last did not land: write again, one interval after it."""
        self.pending = True


@dataclass
class InMemoryProgress:
    """A :class:`ProgressSink` that keeps every report in memory: ``testing.run_job``'s
    (pass one as ``run_job(..., progress=...)`` to read it). ``reports`` holds the progress
    after each call, oldest first; ``value`` and ``note`` the latest. Thread-safe."""

    reports: list[Reported] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def report(self, value: float | None, note: str | None) -> None:
        with self._lock:
            latest = self.reports[-1] if self.reports else (None, None)
            self.reports.append(merged(latest, value, note))

    @property
    def value(self) -> float | None:
        """The latest value reported (``None`` before any)."""
        with self._lock:
            return self.reports[-1][0] if self.reports else None

    @property
    def note(self) -> str | None:
        """The latest note reported (``None`` before any)."""
        with self._lock:
            return self.reports[-1][1] if self.reports else None
