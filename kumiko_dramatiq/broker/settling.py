"""Settling: what the end of a delivery writes, and the thread that sends it.

A worker thread that ends a kumiko delivery does not wait for Redis: its consumer's ack builds
the delivery's :class:`SettleEntry` (the outcome, the run record, the retry or hand-off, the
dedup key it frees, the capped slot it gives back) and hands it to the consumer's
:class:`Settler`, and the thread starts its next message, which its consumer holds already
(:mod:`kumiko_dramatiq.broker.holds`). The settler, one thread per lane consumer, sends the
entries that have gathered in one ``lua/settle.lua`` call, which also claims the consumer's
next messages (as many as the call frees room for), reports the starts of held messages and
reads the asks about them: one call per batch of deliveries, no fetch of its own.

**When a batch goes** (:func:`send_in_s`, pure): at once when it is urgent (a capped slot comes
back: a waiter is due it; a dedup key's follow-up; a consumer closing), when few of the
messages the consumer holds still wait for a thread (a quarter of its threads' worth: the
threads would soon wait for this call's claim), when every thread ended one, or when one thread
ended a second delivery before its first was sent; else after a linger of about one
delivery's moving-average length, at most :data:`MAX_LINGER_S`. One call is in flight per
consumer at a time (the settler is one thread): while it is out, the deliveries that end join
the next one, so the busier Redis is, the more each call carries. A call that Redis fails is
sent again, unchanged, after a backoff (:class:`~kumiko_dramatiq.broker.outage.Outage`), until
Redis takes it: settling twice is safe (the second finds the deliveries settled and writes no
follow-up again), and what could not be written is written once Redis answers.

**What a kill -9 can rerun.** A delivery is settled once its call is answered; until then it is
still claimed by this worker in Redis and comes back, like any unfinished delivery, if the
process dies. So a ``kill -9`` re-runs the deliveries whose handlers had returned and whose
settle had not been answered: those that ended in the last linger (at most one per thread not
sent yet, a thread's second one sends the batch) and those in the call in flight (at most one
per thread) — against one per thread when each thread waited for its own settle. A message
held and not started is never re-run by a kill: it had not run.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import redis
from dramatiq.message import Message

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.delivery import LaneFetch, Outcome, RunWrite
from kumiko_dramatiq.broker.holds import HoldBlock, HoldReply
from kumiko_dramatiq.broker.outage import Outage

if TYPE_CHECKING:
    from kumiko_dramatiq.broker.consumer import KumikoConsumer

logger = logging.getLogger("kumiko_dramatiq")

#: The most deliveries one call settles.
MAX_BATCH: Final = 64
#: The longest a batch waits for more deliveries to join it (s), and the share of the
#: deliveries' moving-average length it waits at most: about one delivery per thread.
MAX_LINGER_S: Final = 0.025
LINGER_SHARE: Final = 1.0

#: The number of a delivery's fields in a ``lua/settle.lua`` call (its extras, when it has
#: any, follow all the call's deliveries), and the extras of one that has none.
SETTLE_FIELDS: Final = 11
NO_EXTRAS: Final = ("",) * 9
#: How many of the extras carry a delivery's other ends (all but its result and batch): a
#: delivery whose only extras are those two sends them alone (marker "b", ``lua/settle.lua``).
_OTHER_EXTRAS: Final = 7


@dataclass(frozen=True, slots=True)
class SettleEntry:
    """One delivery's part of a ``lua/settle.lua`` call (see its header): its redis id, its
    outcome (with the capped slot it gives back), the key its end writes (its "already
    completed" marker, or its "sent" tombstone, or ""), its run record, its actor as decoded
    at fetch ("" unknown), and its extras (tenant, origin, dead letter note, the retry's
    queue, redis id and encoding, the dedup key it ends, the result it keeps, its batch),
    :data:`NO_EXTRAS` for most."""

    redis_id: str
    outcome: Outcome
    slot: tuple[str, str] | None
    end_key: str
    run: RunWrite | None
    actor: str
    extras: tuple[Any, ...] = NO_EXTRAS

    def fields(self) -> list[Any]:
        """The entry's :data:`SETTLE_FIELDS` arguments."""
        run = self.run
        header: tuple[str, ...] = ("", "", "", "", "")
        record = ""
        if run is not None:
            header = (
                run.message_id,
                str(run.attempt),
                run.job,
                run.status,
                "" if run.started_ms is None else str(run.started_ms),
            )
            record = run.record
        outcome = self.outcome if self.slot is None else f"{self.outcome} {' '.join(self.slot)}"
        return [
            self.redis_id,
            outcome,
            self.end_key,
            *header,
            record,
            self.actor,
            self.marker,
        ]

    @property
    def marker(self) -> str:
        """Field +10: "" (no extras), "b" (its result and batch only: two arguments), "+"."""
        if self.extras == NO_EXTRAS:
            return ""
        return "b" if not any(self.extras[:_OTHER_EXTRAS]) else "+"

    def sent_extras(self) -> tuple[Any, ...]:
        """The extras the call carries for this entry (see :attr:`marker`)."""
        marker = self.marker
        if marker == "b":
            return self.extras[_OTHER_EXTRAS:]
        return self.extras if marker else ()


@dataclass(frozen=True)
class Claim:
    """What a settle call claims for its consumer: up to ``room`` messages, the first ``now``
    of them for threads free now (the rest held), the consumer holding ``holding`` once the
    call's deliveries are settled."""

    room: int
    holding: int
    now: int


@dataclass(frozen=True)
class SettleReply:
    """A settle call's answer: one result bit set per entry
    (:data:`~kumiko_dramatiq.broker.delivery.SETTLED_MINE`,
    :data:`~kumiko_dramatiq.broker.delivery.DEDUP_FOLLOW_UP`), what its claim took (``None``
    without one), and its hold block's reply."""

    results: list[int]
    fetch: LaneFetch | None
    holds: HoldReply


@dataclass
class Pending:
    """One entry waiting in a :class:`Settler`, and what to do once it is settled
    (``done(result bits)``, in the settler's thread)."""

    entry: SettleEntry
    done: Callable[[int], None]
    #: the worker thread that ended the delivery (0: none)
    thread: int = 0
    urgent: bool = False
    at: float = 0.0
    #: a retry or hand-off it writes: after_enqueue is emitted for it once settled
    follow_up: tuple[Message[Any], int | None] | None = None


def send_in_s(
    *,
    now: float,
    oldest_at: float,
    gathered: int,
    urgent: bool,
    repeat: bool,
    starving: bool,
    job_s: float,
    threads: int,
) -> float:
    """How long a settler waits before it sends the ``gathered`` entries it holds (the
    oldest gathered at ``oldest_at``): 0 when one is ``urgent``, a thread ended a second
    delivery (``repeat``), the consumer is ``starving`` (few of the messages it holds wait
    for a thread: the threads would soon wait for this call's claim) or every thread ended
    one; else until the oldest waited a linger of :data:`LINGER_SHARE` of the deliveries'
    average length ``job_s``, at most :data:`MAX_LINGER_S`. Pure."""
    if urgent or repeat or starving or gathered >= threads:
        return 0.0
    linger = min(MAX_LINGER_S, LINGER_SHARE * job_s)
    return max(0.0, oldest_at + linger - now)


class Settler:
    """The settles of one lane consumer's deliveries, sent from a thread of its own (see the
    module docstring). :meth:`put` never blocks; :meth:`close` waits for what is left."""

    def __init__(self, consumer: KumikoConsumer) -> None:
        self._consumer = consumer
        self._cond = threading.Condition()
        self._pending: deque[Pending] = deque()
        self._sending = 0
        self._thread: threading.Thread | None = None
        self._closing = False
        self._flushing = False
        self._pid = os.getpid()
        #: what the gathered entries say about sending (kept as they come): one is urgent, a
        #: thread ended a second delivery, and the threads that ended one
        self._urgent = False
        self._repeat = False
        self._threads: set[int] = set()
        self._outage = Outage(f"the settles of {consumer.queue_name}")

    @property
    def waiting(self) -> int:
        """Entries not settled yet (gathered or in the call in flight)."""
        return len(self._pending) + self._sending

    def put(self, pending: Pending) -> None:
        """Settle ``pending`` soon (its ``done`` is called once it is). The settler's thread
        is woken only when this entry may make the batch due (the first, an urgent one, a
        thread's second, the one that fills it): a linger ends by its own timeout."""
        pending.at = time.monotonic()
        with self._cond:
            first = not self._pending
            self._pending.append(pending)
            self._urgent = self._urgent or pending.urgent
            if pending.thread:
                if pending.thread in self._threads:
                    self._repeat = True
                self._threads.add(pending.thread)
            # cleared by the thread itself, under the lock, as it ends (a forked child has none)
            if self._thread is None or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(
                    target=self._run,
                    name=f"kumiko-settle-{self._consumer.queue_name}",
                    daemon=True,
                )
                self._thread.start()
            if (
                first
                or pending.urgent
                or self._repeat
                or len(self._pending) >= self._consumer.threads
            ):
                self._cond.notify()

    def nudge(self) -> None:
        """Something the send decision reads changed (the consumer starves): a batch that
        gathers is looked at again."""
        if self._pending:
            with self._cond:
                self._cond.notify()

    def flush(self, timeout_s: float) -> bool:
        """Send what is gathered at once and wait up to ``timeout_s`` until every entry is
        settled; whether they were."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._flushing = True
            try:
                self._cond.notify_all()
                while self._pending or self._sending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
            finally:
                self._flushing = False
        return True

    def close(self, timeout_s: float) -> bool:
        """Send what is gathered at once and wait up to ``timeout_s`` for every entry to be
        settled; whether they all were (the thread goes on trying when not)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._closing = True
            self._cond.notify()
            while self._pending or self._sending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                batch = self._next_batch()
                if batch is None:
                    self._thread = None
                    return
                self._sending = len(batch)
            try:
                self._send(batch)
            except Exception:  # the thread goes on: what it holds must be settled
                logger.exception(
                    "settling %d deliveries of %s failed", len(batch), self._consumer.queue_name
                )
                with self._cond:
                    self._pending.extendleft(reversed(batch))
                time.sleep(0.1)
            finally:
                with self._cond:
                    self._sending = 0
                    self._cond.notify_all()

    def _next_batch(self) -> list[Pending] | None:
        """The next batch to send, once it is due (called with the condition held); ``None``
        after a quiet spell with nothing to send (the thread ends; :meth:`put` starts a new
        one)."""
        consumer = self._consumer
        while True:
            if not self._pending:
                self._cond.notify_all()
                if not self._cond.wait(1.0) and not self._pending:
                    return None
                continue
            wait = send_in_s(
                now=time.monotonic(),
                oldest_at=self._pending[0].at,
                gathered=len(self._pending),
                urgent=self._urgent or self._closing or self._flushing,
                repeat=self._repeat,
                starving=consumer.starving(),
                job_s=consumer.broker.job_s,
                threads=consumer.threads,
            )
            if wait <= 0:
                count = min(MAX_BATCH, len(self._pending))
                batch = [self._pending.popleft() for _ in range(count)]
                self._urgent = any(each.urgent for each in self._pending)
                self._threads = {each.thread for each in self._pending if each.thread}
                self._repeat = len(self._threads) < sum(1 for e in self._pending if e.thread)
                return batch
            self._cond.wait(wait)

    def _abandon(self, batch: list[Pending]) -> None:
        """Give up ``batch`` and what is gathered (the broker closed while Redis refused
        them): their deliveries stay claimed by this worker in Redis and come back like a
        dead worker's (maintenance, after ``heartbeat_timeout_ms``)."""
        with self._cond:
            left = [*batch, *self._pending]
            self._pending.clear()
        logger.warning(
            "%d settle(s) of %s not written when the runner stopped: their messages come "
            "back like a stopped worker's once its heartbeat is out of date",
            len(left),
            self._consumer.queue_name,
        )

    def _send(self, batch: list[Pending]) -> None:
        """One settle call for ``batch`` (with the consumer's claim and the hold block),
        sent again until Redis takes it."""
        consumer = self._consumer
        broker = consumer.broker
        entries = [each.entry for each in batch]
        while True:
            if broker.closed and self._outage.ongoing:
                # the runner stopped while Redis refused them: its connections stay closed
                self._abandon(batch)
                return
            claim = consumer.begin_claim([entry.redis_id for entry in entries])
            block = broker.holds.block(consumer.queue_name)
            try:
                reply = broker.settle_call(
                    consumer.queue_name, entries, claim, block, broker.thread_client()
                )
            except redis.RedisError as exc:
                broker.holds.failed(block)
                if claim is not None:
                    consumer.end_claim(lost=True)
                wait = self._outage.failed(exc)
                time.sleep(wait)
                continue
            except BaseException:
                broker.holds.failed(block)
                if claim is not None:
                    consumer.end_claim(lost=True)
                raise
            self._outage.succeeded()
            broker.holds.applied(block, reply.holds)
            if claim is not None:
                consumer.claimed(reply.fetch, block.sent_at, claim.room)
            for each, result in zip(batch, reply.results, strict=True):
                try:
                    each.done(result)
                except Exception:
                    logger.exception("finishing the settle of %s failed", each.entry.redis_id)
            return


#: One settle call in this many also trims the run history (ages and cap), dropping at most
#: this many records beyond the cap: the trimming keeps pace with the writes at a shared cost.
TRIM_BUDGET: Final = 32

#: How long a settle may vouch for the TTLs of the run indexes (a job's and a status's) it
#: refreshed last: while every record of a settle call goes to indexes this process refreshed
#: less than this long ago, the call refreshes none (two writes fewer per call; an index
#: lives 2 minutes longer than its longest-lived record, ``include/history.lua``). An index
#: that vanishes meanwhile (emptied, a Redis restarted without persistence) comes back without
#: a TTL until this process's next refresh, within the minute; if the process dies first and
#: nobody writes that job and status again, the entries of that minute keep no TTL.
INDEX_VOUCH_S: Final = 60.0


class SettleCalls:
    """The broker's side of settling (mixed into
    :class:`~kumiko_dramatiq.broker.broker.KumikoBroker`): an entry built from what a
    delivery's end writes (:meth:`settle_entry`), and one ``lua/settle.lua`` call for a batch
    of them (:meth:`settle_call`). The attributes below are the broker's."""

    queue_prefix: str
    namespace: str
    completed_ttl_ms: int
    resend_window_ms: int
    run_ttls_ms: tuple[int, int]
    history_cap: int
    lua: Any
    _indexes_refreshed: dict[tuple[str, str], float]

    if TYPE_CHECKING:

        def encode(self, prepared: Message[Any], delay: int | None) -> bytes: ...

        def command_head(self, queue_name: str, *, maintenance: bool = True) -> list[Any]: ...

        def claim_args(self, queue_name: str, claim: Claim) -> list[Any]: ...

        def lane_fetch(self, queue_name: str, reply: Any, now: int | None = None) -> LaneFetch: ...

        def call(
            self, script: Any, client: redis.Redis | None, *, keys: list[str], args: list[Any]
        ) -> Any: ...

    def settle_entry(
        self,
        redis_message_id: str,
        outcome: Outcome,
        *,
        message_id: str,
        retry: tuple[Message[Any], int | None] | None = None,
        run: RunWrite | None = None,
        slot: tuple[str, str] | None = None,
        actor: str = "",
        dedup: tuple[str, str, str] | None = None,
        tombstone: bool = True,
        result: str = "",
        batch: str = "",
    ) -> SettleEntry:
        """The settle of one delivery from a lane queue (see ``lua/settle.lua``): ``retry`` the
        prepared retry or hand-off and its delay (outcome "retry"), ``run`` its run record,
        ``slot`` the (slots key, owner token) of the capped job's slot it gives back (also
        when it is no longer this worker's: the token is this delivery's own), ``actor`` its
        actor as decoded at fetch ("": read off its body), ``dedup`` (index, message id, key)
        the dedup key its job ended with for good, ``tombstone``: whether an outcome other than
        "completed" leaves the "sent" tombstone of ``redis_message_id`` (``False`` for a copy
        a settle wrote, a retry or a hand-off, whose redis id no enqueue command carries),
        ``result`` the end of a job that keeps results (``Settlement.result``), ``batch`` the
        batch its message belongs to (``Settlement.batch``)."""
        tenant = origin = note = ""
        if run is not None:
            tenant, note = run.tenant, run.dead_note
            origin = "" if run.origin == run.message_id else run.origin
        retried: tuple[Any, ...] = ("", "", "")
        if retry is not None:
            message, delay = retry
            retried = (
                message.queue_name,
                message.options["redis_message_id"],
                self.encode(message, delay),
            )
        ended = "" if dedup is None else "\t".join(dedup)
        extras = (tenant, origin, note, *retried, ended, result, batch)
        if outcome == "completed":
            end_key = keys.completed(self.queue_prefix, message_id)
        elif tombstone:
            end_key = keys.sent(self.queue_prefix, redis_message_id)
        else:
            end_key = ""
        return SettleEntry(redis_message_id, outcome, slot, end_key, run, actor, extras)

    def settle_call(
        self,
        queue_name: str,
        entries: Sequence[SettleEntry],
        claim: Claim | None,
        block: HoldBlock,
        client: redis.Redis | None,
    ) -> SettleReply:
        """One ``lua/settle.lua`` call for ``entries`` (of deliveries from ``queue_name``), on
        ``client`` (the calling thread's), with the worker's hold ``block`` and, when given,
        ``claim``: the consumer's next messages, claimed as its own fetch would (a capped
        job's slot given back here goes to the waiter this consumer can start at once). A
        call that claims also runs maintenance when due (the consumer's fetches, which did,
        become rare). Raises the Redis error."""
        trim = TRIM_BUDGET if random.random() < len(entries) / TRIM_BUDGET else 0
        completed_ttl, failed_ttl = self.run_ttls_ms
        indexes, vouched = self._vouched(entries)
        args: list[Any] = [
            *self.command_head(queue_name, maintenance=claim is not None),
            f"{len(entries)} {self.completed_ttl_ms} {completed_ttl} {failed_ttl} "
            f"{self.history_cap} {trim} {self.resend_window_ms} {int(vouched)} "
            f"{len(block.args)}",
            keys.root(self.queue_prefix),
        ]
        extras: list[Any] = []
        for entry in entries:
            args.extend(entry.fields())
            extras.extend(entry.sent_extras())
        args.extend(extras)
        args.extend(block.args)
        if claim is not None:
            args.extend(self.claim_args(queue_name, claim))
        results, fetched, now, holds = self.call(
            self.lua.settle,
            client,
            keys=[
                self.namespace,
                keys.inflight(self.queue_prefix),
                keys.suspects(self.queue_prefix, queue_name),
            ],
            args=args,
        )
        if not vouched:  # refreshed by the call: no earlier than it was sent
            for index in indexes:
                self._indexes_refreshed[index] = block.sent_at
        return SettleReply(
            [int(each) for each in results],
            None if claim is None else self.lane_fetch(queue_name, fetched, int(now)),
            HoldReply.decode(holds),
        )

    def _vouched(self, entries: Sequence[SettleEntry]) -> tuple[set[tuple[str, str]], bool]:
        """The (job, status) of each run record among ``entries``, and whether this process
        refreshed the TTLs of all their indexes less than :data:`INDEX_VOUCH_S` ago (then the
        call does not refresh them; when it does, they count as refreshed when it was sent,
        once it answered). A malformed delivery's record is the job's its body names, not
        known here: never vouched for."""
        indexes: set[tuple[str, str]] = set()
        for entry in entries:
            run = entry.run
            if run is None:
                continue
            if run.status == "malformed":
                return indexes, False
            if run.message_id and run.status:
                indexes.add((run.job, run.status))
        since = time.monotonic() - INDEX_VOUCH_S
        refreshed = self._indexes_refreshed
        return indexes, all(refreshed.get(index, since) > since for index in indexes)
