"""The consumer Dramatiq's worker pulls the messages of one queue from."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import redis
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.common import current_millis
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message

from kumiko_dramatiq.broker.delivery import (
    DEDUP_FOLLOW_UP,
    SETTLED_MINE,
    Delivery,
    LaneFetch,
    Outcome,
    RunWrite,
)
from kumiko_dramatiq.broker.holds import HOLD_AHEAD_UNTIL_S
from kumiko_dramatiq.broker.keys import consumer_acks, is_delay_queue, queue_bell
from kumiko_dramatiq.broker.outage import Outage
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.broker.seam import work_handoff
from kumiko_dramatiq.broker.settling import Claim, Pending, SettleEntry, Settler
from kumiko_dramatiq.codec import FAILURES, TRIGGER

if TYPE_CHECKING:
    from kumiko_dramatiq.broker.broker import KumikoBroker


logger = logging.getLogger("kumiko_dramatiq")

#: Redis ends a blocked command's timeout on its clock tick (``hz``, 10 a second by default),
#: so a ``BLPOP`` may return up to this much after its timeout: a wait for a due time leaves
#: its last tick to a local sleep.
REDIS_TICK_MS = 100

#: How many due delayed messages one ``lua/move.lua`` step moves at most (a step of this
#: size takes a few ms of Redis's time; a larger backlog of due messages takes several).
MOVE_BATCH = 1_000

#: How many messages one ``lua/schedule_legacy.lua`` step takes off Dramatiq's own delay
#: queue list (each is re-encoded in Python, so the step is bounded by bytes too).
LEGACY_BATCH = 100


class KumikoConsumer(Consumer):
    """What Dramatiq's worker pulls the messages of one queue from.

    Fetches in one Lua call per batch and acks each delivery together with its
    :class:`Settlement`. With nothing to fetch it does not poll: it blocks on the queue's
    doorbell (:func:`queue_bell`, ``BLPOP`` on a connection of its own), which every write
    onto the queue rings in the same Lua call, so a message enqueued into an idle system
    starts within a round trip or two. The wait is bounded by ``2 * timeout`` (a lost
    wake-up, say a connection killed while blocked, costs at most that; an idle consumer
    sends two commands per bound, fewer than Dramatiq's polling). A worker shutting down
    unblocks its consumers (:meth:`KumikoBroker.wake_consumers`). Once it holds ``prefetch``
    messages (on a lane, see below), it waits for one of them to be settled, not for a poll.

    **Claims by settles.** On a lane, the settle of this consumer's deliveries (their ack or
    nack, sent by its settler thread, :meth:`KumikoBroker.settle_call`) also claims the
    consumer's next messages in the same Lua call, for the room the consumer has
    once they are settled, exactly as its own fetch would (``lua/settle.lua`` runs
    ``include/lane_claim.lua``): they land in this consumer's cache, and its thread hands them
    out (woken from a wait on the doorbell by a ``CLIENT UNBLOCK`` if it waits there). So a
    steadily draining consumer sends one call per batch of deliveries, not a settle and a
    fetch; and a capped job's slot given back by a settle goes, with its oldest waiter, to
    this consumer, which has the worker thread that has just finished (no doorbell, no
    fetch). One claim at a time per consumer (a lock its fetch holds too; a settle that finds
    it held claims nothing), none once the consumer is closed or its worker is stopping, none
    while a suspect runs alone or waits for the consumer to drain; what a claim took counts
    as held for the prefetch bound and for the lost claims (below) like a fetch's.

    **Delay queues** (``<queue>.DQ``, for which Dramatiq's worker runs a consumer of its own)
    hold nothing in memory: the consumer never hands a message to Dramatiq's worker. It moves
    due messages from the queue's schedule onto the queue, :data:`MOVE_BATCH` at a time
    (:meth:`KumikoBroker.move_due`; whichever process's consumer comes first moves them, in
    one atomic step), and what an older writer left on Dramatiq's ``.DQ`` list onto the
    schedule (:meth:`KumikoBroker.schedule_legacy`), then sleeps until the next due time (by
    Redis's clock, its last Redis clock tick, :data:`REDIS_TICK_MS`, slept locally so a due
    message moves on time), the delay queue's doorbell (rung by an enqueue that becomes the
    earliest) or ``2 * timeout``.

    **Run-ahead.** On a kumiko lane queue the consumer holds up to Dramatiq's ``prefetch``
    (twice the worker's threads): a message for each thread that is free now, claimed
    *running*, and one more per thread, claimed *held* (:mod:`kumiko_dramatiq.broker.holds`),
    so a thread that ends a job starts its next one at once, from memory, while the settle
    of the one it ended goes on its way (:class:`~kumiko_dramatiq.broker.settling.Settler`).
    A held message starts only through the broker's gate (:meth:`start`), while the worker's
    hold is valid and nobody asked for it (a cancel, purge or pause drops it unstarted). It
    fetches when half its room is free (or all of it), so a batch still serves several
    messages, and while it is full it waits for a settle, not for a poll.

    Every fetched message is checked before Dramatiq's worker sees it: one that does not
    decode, or decodes into something Dramatiq's worker would crash on (a non-string actor
    name, options that are not an object, a queue name not this queue's), or that the
    broker's ``message_policy`` refuses, is dead-lettered with a logged reason: never run,
    never silently acked, never left to come back.

    On a kumiko lane queue, a message whose worker died while holding it (a *suspect*) runs
    alone: the consumer stops fetching until it holds nothing, takes the suspect by itself and
    fetches nothing else until it is settled. So a poison message (one that kills its worker)
    takes no healthy message down with it, and after ``max_deliveries`` deaths in a row it is
    dead-lettered (``lua/fetch_lane.lua``).

    **Caps.** On a lane with capped jobs the fetch also returns the slots it took (each
    delivery carries its own, :attr:`Delivery.slot`, given back by its settle, or by
    ``slot_release`` when it goes back to the queue unrun) and when waiting capped messages are
    due a look (a rate window opening, a lease running out): an idle wait ends then at the
    latest, so a waiting message starts on time without a poll. While capped messages wait,
    the consumer fetches with any free room, not only half its threads' worth: a slot frees
    one run at a time. A lost claim's slot (below)
    waits out its lease.

    **Lost claims.** A fetch claims its messages for this worker in Redis (its ack set) before
    the reply comes back. When the reply never does (the connection dropped while the fetch
    ran, or a fetch sent into a cut link that Redis ran only once the link was back, after
    the consumer had given up on it), the claims stay with a worker that is alive, so no
    maintenance recovers them, and their messages would count as running until this process
    stops. So once per ``maintenance_interval_ms`` (and first thing after the consumer is
    made, which Dramatiq does again after a connection error, and after a settle whose claim
    got no reply) the consumer puts back on the
    queue every id of its ack set that this process does not hold (``requeue``: a lane
    message's delivery is undone, it never ran). Held means fetched and not settled yet, by
    any consumer of this queue in this process (a failed ack keeps its claim held until
    Dramatiq's retry of it lands).

    **Redis faults.** A fetch (or wait) that Redis fails in any way (no answer, a timeout, a
    refused write at ``maxmemory``, a restarted server) does not reach Dramatiq's loop, which
    would end its thread on some of them: the consumer logs it once per outage, waits a
    backoff of at most a second (:class:`~kumiko_dramatiq.broker.outage.Outage`) and fetches
    again, lost claims first. An ack or nack that Redis fails in any way is a
    ``ConnectionClosed``, which Dramatiq retries until Redis takes it. A consumer thread that
    ends anyway is restarted by the worker's supervisor
    (:mod:`kumiko_dramatiq.worker.supervision`), which reads :attr:`active_at` to tell a
    stuck consumer.
    """

    def __init__(self, broker: KumikoBroker, queue_name: str, prefetch: int, timeout: int) -> None:
        self.broker = broker
        self.queue_name = queue_name
        self.prefetch = prefetch
        self.timeout = timeout
        self.misses = 0
        self._lane = broker.is_lane(queue_name)
        self._delayed = is_delay_queue(queue_name)
        #: the worker's threads (a lane consumer holds a message ahead of each), how many
        #: messages this consumer holds at most, and the free room it fetches at
        self.threads = max(1, prefetch // 2)
        self._slots = max(1, prefetch)
        self._batch = max(1, self._slots // 2) if self._lane else 1
        #: claimed and not handed out yet: (redis id, body, whether it is held)
        self._cache: deque[tuple[str, bytes | None, bool]] = deque()
        #: handed out and not started yet, and started and not ended, by redis id
        self._waiting: set[str] = set()
        self._running: dict[str, float] = {}
        #: sends the settles of this consumer's deliveries (lanes only)
        self.settler = Settler(self)
        #: how a settle's claim hands its messages straight to the worker threads (built in
        #: the Dramatiq consumer thread that made this consumer; ``None`` elsewhere), and the
        #: deliveries it could not hand over (left to this consumer's thread)
        self._handoff = work_handoff() if self._lane else None
        self._ready: deque[Delivery] = deque()
        self._outstanding: set[str] = set()
        #: what this process holds of the queue (shared by its consumers of the queue), and
        #: when this consumer last gave back lost claims (ms; 0: never)
        self._held = broker.held.setdefault(queue_name, set())
        self._claims_checked_ms = 0
        self._settled = threading.Condition()
        #: the suspect this consumer runs alone, if any
        self._alone: str | None = None
        self._suspects_waiting = 0
        #: delay queues: how long to wait before the next move step (ms; 0: none; ``None``:
        #: nothing is scheduled, wait for the doorbell or ``2 * timeout``)
        self._wait_ms: int | None = 0
        #: the capped jobs' slots the fetches took, by redis id: (slots key, owner token, when
        #: the fetch was sent); and when waiting capped messages are due a look (local ms)
        self._cap_leases: dict[str, tuple[str, str, float]] = {}
        self._caps_due: int | None = None
        #: held while a fetch or a settle claims for this consumer (one claim at a time, so
        #: the room each one computes is true); set once the consumer is closed (it claims
        #: nothing more)
        self._claim_lock = threading.Lock()
        self._closed = False
        #: the last claim (a fetch's or a settle's) took less than its room: nothing more is
        #: there to claim until the doorbell rings (every write that makes a message
        #: claimable rings it) or a waiting capped message is due; so the next fetch waits for
        #: the next idle wait to end
        self._drained = False
        #: how many times something may have made messages claimable since the consumer was
        #: made (:meth:`_undrain`), and that count when the claim under way was sent: a
        #: claim's "drained" holds only if nothing happened in between (a slot given back by
        #: another settle after this claim ran rings the doorbell, and the wait that takes
        #: that ring may end before this claim's reply lands)
        self._wakes = 0
        self._claim_wakes = 0
        #: the doorbell, the connection that waits on it and that connection's client id
        self._bell_key = queue_bell(queue_name, broker.namespace)
        self._bell: redis.Redis | None = None
        self._bell_id = 0
        #: when ``__next__`` was last called (``time.monotonic()``; the supervisor's "stuck"),
        #: and this consumer's view of a Redis fault
        self.active_at = time.monotonic()
        self._outage = Outage(f"the consumer of {queue_name}")

    @property
    def outstanding_message_count(self) -> int:
        """Messages fetched and not yet acked, nacked or requeued (cached ones included)."""
        return len(self._outstanding) + len(self._cache)

    def __next__(self) -> Delivery | None:
        self.active_at = time.monotonic()
        try:
            if self._delayed:
                # any Redis error (a timeout, a refused write) is survived below: the next
                # turn, after a backoff of at most a second, moves what is due
                self._move_due()
                self._outage.succeeded()
                return None
            if current_millis() - self._claims_checked_ms >= self.broker.maintenance_interval_ms:
                self._give_back_lost_claims()
            while True:
                if self._ready:
                    self.misses = 0
                    return self._ready.popleft()
                if self._cache:
                    delivery = self._deliver(*self._cache.popleft())
                    if delivery is not None:
                        self.misses = 0
                        self._outage.succeeded()
                        return delivery
                    continue
                if self._fill():
                    continue
                self._outage.succeeded()
                with self._settled:
                    if self._cache or self._ready:
                        continue  # a settle claimed for this consumer since the check above
                    # while capped messages wait, any room is worth a fetch (see _fill): then
                    # the consumer waits on the doorbell, which a slot given back rings
                    room, now = self._room(self.outstanding_message_count)
                    need = 1 if self._caps_due is not None else self._threshold(room, now)
                    if room < need:
                        # Busy: wait for an ack to free room (bounded, so Dramatiq's loop goes
                        # round to notice a shutdown). Checked under the condition's lock, which
                        # a settling thread takes to notify (after a claim of its settle filled
                        # the cache), so no settle or claim slips in between.
                        self._settled.wait(self.timeout / 1000)
                        return None
                self._idle(self._caps_due_in())
                return None
        except redis.RedisError as exc:
            self._survive(exc)
            return None

    def _survive(self, exc: redis.RedisError) -> None:
        """Outlive a Redis fault met while fetching (a frozen, restarted or full Redis, a
        killed connection; Dramatiq's loop would end this thread on some of them): logged once
        per outage, the next fetch after a backoff of at most a second, and the claims of a
        fetch whose reply was lost given back first thing once Redis answers ("lost
        claims"). Waits in short steps, so that a worker stopping is noticed."""
        self._claims_checked_ms = 0
        self._undrain()
        self._close_bell()
        end = time.monotonic() + self._outage.failed(exc)
        while not self.broker.stopping and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, REDIS_TICK_MS / 1000))

    def _move_due(self) -> None:
        """A delay queue's turn: wait as the last step said, then move what is due (and
        schedule what an older writer left on Dramatiq's list); the next wait is until the
        next due time, or none while a full batch was moved."""
        if self._wait_ms != 0:
            self._idle(self._wait_ms)
        result = self.broker.move_due(self.queue_name, MOVE_BATCH)
        taken = 0
        if result.legacy:
            taken = self.broker.schedule_legacy(self.queue_name, LEGACY_BATCH)
        if result.moved >= MOVE_BATCH or taken:
            self._wait_ms = 0
        elif result.next_due is None:
            self._wait_ms = None
        else:
            self._wait_ms = max(0, result.next_due - result.now)

    def _caps_due_in(self) -> int | None:
        """How long until waiting capped messages are due a look (ms), if any wait."""
        return None if self._caps_due is None else self._caps_due - current_millis()

    def _idle(self, due_in_ms: int | None = None) -> None:
        """Wait until a message may be there: the doorbell rings, ``due_in_ms`` pass (a delay
        queue's next due time), ``2 * timeout`` ms pass, or a settle claims messages for this
        consumer (no wait then, or the wait ends: :meth:`claimed`). A wait that ends any other
        way (the doorbell, its time) ends :attr:`_drained`: the next turn fetches."""
        if self._cache or self._ready:  # a settle claimed messages for this consumer meanwhile
            return
        wait_ms = 2 * self.timeout
        if due_in_ms is not None:
            wait_ms = min(wait_ms, due_in_ms)
            if wait_ms <= REDIS_TICK_MS:
                time.sleep(max(wait_ms, 0) / 1000)
                self._undrain()
                return
            wait_ms -= REDIS_TICK_MS
        limit_s = self.broker.client.connection_pool.connection_kwargs.get("socket_timeout")
        if limit_s:  # the wait must end before the socket's read timeout
            wait_ms = min(wait_ms, int(limit_s * 1000) - 2 * REDIS_TICK_MS)
        wakeups = self.broker.wakeups
        try:
            bell = self._bell_client()
            # a settle that claimed for this consumer fills the cache, then wakes a wait it
            # finds registered (:meth:`claimed`): checked under the wakers' lock
            blocking = wait_ms > 0 and wakeups.block(
                id(self), self._bell_id, lambda: bool(self._cache or self._ready)
            )
            if self._cache or self._ready:
                return
            if blocking:
                began = time.monotonic()
                rang = bell.blpop([self._bell_key], timeout=wait_ms / 1000)
                # not rung and cut short: unblocked by a claim (which said whether anything is
                # left to claim) or by a stopping worker
                if rang is not None or time.monotonic() - began >= wait_ms / 1000 - 0.01:
                    self._undrain()
                return
        except redis.RedisError as exc:
            logger.debug("waiting on the doorbell of %s failed (%s)", self.queue_name, exc)
            self._close_bell()
        finally:
            wakeups.unblocked(id(self))
        # shutting down (or the wait failed): poll briefly, so Dramatiq's loop sees the stop
        time.sleep(min(max(wait_ms, 0), self.timeout, REDIS_TICK_MS) / 1000)
        self._undrain()

    def _undrain(self) -> None:
        """Something may have made messages claimable (the doorbell rang, a wait's time ran
        out): the next turn fetches, and a claim under way does not say "drained"."""
        self._drained = False
        self._wakes += 1

    def _bell_client(self) -> redis.Redis:
        if self._bell is None:
            self._bell = redis.Redis(
                connection_pool=self.broker.client.connection_pool, single_connection_client=True
            )
            # named, so that CLIENT LIST shows which connections are consumers' waits
            self._bell.client_setname(f"kumiko-bell:{self.queue_name}")
            self._bell_id = int(self._bell.client_id())
        return self._bell

    def _close_bell(self) -> None:
        if self._bell is not None:
            bell, self._bell = self._bell, None
            with contextlib.suppress(redis.RedisError):
                bell.close()

    def close(self) -> None:
        """No settle claims for this consumer any more; the settles it holds are sent (waited
        for up to the worker's timeout, then left to the settler's thread) and the
        doorbell's connection goes back to the pool."""
        with self._claim_lock:
            self._closed = True
        if self._lane and not self.settler.close(max(1.0, 10 * self.timeout / 1000)):
            logger.warning(
                "%d settle(s) of %s not written yet at close; retrying until Redis takes them",
                self.settler.waiting,
                self.queue_name,
            )
        self._close_bell()

    def _give_back_lost_claims(self) -> None:
        """Requeue the ids of this worker's ack set that this process does not hold (see
        "Lost claims" above). What is held is read before the ack set, and only this thread
        claims for this queue, so an id read as not held is not held; an id settled since is
        no longer in the ack set, and ``requeue`` moves only ids that still are."""
        with self._claim_lock:  # no settle claims for this consumer meanwhile
            self._give_back_unheld_claims()

    def _give_back_unheld_claims(self) -> None:
        self._claims_checked_ms = current_millis()
        held = self._held.copy()  # one C call: a worker thread's discard cannot interleave
        held.update(rid for rid, _, _ in self._cache)
        acks = consumer_acks(self.broker.broker_id, self.queue_name, self.broker.namespace)
        claimed = {text(rid) for rid in self.broker.thread_client().smembers(acks)}
        lost = sorted(claimed - held)
        if lost:
            self.broker.do_requeue(self.queue_name, *lost)
            logger.warning(
                "%d message(s) on %s were claimed for this worker by a fetch whose reply never "
                "came back: put back on the queue",
                len(lost),
                self.queue_name,
            )

    def _fill(self) -> bool:
        """Fetch what there is room for; ``False`` if nothing was (or could be) fetched."""
        if not self._lane:
            room = self._slots - self.outstanding_message_count
            if room <= 0 or (self.outstanding_message_count and room < self._batch):
                return False
            fetched = self.broker.fetch(self.queue_name, room)
            self._cache.extend((rid, body, False) for rid, body in fetched)
            return bool(fetched)
        with self._claim_lock:
            outstanding = self.outstanding_message_count
            room, now = self._room(outstanding)
            # while capped messages wait (a slot frees one at a time), any room is worth a fetch
            batching = self._caps_due is None
            if room <= 0 or (outstanding and room < self._threshold(room, now) and batching):
                return False
            if self._alone is not None or (self._suspects_waiting and outstanding):
                return False  # a suspect runs alone, or waits for this consumer to drain
            if self._drained:
                return False  # nothing more to claim: wait on the doorbell first
            self._claim_wakes = self._wakes
            claim = Claim(room, outstanding, now)
            result, _, sent_at = self.broker.fetch_lane(
                self.queue_name, claim, client=self.broker.thread_client()
            )
            self._take(result, sent_at, room)
            self.broker.holds.wake_keeper()
            return bool(result.fetched)

    def _room(self, holding: int) -> tuple[int, int]:
        """The room of a claim while this consumer holds ``holding`` messages, and how much of
        it runs now: the threads neither running a delivery nor about to start one handed out
        already. Beyond those, a message is held ahead for each thread whose job is young
        (started less than :data:`~kumiko_dramatiq.broker.holds.HOLD_AHEAD_UNTIL_S` ago, and
        none while the jobs take longer than that on average): a thread busy with a long job
        would keep it from a worker that is free."""
        waiting = len(self._waiting) + len(self._cache) + len(self._ready)
        free = self.threads - len(self._running)
        room = self._slots - holding
        now = max(0, min(room, free - waiting))
        if self.broker.job_s > HOLD_AHEAD_UNTIL_S:
            return min(room, now), now
        old = time.monotonic() - HOLD_AHEAD_UNTIL_S
        long_running = sum(1 for started in self._running.values() if started < old)
        return max(now, min(room, self._slots - long_running - holding)), now

    def _threshold(self, room: int, now: int) -> int:
        """The room a fetch waits for while the consumer holds something: half of what it
        may hold (half its threads' worth when it holds nothing ahead), so a batch still
        serves several messages."""
        return self._batch if room > now else max(1, self.threads // 2)

    def starving(self) -> bool:
        """Whether few messages this consumer handed out wait for a thread (a quarter of its
        threads' worth or fewer: the threads that end their jobs next would soon wait for the
        next claim)."""
        return len(self._waiting) <= self.threads // 4

    def begin_claim(self, settling: Sequence[str]) -> Claim | None:
        """Called by the settle of deliveries of this consumer (their redis ids
        ``settling``, :meth:`KumikoBroker.settle_call`): the :class:`Claim` if that settle is
        to claim this consumer's next messages too (its room, what the consumer holds once
        they are settled, how many of them to run now; a capped job's slot the settle gives
        back goes to this claim first, with the job's oldest waiter), then it ends with
        :meth:`claimed` or
        :meth:`end_claim`; ``None`` if it is not to: the consumer is closed or its worker
        stopping (it claims nothing), the consumer is fetching (or another settle claims for
        it), a suspect runs alone or waits for the consumer to drain, or there is no room."""
        if self._closed or self.broker.stopping or not self._lane:
            return None
        if not self._claim_lock.acquire(blocking=False):
            return None
        ending = sum(1 for rid in settling if rid in self._outstanding)
        held = self.outstanding_message_count - ending
        room, now = self._room(held)
        if (
            self._closed
            or self.broker.stopping
            or room <= 0
            or (self._alone is not None and self._alone not in settling)
            or (self._suspects_waiting and held)
        ):
            self._claim_lock.release()
            return None
        self._claim_wakes = self._wakes
        return Claim(room, held, now)

    def claimed(self, result: LaneFetch | None, sent_at: float, room: int) -> None:
        """What the settle that :meth:`begin_claim` allowed claimed: taken like a fetch's
        (its messages go to Dramatiq's worker from this consumer's thread, woken now if it
        waits on the doorbell); the claim ends."""
        try:
            if result is not None:
                self._take(result, sent_at, room)
                self._hand_over()
        finally:
            self._claim_lock.release()
        self.broker.holds.wake_keeper()
        if self._cache or self._ready:
            with self._settled:  # a consumer waiting for room: there is work now
                self._settled.notify()
            self._wake()

    def _hand_over(self) -> None:
        """Hand what this consumer holds in its cache straight to the worker threads, as its
        own thread would (decoded and checked by :meth:`_deliver`), from the thread that
        settled: no wait for this consumer's thread to wake (a stopping or closed consumer
        hands over nothing: what its cache holds is requeued when it closes)."""
        if self._handoff is None or self._closed or self.broker.stopping:
            return
        while True:
            try:
                rid, body, held = self._cache.popleft()
            except IndexError:  # empty (this consumer's thread may have taken the last)
                return
            delivery = self._deliver(rid, body, held)
            if delivery is not None and not self._handoff(self.broker, delivery):
                self._ready.append(delivery)

    def end_claim(self, *, lost: bool) -> None:
        """End a claim that :meth:`begin_claim` allowed and whose reply never came
        (``lost``): what it may have claimed is given back on this consumer's next turn
        ("lost claims")."""
        if lost:
            self._claims_checked_ms = 0
        self._claim_lock.release()

    def _wake(self) -> None:
        """End this consumer's wait on the doorbell, if it waits there (it registers under
        the broker's lock before it sends its ``BLPOP``: an unblock that comes before the
        ``BLPOP`` reaches Redis finds nothing to unblock, and is sent again)."""
        self.broker.wakeups.wake(id(self), 2 * self.timeout / 1000)

    def _take(self, result: LaneFetch, sent_at: float, room: int) -> None:
        """Take in what a fetch (or a settle's claim) for ``room`` messages, sent at
        ``sent_at``, claimed and decided; called with :attr:`_claim_lock` held."""
        self._drained = (
            len(result.fetched) < room and not result.alone and self._wakes == self._claim_wakes
        )
        self._suspects_waiting = result.suspects_waiting
        for rid, (slots_key, token) in result.slots.items():
            self._cap_leases[rid] = (slots_key, token, sent_at)
        due_in = result.caps_due_in_ms
        self._caps_due = None if due_in is None else current_millis() + due_in
        for message_id in result.completed:
            logger.warning(
                "message %s on %s already completed: acked without running it again",
                message_id,
                self.queue_name,
            )
        for rid, deliveries in result.buried:
            logger.error(
                "dead-lettering message %s on %s: worker died during %d deliveries",
                rid,
                self.queue_name,
                deliveries,
            )
            self._tell_dead_lettered("worker_died")
        if result.alone:
            self._alone = result.fetched[0][0]
            logger.warning(
                "message %s on %s: its worker died while running it; running it alone",
                self._alone,
                self.queue_name,
            )
        # held by this process from now on (the lost-claims check of any consumer of the
        # queue leaves them alone), until settled or put back
        self._held.update(rid for rid, _ in result.fetched)
        self._cache.extend(
            (rid, body, i >= result.now) for i, (rid, body) in enumerate(result.fetched)
        )

    def _deliver(self, rid: str, body: bytes | None, held: bool = False) -> Delivery | None:
        if body is None:
            logger.warning("message %s vanished from %s before its fetch", rid, self.queue_name)
            self._settle_unrun(rid, "ack")
            return None
        try:
            message = Message.decode(body)
            problem = _shape_problem(message, self.queue_name)
        except Exception as exc:
            message, problem = None, f"it does not decode ({exc.__cause__ or exc})"
        delivery = None
        policy = self.broker.message_policy
        if message is not None and problem is None:
            delivery = Delivery(
                message, fetched_from=self.queue_name, redis_message_id=rid, encoded_bytes=len(body)
            )
            lease = self._cap_leases.get(rid)
            if lease is not None:
                delivery.slot, delivery.slot_sent_at = (lease[0], lease[1]), lease[2]
            if policy is not None:
                problem = policy.admit(delivery)
        if message is None or delivery is None or problem is not None:
            logger.error(
                "dead-lettering message %s (redis id %s) on %s: %.200s",
                "?" if message is None else message.message_id,
                rid,
                self.queue_name,
                problem,
            )
            self._settle_unrun(rid, "dead", reason=str(problem))
            self._tell_dead_lettered("malformed")
            if message is not None and policy is not None:
                policy.rejected(message)
            return None
        delivery.consumer = self
        self._outstanding.add(rid)
        self._held.add(rid)
        self._waiting.add(rid)
        if held:
            self.broker.holds.hold(delivery)
        return delivery

    def start(self, delivery: Delivery) -> bool:
        """The gate of ``delivery``'s start, in its worker thread before any hook: whether it
        runs. A held one runs only while the worker's hold is valid and nobody asked for it
        (:meth:`~kumiko_dramatiq.broker.holds.Holds.begin`); one dropped meanwhile is refused
        (Dramatiq skips it, no hook sees it) and settled as what it is (:meth:`ack`)."""
        rid = delivery.redis_message_id
        if delivery.hold != "now" and not self.broker.holds.begin(delivery):
            delivery.refused = True
            self._waiting.discard(rid)
            return False
        self._waiting.discard(rid)
        self._running[rid] = time.monotonic()
        if len(self._waiting) == self.threads // 4:
            self.settler.nudge()  # few threads find a message ready now: the claim is due
        return True

    def dropped(self, delivery: Delivery) -> None:
        """``delivery`` was held and dropped (an ask about it was answered): its room is free
        at once; its worker thread, if one takes it, is refused at the gate."""
        self._waiting.discard(delivery.redis_message_id)
        self._done(delivery.redis_message_id)

    def _tell_dead_lettered(self, reason: str) -> None:
        for listener in self.broker.fetch_dead_letter_listeners:
            try:
                listener(self.queue_name, reason)
            except Exception:
                logger.exception("a dead-letter listener failed")

    def _settle_unrun(self, rid: str, outcome: Outcome, *, reason: str = "") -> None:
        """Settle a fetched message that never reaches Dramatiq's worker; a dead-lettered
        one's run record (if the fetch wrote one) ends "dead" with ``reason``."""
        if self._lane:
            run = None
            if outcome == "dead":
                run = RunWrite(rid, 0, "", "malformed", "", "", reason[:2_000], "")
            lease = self._cap_leases.get(rid)
            self._held.add(rid)  # its claim is still this process's until the settle lands
            slot = None if lease is None else (lease[0], lease[1])
            entry = self.broker.settle_entry(rid, outcome, message_id=rid, run=run, slot=slot)
            self.settler.put(
                Pending(entry, lambda _result: self._done(rid), urgent=slot is not None)
            )
            return
        if outcome == "dead":
            self.broker.do_nack(self.queue_name, rid)
        else:
            self.broker.do_ack(self.queue_name, rid)
        self._done(rid)

    def _done(self, rid: str, *, settled: bool = True) -> None:
        """``rid`` is no longer out with this consumer; ``settled``: nor is its claim (False
        for an ack or nack that Redis did not take: Dramatiq retries it, and until then the
        claim is still this process's)."""
        self._outstanding.discard(rid)
        if settled:
            self._held.discard(rid)
            self._cap_leases.pop(rid, None)
        if rid == self._alone:
            self._alone = None
        if self._suspects_waiting and not self._outstanding:
            # a suspect waits for this consumer to hold nothing: end its wait now
            self._undrain()
            if self._bell is not None:
                self.broker.wakeups.unblock(self._bell_id)
        with self._settled:
            self._settled.notify()

    def ack(self, message: MessageProxy) -> None:
        """The end of a delivery: on a lane, its settle handed to the settler (the worker
        thread goes on to its next message at once); elsewhere Dramatiq's ack."""
        if not self._lane or not isinstance(message, Delivery):
            self._plain_settle(message, "ack")
            return
        settlement = message.settlement
        follow_up = settlement.retry or settlement.handoff
        outcome: Outcome = "ack"
        if follow_up is not None:
            outcome = "retry"
        elif settlement.completed:
            outcome = "completed"
        self._end(message, outcome, follow_up)

    def nack(self, message: MessageProxy) -> None:
        if not self._lane or not isinstance(message, Delivery):
            self._plain_settle(message, "dead")
            return
        self._end(message, "dead", None)

    def _plain_settle(self, message: MessageProxy, outcome: Outcome) -> None:
        """Dramatiq's ack or nack, sent from the worker thread (a queue that is not a lane)."""
        rid = _redis_id(message)
        settled = True
        try:
            if outcome == "dead":
                self.broker.do_nack(self.queue_name, rid)
            else:
                self.broker.do_ack(self.queue_name, rid)
        except redis.RedisError as exc:
            # Dramatiq retries the ack until Redis takes it (any Redis error: one it does not
            # retry, such as a write refused at maxmemory, would leave the message unsettled
            # until this worker stops)
            settled = False
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        finally:
            self._done(rid, settled=settled)

    def _end(
        self,
        delivery: Delivery,
        outcome: Outcome,
        follow_up: tuple[Message[Any], int | None] | None,
    ) -> None:
        """A lane delivery ended (its handler ran, or the gate refused it): settled as its
        hold and settlement say."""
        rid = delivery.redis_message_id
        self._running.pop(rid, None)
        self._waiting.discard(rid)
        self.broker.holds.ended(delivery)
        if delivery.hold in ("dropped", "revoked"):
            # never started (an ask dropped it), or taken over once its hold ran out: what
            # became of its message was written by whoever dropped or took it
            self._done(rid)
            return
        if delivery.hold == "given_back" or delivery.settlement.requeue:
            self._give_back(delivery)
            return
        self.settler.put(
            Pending(
                self._entry(delivery, outcome, follow_up),
                lambda result: self._settled_one(delivery, outcome, follow_up, result),
                thread=threading.get_ident(),
                urgent=delivery.slot is not None,
                follow_up=follow_up,
            )
        )

    def _give_back(self, delivery: Delivery) -> None:
        """A run cut short (its lease or hold could not be renewed) or never started: its
        message goes back to its queue as if never delivered, its slot with it. Redis not
        answering raises Dramatiq's ``ConnectionClosed``: Dramatiq retries until it does."""
        rid = delivery.redis_message_id
        settled = True
        try:
            self.broker.do_requeue(self.queue_name, rid)
            if delivery.slot is not None:
                self.broker.release_slots(self.queue_name, [delivery.slot])
        except redis.RedisError as exc:
            settled = False
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        finally:
            self._done(rid, settled=settled)

    def _entry(
        self,
        delivery: Delivery,
        outcome: Outcome,
        follow_up: tuple[Message[Any], int | None] | None,
    ) -> SettleEntry:
        settlement = delivery.settlement
        return self.broker.settle_entry(
            delivery.redis_message_id,
            outcome,
            message_id=str(delivery.message_id),
            run=settlement.run,
            retry=follow_up,
            slot=delivery.slot,
            actor=delivery.actor_name,
            dedup=settlement.dedup,
            tombstone=_written_by_enqueue(delivery),
            result=settlement.result,
            batch=settlement.batch,
        )

    def _settled_one(
        self,
        delivery: Delivery,
        outcome: Outcome,
        follow_up: tuple[Message[Any], int | None] | None,
        result: int,
    ) -> None:
        """The settle of ``delivery`` landed with ``result`` (in the settler's thread). A
        reply of :data:`DEDUP_FOLLOW_UP` (nothing of the delivery written: its key holds a
        follow-up) hands the key over first (:meth:`Settlement.hand_over_dedup`), then
        settles it again without the key."""
        if result & DEDUP_FOLLOW_UP:
            delivery.settlement.hand_over_dedup()
            self.settler.put(
                Pending(
                    self._entry(delivery, outcome, follow_up),
                    lambda again: self._settled_one(delivery, outcome, follow_up, again),
                    urgent=True,
                    follow_up=follow_up,
                )
            )
            return
        if not result & SETTLED_MINE:
            logger.warning(
                "message %s was recovered by another worker before its ack; "
                "its outcome is left to that delivery",
                delivery.message_id,
            )
        elif follow_up is not None:
            self.broker.emit_after("enqueue", *follow_up)
        self._done(delivery.redis_message_id)

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        """Put ``messages`` (the held ones Dramatiq's worker did not start, and what this
        consumer fetched but did not hand out) back on the queue, their deliveries undone.
        Redis not answering raises Dramatiq's ``ConnectionClosed``, which its consumer thread
        survives (a raw Redis error raised while it closes a consumer would end the thread)."""
        rids = [_redis_id(message) for message in messages]
        with self._claim_lock:  # closing: no settle claims for this consumer from now on
            self._closed = True
            rids += [rid for rid, _, _ in self._cache]
            rids += [delivery.redis_message_id for delivery in self._ready]
            self._cache.clear()
            self._ready.clear()
        # held ones that a late thread might still take never start now
        self.broker.holds.drop_all(self.queue_name)
        rids = list(dict.fromkeys(rids))
        if not rids:
            return
        try:
            self.broker.do_requeue(self.queue_name, *rids)
            slots = [lease[:2] for rid in rids if (lease := self._cap_leases.get(rid))]
            self.broker.release_slots(self.queue_name, slots)
        except redis.RedisError as exc:  # any: Dramatiq's close() lets only its own through
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        for rid in rids:
            self._waiting.discard(rid)
            self._done(rid)


def _shape_problem(message: Message[Any], queue_name: str) -> str | None:
    """What in a decoded message would crash Dramatiq's worker, or ``None``."""
    if not isinstance(message.actor_name, str):
        return f"actor_name must be a string, got {message.actor_name!r:.40}"
    if not isinstance(message.options, dict):
        return "options must be a JSON object"
    if not isinstance(message.args, list | tuple) or not isinstance(message.kwargs, dict):
        return "args must be a list and kwargs an object"
    if not isinstance(message.message_id, str) or not message.message_id:
        return "message_id must be a non-empty string"
    if message.queue_name != queue_name:
        return f"queue_name must be {queue_name!r}, got {message.queue_name!r:.60}"
    return None


def _redis_id(message: MessageProxy) -> str:
    if isinstance(message, Delivery):
        return message.redis_message_id
    return str(message.options["redis_message_id"])


def _written_by_enqueue(message: MessageProxy) -> bool:
    """Whether ``message`` may have been written by an enqueue command, whose re-send its end
    must leave a tombstone for: not a retry (``kumiko_failures`` > 0) or a sequential
    hand-off (trigger "requeue"), which the settle of the delivery before wrote."""
    options = message.options
    return not options.get(FAILURES) and options.get(TRIGGER) != "requeue"
