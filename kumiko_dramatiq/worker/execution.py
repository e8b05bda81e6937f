"""``Execution``: kumiko's typed state of one delivery of one of its messages.

The broker's message policy (:class:`KumikoMessages`) checks every fetched message of one of
the runner's jobs before Dramatiq's worker sees it: it decodes the kumiko options strictly
(:meth:`~kumiko_dramatiq.codec.KumikoOptions.decode`) and checks the shape (exactly one
positional argument, a JSON object; no keyword arguments). Anything kumiko did not write is
dead-lettered by the consumer with a logged reason: never run, never silently acked, never
left to come back. A message that passes gets its :class:`Execution` right there, kept on
the :class:`~kumiko_dramatiq.broker.delivery.Delivery` (``delivery.execution``): decoded once,
at fetch. Every middleware reads it with :func:`execution_of`; the actor body, which Dramatiq
calls with the payload only, finds it through the broker's running deliveries
(:meth:`~kumiko_dramatiq.broker.broker.KumikoBroker.current`). Messages of actors kumiko did
not declare pass untouched and have none. Nothing travels in untyped attributes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from dramatiq.broker import MessageProxy
from dramatiq.message import Message

from kumiko_dramatiq.broker.delivery import Delivery
from kumiko_dramatiq.codec import KumikoOptions, OptionsError
from kumiko_dramatiq.context import JobMeta
from kumiko_dramatiq.errors import PayloadError
from kumiko_dramatiq.limits import DEFAULT_MAX_PAYLOAD_BYTES, check_payload
from kumiko_dramatiq.worker.fencing import LeaseLost
from kumiko_dramatiq.worker.interrupts import Interruptible
from kumiko_dramatiq.worker.stops import StopRequested

if TYPE_CHECKING:
    from kumiko_dramatiq.registry import JobDefinition, Registry
    from kumiko_dramatiq.worker.progress import ProgressReport


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
    #: The handler call, which another thread may interrupt (a lease that could not be
    #: renewed, :mod:`kumiko_dramatiq.worker.fencing`).
    interruptible: Interruptible = field(default_factory=Interruptible)
    #: Set once ``runner.stop_run`` asked this run to stop (``ctx.stop_requested``;
    #: :mod:`kumiko_dramatiq.worker.stops`).
    stop: threading.Event = field(default_factory=threading.Event)
    #: What the handler returned, encoded (a job with ``keep_result_s`` whose handler
    #: returned: :func:`kumiko_dramatiq.workflows.results.encode_result`), else ``None``.
    result: str | None = None
    #: Where the handler's ``ctx.progress`` goes (set with its context,
    #: :mod:`kumiko_dramatiq.worker.progress`); closed when the handler call ends.
    progress: ProgressReport | None = None

    def __post_init__(self) -> None:
        self.meta = self.options.meta()
        self.message_id = str(self.delivery.message.message_id)

    @property
    def started_at(self) -> float:
        """When a worker thread started processing the delivery (epoch seconds)."""
        return self.delivery.started_at

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

    def no_retry(self) -> None:
        """Make this attempt the message's last whatever its count: it fails in a way no
        retry can fix (its payload no longer validates). Sets ``meta.no_retry``, so
        ``Retries`` dead-letters it, ``Dedup`` frees its key and the hooks and the run
        record see a final attempt."""
        self.meta = replace(self.meta, no_retry=True)

    @property
    def fenced(self) -> bool:
        """Whether the run was cut short because its lease could not be renewed
        (:class:`~kumiko_dramatiq.worker.fencing.LeaseLost`, or its hold's
        :class:`~kumiko_dramatiq.worker.fencing.HoldLost`): like a run cut short by a crash,
        it spends no attempt, calls no failure hook and comes back; its lease is not released
        (it is no longer the run's). A run that completed as the interruption came is not."""
        run = self.interruptible
        lost = run.interrupted_by
        return run.raised and lost is not None and issubclass(lost, LeaseLost)

    @property
    def stopped(self) -> bool:
        """Whether ``runner.stop_run`` interrupted the handler call (or stopped it before it
        started): the attempt ends ``cancelled``, is not retried and frees its dedup key."""
        return self.interruptible.interrupted_by is StopRequested


def execution_of(message: MessageProxy | None) -> Execution | None:
    """The execution of a delivery, or ``None`` (a foreign actor, or not opened yet)."""
    if isinstance(message, Delivery) and isinstance(message.execution, Execution):
        return message.execution
    return None


class KumikoMessages:
    """The broker's :class:`~kumiko_dramatiq.broker.delivery.MessagePolicy` for a runner's
    jobs: ``admit`` checks a fetched message and opens its :class:`Execution`; ``rejected``
    frees the dedup key of a message dead-lettered there."""

    def __init__(
        self,
        registry: Registry,
        rejected: Callable[[Message[Any]], None],
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        self.registry = registry
        self._rejected = rejected
        self.max_payload_bytes = max_payload_bytes

    def admit(self, delivery: Delivery) -> str | None:
        message = delivery.message
        found = self.registry.actor(message.actor_name)
        if found is None:
            return None
        job, is_wrapper = found
        try:
            options = KumikoOptions.decode(message.options)
        except OptionsError as exc:
            return f"{message.actor_name}: unreadable options ({exc})"
        problem = _shape_problem(message.args, message.kwargs) or _tenant_problem(
            job, is_wrapper, options
        )
        if problem is None:
            try:
                check_payload(
                    message.actor_name,
                    message.args[0],
                    max_bytes=self.max_payload_bytes,
                    encoded_bound=delivery.encoded_bytes or None,
                )
            except PayloadError as exc:
                problem = str(exc).removeprefix(f"{message.actor_name}: ")
        if problem is not None:
            return f"{message.actor_name}: {problem}"
        delivery.execution = Execution(job, delivery, options, is_wrapper)
        return None

    def rejected(self, message: Message[Any]) -> None:
        self._rejected(message)


def _tenant_problem(job: JobDefinition, is_wrapper: bool, options: KumikoOptions) -> str | None:
    """A tenant where the message cannot have one, or none where it must: only a per-tenant
    job's children carry one (its wrapper resolves the tenants)."""
    child = job.options.per_tenant and not is_wrapper
    if child and options.tenant_id is None:
        return "a per-tenant child must carry a tenant id"
    if not child and options.tenant_id is not None:
        kind = "a per-tenant wrapper" if is_wrapper else "a job that is not per-tenant"
        return f"{kind} must not carry a tenant id, got {options.tenant_id!r:.80}"
    return None


def _shape_problem(args: Any, kwargs: Any) -> str | None:
    if kwargs:
        return f"unexpected keyword arguments {sorted(kwargs)!r}"
    if len(args) != 1 or not isinstance(args[0], dict):
        kinds = ", ".join(type(arg).__name__ for arg in args) if isinstance(args, list) else "?"
        return f"expected one JSON object argument, got ({kinds})"
    return None
