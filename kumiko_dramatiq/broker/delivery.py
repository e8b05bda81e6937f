"""What one delivery is, and what its ack writes: :class:`Delivery`, :class:`Settlement`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

from dramatiq.broker import MessageProxy
from dramatiq.message import Message

if TYPE_CHECKING:
    from kumiko_dramatiq.broker.consumer import KumikoConsumer

#: A delivery's place in the hold protocol (:mod:`kumiko_dramatiq.broker.holds`): claimed to
#: run now; held (claimed ahead of the threads); started from a hold, its report not confirmed
#: yet; started and confirmed; dropped (an ask, or its consumer closing: it never starts);
#: given back (its hold ran out and could not be renewed: it goes back to its queue unrun, or
#: its unconfirmed run was interrupted); revoked (its start was reported too late: it was taken
#: over, and nothing of the run is written).
HoldState = Literal["now", "held", "started", "confirmed", "dropped", "given_back", "revoked"]


@dataclass(frozen=True)
class RunWrite:
    """A run record the settle call writes (see :mod:`kumiko_dramatiq.ops.history`)."""

    message_id: str
    attempt: int
    job: str
    #: the run's status; "" drops the running record (a hand-off, no attempt)
    status: str
    tenant: str
    origin: str
    record: str
    dead_note: str
    #: the attempt's start (ms): the run history orders records by it (its enqueue time if
    #: it never started; None: the time of the write)
    started_ms: int | None = None


@dataclass
class Settlement:
    """What the ack of one delivery writes besides the ack itself (one Lua call in all).

    ``retry``: the prepared retry of a failed attempt and its delay, enqueued with the ack;
    ``handoff``: likewise, a sequential job's hand-off (a new message) when its lock is held;
    ``completed``: the message completed, so the ack also writes its "already completed"
    marker (at most one of the three is set); ``run``: the run record to write.
    ``requeue``: the run was cut short (fenced: its lease could not be renewed), so instead of
    an ack the message goes back to its queue as if never delivered (``lua/requeue.lua``),
    like a run cut short by a crash; nothing else is written.
    ``dedup``: the job ended for good holding a dedup key, (the job's index of live keys, the
    message id, the key): the ack frees the key's record if it still points at this message
    (``lua/settle.lua``); if a trigger during the run left a follow-up in it, that settle
    writes nothing of the delivery, and the ack calls :meth:`hand_over_dedup` (which runs
    ``dedup_hand_over``, set by :class:`~kumiko_dramatiq.middleware.dedup.Dedup`: it enqueues
    the follow-up and points the key at it) before it settles the delivery again without the
    key. So a worker killed in between leaves an unacknowledged message, redelivered, never
    an acknowledged one whose follow-up nobody enqueues.
    ``result``: the end of a job that keeps results, as ``lua/settle.lua`` takes it
    (:func:`kumiko_dramatiq.workflows.results.result_write`): its value and TTL, ``"-"``
    for a dead end (its waiters are told), ``""`` for none.
    ``batch``: the batch the message belongs to, as ``lua/settle.lua`` takes it
    (:func:`kumiko_dramatiq.workflows.batches.batch_write`), ``""`` for none.
    """

    retry: tuple[Message[Any], int | None] | None = None
    handoff: tuple[Message[Any], int | None] | None = None
    completed: bool = False
    run: RunWrite | None = None
    requeue: bool = False
    dedup: tuple[str, str, str] | None = None
    dedup_hand_over: Callable[[], None] | None = None
    result: str = ""
    batch: str = ""

    def hand_over_dedup(self) -> None:
        """The settle left this delivery for its dedup key's follow-up: hand the key over
        (``dedup_hand_over``), after which the delivery is settled without ``dedup``."""
        hand_over, self.dedup, self.dedup_hand_over = self.dedup_hand_over, None, None
        if hand_over is not None:
            hand_over()


class Delivery(MessageProxy):
    """One delivery of a message to this worker: Dramatiq's proxy, plus the queue and redis
    id it was fetched under, what its ack should write (:class:`Settlement`) and kumiko's
    per-delivery state (``execution``, opened at fetch by the broker's message policy:
    :mod:`kumiko_dramatiq.worker.execution`)."""

    def __init__(
        self,
        message: Message[Any],
        *,
        fetched_from: str,
        redis_message_id: str,
        encoded_bytes: int = 0,
    ) -> None:
        super().__init__(message)
        self.message = message
        # the fields every hook reads, kept here (Dramatiq's proxy looks each one up through
        # ``__getattr__``, about 20 times per delivery); the message is frozen
        self.queue_name = message.queue_name
        self.actor_name = message.actor_name
        self.args = message.args
        self.kwargs = message.kwargs
        self.options = message.options
        self.message_id = message.message_id
        self.message_timestamp = message.message_timestamp
        self.fetched_from = fetched_from
        self.redis_message_id = redis_message_id
        #: the size of the encoded message as fetched (0: not known)
        self.encoded_bytes = encoded_bytes
        self.settlement = Settlement()
        #: kumiko's state of this delivery (an ``Execution``, opened by the broker's
        #: ``message_policy`` at fetch), ``None`` for a message of a plain actor
        self.execution: object | None = None
        #: when a worker thread started processing it (epoch seconds; set by the broker)
        self.started_at = 0.0
        #: the slot of a capped job (``max_running``) the fetch took for it: (slots key,
        #: owner token), given back by its settle; and when that fetch was sent (monotonic
        #: seconds: the lease runs from then at the latest)
        self.slot: tuple[str, str] | None = None
        self.slot_sent_at = 0.0
        #: its place in the hold protocol, and the consumer it came from (it hands it out,
        #: starts it at the gate and settles it)
        self.hold: HoldState = "now"
        self.consumer: KumikoConsumer | None = None
        #: when it was held (monotonic s)
        self.held_at = 0.0
        #: the gate refused to start it (dropped or given back unstarted): no hook saw it
        self.refused = False


#: The bits of a delivery's settle reply (``KumikoBroker.settle``): the delivery was (or
#: became again) this worker's; it was left unsettled for its dedup key's follow-up.
SETTLED_MINE: Final = 1
DEDUP_FOLLOW_UP: Final = 2

#: What ``settle`` does with a delivery: forget it ("ack"), forget it and mark its id
#: completed, forget it and enqueue its retry, or dead-letter it.
Outcome = Literal["ack", "completed", "retry", "dead"]


class MessagePolicy(Protocol):
    """What the broker's owner says about the messages its consumers fetch."""

    def admit(self, delivery: Delivery) -> str | None:
        """Why ``delivery``'s decoded message must be dead-lettered, or ``None``: it may run
        (then ``delivery.execution`` is set for a message of one of the owner's jobs)."""

    def rejected(self, message: Message[Any]) -> None:
        """``message`` was dead-lettered by ``admit``, before it ran: clean up after it."""


@dataclass(frozen=True)
class LaneFetch:
    """What one ``fetch_lane`` call claimed and decided."""

    fetched: list[tuple[str, bytes | None]]
    #: message ids acked unrun because they already completed
    completed: list[str]
    #: (redis id, deliveries) of poison messages dead-lettered
    buried: list[tuple[str, int]]
    #: suspects (messages whose worker died) waiting to run alone
    suspects_waiting: int
    #: the one message fetched is a suspect that runs alone
    alone: bool
    #: redis id -> (slots key, owner token) of the capped jobs' slots the fetch took
    slots: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: ms until the fetch should look at waiting capped messages again (None: none wait, or
    #: the queue has no capped jobs)
    caps_due_in_ms: int | None = None
    #: how many of ``fetched`` (the first) were claimed to run now; the rest are held
    now: int = 0
