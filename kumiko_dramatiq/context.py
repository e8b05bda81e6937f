"""What a handler and the hooks are told about a run: ``JobMeta`` and ``JobContext``."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from kumiko_dramatiq.progress import ProgressSink, check_progress

if TYPE_CHECKING:
    from collections.abc import Callable

    from kumiko_dramatiq.workflows.batches import BatchHandle

Trigger = Literal["manual", "event", "cron", "boot", "gate", "fanout", "requeue"]


@dataclass(frozen=True)
class JobMeta:
    """One attempt of one message, as the hooks see it.

    ``attempt`` is 1-based; ``final_attempt`` is true when a failure of this
    attempt is not retried. ``trigger`` says how the message came to be; a
    retry keeps its message id and its trigger. ``no_retry`` is true when the
    attempt failed in a way no retry can fix (a queued payload that no longer
    validates against its job's payload model): then ``final_attempt`` is true
    whatever ``attempt`` is.
    """

    attempt: int
    max_attempts: int
    tenant_id: str | None
    trigger: Trigger
    scheduled_at: datetime | None = None
    dedup_key: str | None = None
    no_retry: bool = False

    @property
    def final_attempt(self) -> bool:
        return self.no_retry or self.attempt >= self.max_attempts


@dataclass(frozen=True)
class JobContext:
    """Handed to every handler as its second argument."""

    job_name: str
    message_id: str
    meta: JobMeta
    app: Any
    #: set when ``runner.stop_run`` asked this run to stop (read ``stop_requested``)
    stop_event: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    #: where ``progress`` reports go (a worker's writer, ``testing.run_job``'s memory); none:
    #: they are checked and dropped
    _progress: ProgressSink | None = field(default=None, repr=False, compare=False)

    @property
    def stop_requested(self) -> bool:
        """Whether ``runner.stop_run`` asked this attempt to stop: a long handler may check
        it and return early (the attempt then ends ``cancelled``); the handler is interrupted
        anyway (a sync one as by a timeout, an ``async def`` one's task cancelled)."""
        return self.stop_event.is_set()

    def progress(self, value: float | None = None, note: str | None = None) -> None:
        """Report how far this attempt is: ``value`` from 0.0 to 1.0, a short ``note`` (at
        most 200 characters, one line); ``None`` keeps the one reported before.
        ``runner.running()``, ``kumiko busy`` and the dashboard show the latest within a
        second. Cheap in a tight loop: it never waits for Redis, and writes are coalesced
        (at most about two a second per attempt; :mod:`kumiko_dramatiq.progress`). Bad input
        raises :class:`~kumiko_dramatiq.errors.PayloadError` (a ``ValueError``) naming the
        job and the value."""
        checked = check_progress(self.job_name, value, note)
        if self._progress is not None:
            self._progress.report(*checked)

    @property
    def tenant_id(self) -> str | None:
        return self.meta.tenant_id

    @property
    def attempt(self) -> int:
        return self.meta.attempt

    @property
    def trigger(self) -> Trigger:
        return self.meta.trigger

    @property
    def scheduled_at(self) -> datetime | None:
        """The tick a cron run belongs to (aware), else ``None``."""
        return self.meta.scheduled_at

    #: the batch of a batch child or callback (``.id``, ``.results()``, ``.add(job, payload)``:
    #: :class:`~kumiko_dramatiq.workflows.batches.BatchHandle`), else ``None``
    batch: BatchHandle | None = field(default=None, compare=False)
    #: reads ``previous_result`` (a chain step's child), else ``None``
    previous_reader: Callable[[], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def previous_result(self) -> Any:
        """In a chain, the value the step before returned (a group: the list of its values in
        order); ``None`` in the first step and outside chains. Read when asked (one read)."""
        return None if self.previous_reader is None else self.previous_reader()
