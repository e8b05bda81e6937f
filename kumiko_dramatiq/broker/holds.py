"""Holds: messages a worker claimed ahead of its threads, and the asks about them.

A thread that ends a job starts its next one at once, from what its consumer holds: every
claim (a fetch, or the claim folded into a settle) takes up to twice the worker's threads,
the ones a free thread can start now *running* and the rest *held* (``lua/include/inflight.lua``).
A held message is not running anywhere: not in the counts, ``kumiko busy`` or a cap's slots.
The worker reports its start in its next lane call (a settle batch, a fetch, or the keeper's
renewal: the *hold block*, ``lua/include/holds.lua``), which makes it running in Redis.

That a worker holds messages its threads have not started must not weaken ``cancel``'s
promise ("a queued message never starts, even one a worker holds ready to run next"): a
cancel, purge, pause or stop_run that finds a message held *asks* its worker
(``<root>asks:<broker id>``, its keeper woken by a doorbell). Every lane call the worker makes
returns the asks pending, and the worker answers each: *dropped* (it was held, it never starts;
the answer's Lua call does what was asked: cancels it, deletes it or puts it back), *started*,
or for a probe *held*. So ``cancel`` of a held message returns True once the worker dropped it,
False if it had started, usually within a few milliseconds.

**The hold is a lease, fenced like a sequential lock.** A worker may start a held message only
while its *hold* is valid: until :data:`START_UNTIL` x :data:`HOLD_TTL_MS` after it sent the
newest lane call whose reply it has applied (asks first, then the new validity: a reply that
carries an ask about a message drops that message before it renews anything). A requester
whose ask gets no answer waits :data:`HOLD_TTL_MS` plus :data:`TAKEOVER_SLACK_MS` from when its
ask returned, then takes the message over itself (``lua/hold_takeover.lua``): by then the
worker has applied no reply sent after the ask without dropping the message, so it starts it
no more, however dead, frozen or cut off it is. A start the worker made but could not report
before its hold ran out (it was cut off just after) is *provisional*: the worker interrupts that
run when its hold runs out (and ends its process if the run cannot be interrupted, as the
sequential fence does, :mod:`kumiko_dramatiq.worker.fencing`), so a message taken over is not
running anywhere once the requester answers. Such a run counts as never started: no record of
it was written, it runs again later if nobody cancelled it. After its hold ran out, the worker's
next call checks which of its held messages are still its own before it starts any.

The keeper (a daemon thread per broker, alive while the broker holds or runs unconfirmed
starts) keeps the hold valid when no other call does, every :data:`RENEW_EVERY_S`, and
wakes at once on an ask (``BLPOP`` on ``<root>askbell:<broker id>``).

A ``kill -9`` leaves a worker's held messages in its ack set; maintenance puts them back
like any claimed message, and the next fetch claims them again like any other (their
deliveries counted: one may have started just before the death), unless one was held or
running during two deaths: then it is a suspect and runs alone (``lua/include/lane_claim.lua``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import redis

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.outage import Outage
from kumiko_dramatiq.broker.replies import text

if TYPE_CHECKING:
    from kumiko_dramatiq.broker.broker import KumikoBroker
    from kumiko_dramatiq.broker.delivery import Delivery

logger = logging.getLogger("kumiko_dramatiq")

#: The lease of a worker's hold (ms): it starts held messages until START_UNTIL of it after
#: its newest applied lane call was sent; a requester takes over after it (plus the slack).
HOLD_TTL_MS: Final = 1_200
#: The fractions of the lease as the sequential fence has them
#: (:mod:`kumiko_dramatiq.worker.fencing`): held messages start until the first; a run
#: started from the hold and not confirmed by then is interrupted, and if it still runs at
#: the second its process ends.
START_UNTIL: Final = 0.75
END_PROCESS_AT: Final = 0.9
#: What a requester adds to the hold's lease before it takes a message over: clocks that run
#: at slightly different rates, and the answer of a worker that was just in time.
TAKEOVER_SLACK_MS: Final = 200
#: How often the keeper renews a hold that no other call renewed (s).
RENEW_EVERY_S: Final = HOLD_TTL_MS / 4000
#: How long a worker remembers an ask about a message it does not know (yet: the reply that
#: claimed it may be applied after the one that brought the ask) (s).
UNKNOWN_ASK_S: Final = 3 * HOLD_TTL_MS / 1000
#: The keeper ends after this long with nothing held.
KEEPER_IDLE_S: Final = 5.0
#: Holding a message ahead pays while jobs are short (the thread that ends one starts the next
#: without a round trip, and the settles of several share one call); behind a long job it
#: keeps the message from a worker that is free. So a worker holds messages ahead only while
#: its jobs take less than this on average (s), and gives back one held longer than this.
HOLD_AHEAD_UNTIL_S: Final = 1.0

#: What the worker does to a run started from a hold that must not go on: ``enforce(delivery,
#: end_at)`` interrupts it now and ends its process at ``end_at`` (monotonic s) if it still
#: runs then (``None``: its message was taken over, interrupting it is all). Set by the
#: runner's worker side (:meth:`kumiko_dramatiq.worker.runtime.Runtime.attach`); without one
#: nothing is interrupted.
Enforce = Callable[["Delivery", "float | None"], None]


@dataclass(frozen=True)
class HoldReply:
    """What a lane call's hold block came back with (``hold_report`` in
    ``lua/include/holds.lua``): starts that came too late, checked messages no longer this
    worker's, and the asks pending: (redis id, request id, kind)."""

    revoked: list[str]
    gone: list[str]
    asks: list[tuple[str, str, str]]

    @classmethod
    def decode(cls, reply: Sequence[Any]) -> HoldReply:
        revoked, gone, asks = reply
        pending = []
        for i in range(0, len(asks), 2):
            request, _, rest = text(asks[i + 1]).partition("\t")
            pending.append((text(asks[i]), request, rest.partition("\t")[0]))
        return cls([text(r) for r in revoked], [text(g) for g in gone], pending)


@dataclass
class HoldBlock:
    """The hold block of one lane call: its arguments, and what it carries (the starts it
    reports, the held messages whose claims it checks), for :meth:`Holds.applied`."""

    queue: str
    args: list[str]
    starts: dict[str, int] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)
    #: when the call was (about to be) sent, monotonic s
    sent_at: float = 0.0


def lease_valid_until(sent_at_s: float, ttl_ms: int = HOLD_TTL_MS) -> float:
    """Until when a hold renewed by a call sent at ``sent_at_s`` lets held messages start
    (monotonic s). Pure."""
    return sent_at_s + START_UNTIL * ttl_ms / 1000


def takeover_after_s(ttl_ms: int = HOLD_TTL_MS) -> float:
    """How long after its ask returned a requester waits before it takes a held message over.
    Pure."""
    return (ttl_ms + TAKEOVER_SLACK_MS) / 1000


class Holds:
    """The hold of one broker's consumers (see the module docstring)."""

    def __init__(self, broker: KumikoBroker, *, ttl_ms: int = HOLD_TTL_MS) -> None:
        self._broker = broker
        self.ttl_ms = ttl_ms
        self._lock = threading.Lock()
        #: the send time of the newest lane call whose reply was applied (monotonic s)
        self._renewed_at = float("-inf")
        self._held: dict[str, Delivery] = {}
        #: started from a hold, the start not confirmed yet
        self._started: dict[str, Delivery] = {}
        #: starts not sent yet: redis id -> (queue, start ms)
        self._reports: dict[str, tuple[str, int]] = {}
        #: asks about messages not known here (yet): redis id -> (kind, forget after)
        self._unknown: dict[str, tuple[str, float]] = {}
        #: answers to send: (queue, redis id, outcome, the delivery dropped or None)
        self._answers: list[tuple[str, str, str, Delivery | None]] = []
        self._keeper: threading.Thread | None = None
        self._pid = os.getpid()
        self._bell: redis.Redis | None = None
        self._bell_id = 0
        self._outage = Outage(f"the hold of broker {broker.broker_id}")
        self.enforce: Enforce | None = None

    # -- the state -------------------------------------------------------------------------
    @property
    def valid(self) -> bool:
        return time.monotonic() < lease_valid_until(self._renewed_at, self.ttl_ms)

    def holding(self) -> int:
        """How many messages are held (claimed ahead, not started)."""
        return len(self._held)

    def reports_waiting(self) -> bool:
        return bool(self._reports)

    def hold(self, delivery: Delivery) -> None:
        """``delivery`` was claimed ahead of the threads: it waits for a free one. An ask that
        came before the reply that claimed it is answered now (a cancel's drops it)."""
        rid = delivery.redis_message_id
        delivery.held_at = time.monotonic()
        with self._lock:
            delivery.hold = "held"
            self._held[rid] = delivery
            asked = self._unknown.pop(rid, None)
            if asked is not None:
                self._answer_locked(delivery.fetched_from, rid, asked[0], time.monotonic())
        if asked is not None:
            self.send_answers()
        self._ensure_keeper()

    def begin(self, delivery: Delivery) -> bool:
        """The gate of a delivery's start (its worker thread, before any middleware): whether
        it may run. A held one starts while the hold is valid (its start reported in the next
        lane call); one dropped meanwhile does not; with the hold run out, it is renewed first
        (a check of what is still this worker's), retried until Redis answers."""
        while True:
            with self._lock:
                state = delivery.hold
                if state != "held":
                    return state not in ("dropped", "given_back", "revoked")
                if self.valid:
                    rid = delivery.redis_message_id
                    del self._held[rid]
                    delivery.hold = "started"
                    self._started[rid] = delivery
                    self._reports[rid] = (delivery.fetched_from, int(time.time() * 1000))
                    break
            if not self._renew_for(delivery):
                return False
        self._ensure_keeper()
        return True

    def _renew_for(self, delivery: Delivery) -> bool:
        """Renew the run-out hold before ``delivery`` may start: ``True`` to look again;
        ``False`` if the worker is stopping and Redis does not answer (the delivery is given
        back: it goes back to its queue unrun)."""
        try:
            self.renew(delivery.fetched_from)
            return True
        except redis.RedisError as exc:
            wait = self._outage.failed(exc)
            if self._broker.stopping:
                with self._lock:
                    if delivery.hold == "held":
                        self._held.pop(delivery.redis_message_id, None)
                        delivery.hold = "given_back"
                return True
            time.sleep(wait)
            return True

    def ended(self, delivery: Delivery) -> None:
        """``delivery`` ended (its settle is on its way): its start needs no confirmation, and
        one settled without a start (a consumer driven by hand) is held no more."""
        if delivery.hold != "now":
            with self._lock:
                self._started.pop(delivery.redis_message_id, None)
                if self._held.get(delivery.redis_message_id) is delivery:
                    del self._held[delivery.redis_message_id]

    def drop_all(self, queue: str) -> list[str]:
        """Drop every held message of ``queue`` (its consumer closes: they go back to the
        queue); their redis ids."""
        with self._lock:
            gone = [rid for rid, each in self._held.items() if each.fetched_from == queue]
            for rid in gone:
                self._held.pop(rid).hold = "dropped"
        return gone

    # -- lane calls ------------------------------------------------------------------------
    def block(self, queue: str) -> HoldBlock:
        """The hold block of a lane call on ``queue`` about to be sent: the starts of its held
        messages not reported yet, and (the hold having run out) the held messages to check."""
        with self._lock:
            starts = {rid: ms for rid, (each, ms) in self._reports.items() if each == queue}
            for rid in starts:
                del self._reports[rid]
            checks = []
            if not self.valid:
                checks = [rid for rid, each in self._held.items() if each.fetched_from == queue]
        args = [f"{len(starts)} {len(checks)}"]
        for rid, ms in starts.items():
            args += [rid, str(ms)]
        args += checks
        return HoldBlock(queue, args, starts, checks, time.monotonic())

    def failed(self, block: HoldBlock) -> None:
        """The call carrying ``block`` got no reply: its starts go with the next one (a
        report made twice changes nothing)."""
        with self._lock:
            for rid, ms in block.starts.items():
                if rid in self._started:
                    self._reports.setdefault(rid, (block.queue, ms))

    def applied(self, block: HoldBlock, reply: HoldReply) -> None:
        """Apply the reply of the call that carried ``block``: the asks first (held messages
        asked about never start), the revoked starts interrupted, the checked messages no
        longer this worker's dropped, its starts confirmed; then the hold counts as renewed
        as of the call's sending. Answers are sent from here (one more call, when there are)."""
        interrupt: list[Delivery] = []
        now = time.monotonic()
        with self._lock:
            for rid, _request, kind in reply.asks:
                self._answer_locked(block.queue, rid, kind, now)
            for rid in reply.revoked:
                delivery = self._started.pop(rid, None)
                if delivery is not None and delivery.hold == "started":
                    delivery.hold = "revoked"
                    interrupt.append(delivery)
            for rid in reply.gone:
                delivery = self._held.pop(rid, None)
                if delivery is not None:
                    delivery.hold = "dropped"
            for rid in block.starts:
                delivery = self._started.pop(rid, None)
                if delivery is not None and delivery.hold == "started" and rid not in reply.revoked:
                    delivery.hold = "confirmed"
            self._renewed_at = max(self._renewed_at, block.sent_at)
            for rid, (_kind, until) in list(self._unknown.items()):
                if until < now:
                    del self._unknown[rid]
        self._outage.succeeded()
        for delivery in interrupt:
            logger.error(
                "message %s: its start from a hold was reported after the hold ran out and "
                "the message was taken over (cancelled, purged or put back): interrupting it",
                delivery.message_id,
            )
            if self.enforce is not None:
                self.enforce(delivery, None)
        if self._answers:
            self.send_answers()

    def _answer_locked(self, queue: str, rid: str, kind: str, now: float) -> None:
        held = self._held.get(rid)
        if held is not None:
            dropped = None
            if kind != "probe":
                del self._held[rid]
                held.hold = "dropped"
                dropped = held
            self._answers.append((queue, rid, _outcome(kind), dropped))
        elif rid in self._started or rid in self._reports:
            self._answers.append((queue, rid, "started", None))
        else:
            # not known here: settled (a later call answers it), or claimed by a reply not
            # applied yet (hold() drops it when it is)
            self._unknown[rid] = (kind, now + UNKNOWN_ASK_S)

    def send_answers(self) -> None:
        """Send the answers waiting (``lua/hold_answer.lua``); kept for the keeper to retry
        when Redis fails."""
        with self._lock:
            answers, self._answers = self._answers, []
        if not answers:
            return
        broker = self._broker
        by_queue: dict[str, list[str]] = {}
        for queue, rid, outcome, _ in answers:
            by_queue.setdefault(queue, []).extend((rid, outcome))
        try:
            for queue, pairs in by_queue.items():
                broker.lua.hold_answer(
                    keys=[broker.namespace],
                    args=[
                        *broker.command_head(queue, maintenance=False),
                        keys.root(broker.queue_prefix),
                        broker.hold_ttls(),
                        *pairs,
                    ],
                    client=broker.thread_client(),
                )
        except redis.RedisError as exc:
            logger.warning("could not answer %d ask(s) about held messages (%s)", len(answers), exc)
            with self._lock:
                self._answers[:0] = answers
            self._ensure_keeper()
        for _, _, _, delivery in answers:
            if delivery is not None and delivery.consumer is not None:
                delivery.consumer.dropped(delivery)

    def renew(self, queue: str) -> None:
        """One ``lua/hold_renew.lua`` call on ``queue``: the hold renewed, the starts reported,
        the asks read and answered (raises the Redis error)."""
        broker = self._broker
        block = self.block(queue)
        try:
            reply = broker.lua.hold_renew(
                keys=[broker.namespace],
                args=[
                    *broker.command_head(queue, maintenance=False),
                    keys.root(broker.queue_prefix),
                    *block.args,
                ],
                client=broker.thread_client(),
            )
        except BaseException:
            self.failed(block)
            raise
        self.applied(block, HoldReply.decode(reply))

    # -- the keeper ------------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self._held or self._started or self._answers or self._reports)

    def _ensure_keeper(self) -> None:
        # cleared by the keeper itself, under the lock, as it ends (a forked child has none)
        if self._keeper is not None and self._pid == os.getpid():
            return
        with self._lock:
            if self._keeper is not None and self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self._keeper = threading.Thread(
                target=self._keep, name=f"kumiko-holds-{self._broker.queue_prefix}", daemon=True
            )
            self._keeper.start()

    def wake_keeper(self) -> None:
        """Start the keeper if something is held (the consumer handed held messages out)."""
        if self._busy():
            self._ensure_keeper()

    def _keep(self) -> None:
        idle_since: float | None = None
        while True:
            with self._lock:
                busy = self._busy()
            now = time.monotonic()
            if not busy:
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= KEEPER_IDLE_S or self._broker.closed:
                    with self._lock:
                        if not self._busy():
                            self._keeper = None
                            self._close_bell()
                            return
                time.sleep(RENEW_EVERY_S)
                continue
            idle_since = None
            due_in = self._renewed_at + RENEW_EVERY_S - now
            rung = False
            try:
                self._lapse_check(now)
                self._give_back_stale(now)
                if due_in > 0 and not self._answers and not self._reports_stale(now):
                    rung = self._wait_bell(min(due_in, self._next_stale_in(now)))
                if self._answers:
                    self.send_answers()
                if rung or self._reports or time.monotonic() >= self._renewed_at + RENEW_EVERY_S:
                    for queue in self._queues():
                        self.renew(queue)
            except redis.RedisError as exc:
                self._close_bell()
                time.sleep(self._outage.failed(exc))
            except Exception:  # the keeper must go on: the hold depends on it
                logger.exception("the keeper of broker %s failed; going on", self._broker.broker_id)
                time.sleep(RENEW_EVERY_S)

    def _next_stale_in(self, now: float) -> float:
        """How long until the first held message is held too long (s)."""
        with self._lock:
            oldest = min((each.held_at for each in self._held.values()), default=None)
        return RENEW_EVERY_S if oldest is None else max(0.01, oldest + HOLD_AHEAD_UNTIL_S - now)

    def _reports_stale(self, now: float) -> bool:
        """Whether starts wait to be reported (the settles report them, else the keeper
        within a renewal period)."""
        return bool(self._reports) and now >= self._renewed_at + RENEW_EVERY_S / 2

    def _queues(self) -> list[str]:
        with self._lock:
            found = {each.fetched_from for each in (*self._held.values(), *self._started.values())}
            found |= {queue for queue, _ in self._reports.values()}
        return sorted(found) or ([self._broker.lane_queue] if self._broker.lane_queue else [])

    def _lapse_check(self, now: float) -> None:
        """Interrupt the runs started from a hold that ran out before their starts were
        confirmed (the fence ends the process if one cannot be interrupted in time)."""
        valid_until = lease_valid_until(self._renewed_at, self.ttl_ms)
        if now < valid_until:
            return
        with self._lock:
            lapsed = [d for d in self._started.values() if d.hold == "started"]
        end_at = self._renewed_at + END_PROCESS_AT * self.ttl_ms / 1000
        for delivery in lapsed:
            delivery.hold = "given_back"  # its message goes back to its queue, if still ours
            logger.error(
                "message %s: started from a hold that ran out before its start was reported "
                "(Redis did not answer): interrupting it; it runs again later, no attempt spent",
                delivery.message_id,
            )
            if self.enforce is not None:
                self.enforce(delivery, max(end_at, now))

    def _give_back_stale(self, now: float) -> None:
        """Give back the messages held longer than :data:`HOLD_AHEAD_UNTIL_S` (their threads
        are busy with longer jobs): back to their queue, their deliveries undone, for a worker
        that is free (``lua/requeue.lua``). One Redis refuses stays held."""
        with self._lock:
            stale = [
                each
                for each in self._held.values()
                if now - each.held_at >= HOLD_AHEAD_UNTIL_S and each.consumer is not None
            ]
            for each in stale:
                del self._held[each.redis_message_id]
                each.hold = "dropped"
        for each in stale:
            assert each.consumer is not None
            try:
                self._broker.do_requeue(each.fetched_from, each.redis_message_id)
            except redis.RedisError as exc:
                logger.debug("could not give back a held message (%s)", exc)
                with self._lock:
                    each.hold = "held"
                    self._held[each.redis_message_id] = each
                continue
            each.consumer.dropped(each)

    def _wait_bell(self, timeout_s: float) -> bool:
        """Wait on the broker's ask doorbell up to ``timeout_s``; whether it rang."""
        broker = self._broker
        if self._bell is None:
            self._bell = redis.Redis(
                connection_pool=broker.client.connection_pool, single_connection_client=True
            )
        timeout_s = max(0.01, timeout_s)
        limit_s = broker.client.connection_pool.connection_kwargs.get("socket_timeout")
        if limit_s:
            timeout_s = min(timeout_s, max(0.01, limit_s - 0.2))
        try:
            return (
                self._bell.blpop(
                    [keys.hold_bell(broker.queue_prefix, broker.broker_id)], timeout=timeout_s
                )
                is not None
            )
        except redis.RedisError:
            self._close_bell()
            raise

    def _close_bell(self) -> None:
        bell, self._bell = self._bell, None
        if bell is not None:
            with contextlib.suppress(redis.RedisError):
                bell.close()


def new_request_id() -> str:
    """The id of one ask (a cancel, purge, pause or stop_run's): its answers' list's name."""
    return uuid.uuid4().hex


def _outcome(kind: str) -> str:
    """A worker's answer about a message it holds, asked for ``kind``."""
    return "held" if kind == "probe" else "dropped"
