"""``Execution``: kumiko's typed state of one delivery of one of its messages.

Opened by :class:`~kumiko_dramatiq.executions.Executions` in ``before_process_message`` and
kept on the :class:`~kumiko_dramatiq.broker.Delivery` (``delivery.execution``); every other
middleware reads it with :func:`execution_of`. Nothing travels in untyped attributes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dramatiq.broker import MessageProxy

from .broker import Delivery
from .codec import KumikoOptions
from .context import JobMeta

if TYPE_CHECKING:
    from .registry import JobDefinition


@dataclass(frozen=True)
class Lease:
    """A sequential lock this delivery holds: its key and owner token."""

    lock_key: str
    token: str


@dataclass
class Execution:
    """One delivery of one kumiko message on a worker thread."""

    job: JobDefinition
    delivery: Delivery
    options: KumikoOptions
    is_wrapper: bool
    meta: JobMeta = field(init=False)
    message_id: str = field(init=False)
    #: The sequential lock this run holds (set by ``Sequential`` when it takes it).
    lease: Lease | None = None
    #: The message this one handed its run off to (``Sequential``, lock held): the actor
    #: body, the hooks and the retries then do nothing and no attempt is spent.
    handoff_id: str | None = None
    #: When the delivery reached the worker thread (epoch seconds).
    started_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.meta = self.options.meta()
        self.message_id = str(self.delivery.message.message_id)

    @property
    def origin_id(self) -> str:
        """The id the caller got back for the work this delivery carries on."""
        return self.options.origin_id or self.message_id

    def log_fields(self) -> dict[str, object]:
        """The run's identity for a log record's ``extra=`` (a JSON formatter shows them)."""
        return {
            "job": self.job.qualified_name,
            "message_id": self.message_id,
            "origin_id": self.origin_id,
            "tenant_id": self.meta.tenant_id,
            "trigger": self.meta.trigger,
            "attempt": self.meta.attempt,
        }

    @property
    def handed_off(self) -> bool:
        return self.handoff_id is not None


def execution_of(message: MessageProxy) -> Execution | None:
    """The execution of a delivery, or ``None`` (a foreign actor, or not opened yet)."""
    if isinstance(message, Delivery) and isinstance(message.execution, Execution):
        return message.execution
    return None
