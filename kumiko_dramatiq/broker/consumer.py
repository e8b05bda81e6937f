"""The consumer Dramatiq's worker pulls the messages of one queue from."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import redis
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.common import current_millis
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message

from kumiko_dramatiq.broker.delivery import Delivery, Outcome, RunWrite
from kumiko_dramatiq.broker.keys import consumer_acks, is_delay_queue, queue_bell
from kumiko_dramatiq.broker.replies import text

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

    **Delay queues** (``<queue>.DQ``, for which Dramatiq's worker runs a consumer of its own)
    hold nothing in memory: the consumer never hands a message to Dramatiq's worker. It moves
    due messages from the queue's schedule onto the queue, :data:`MOVE_BATCH` at a time
    (:meth:`KumikoBroker.move_due`; whichever process's consumer comes first moves them, in
    one atomic step), and what an older writer left on Dramatiq's ``.DQ`` list onto the
    schedule (:meth:`KumikoBroker.schedule_legacy`), then sleeps until the next due time (by
    Redis's clock, its last Redis clock tick, :data:`REDIS_TICK_MS`, slept locally so a due
    message moves on time), the delay queue's doorbell (rung by an enqueue that becomes the
    earliest) or ``2 * timeout``.

    On a kumiko lane queue a fetched message is a running one: Dramatiq's worker asks for
    twice its threads (``prefetch``), but the consumer holds at most ``prefetch // 2``
    messages, so every message it fetches goes straight to an idle thread (no message waits
    in a worker's memory where ``cancel`` could not reach it). It fetches when half its
    threads are free (or all of them), so a batch still serves several messages, and while
    they are all busy it waits for an ack, not for a poll.

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
    made, which Dramatiq does again after a connection error) the consumer puts back on the
    queue every id of its ack set that this process does not hold (``requeue``: a lane
    message's delivery is undone, it never ran). Held means fetched and not settled yet, by
    any consumer of this queue in this process (a failed ack keeps its claim held until
    Dramatiq's retry of it lands).
    """

    def __init__(self, broker: KumikoBroker, queue_name: str, prefetch: int, timeout: int) -> None:
        self.broker = broker
        self.queue_name = queue_name
        self.prefetch = prefetch
        self.timeout = timeout
        self.misses = 0
        self._lane = broker.is_lane(queue_name)
        self._delayed = is_delay_queue(queue_name)
        #: how many messages this consumer holds at most, and the free room it fetches at
        self._slots = max(1, prefetch // 2) if self._lane else prefetch
        self._batch = max(1, self._slots // 2) if self._lane else 1
        self._cache: deque[tuple[str, bytes | None]] = deque()
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
        #: the doorbell, the connection that waits on it and that connection's client id
        self._bell_key = queue_bell(queue_name, broker.namespace)
        self._bell: redis.Redis | None = None
        self._bell_id = 0

    @property
    def outstanding_message_count(self) -> int:
        """Messages fetched and not yet acked, nacked or requeued (cached ones included)."""
        return len(self._outstanding) + len(self._cache)

    def __next__(self) -> Delivery | None:
        try:
            if self._delayed:
                try:
                    self._move_due()
                except redis.RedisError as exc:
                    # any Redis error (a timeout, a refused write): Dramatiq restarts the
                    # consumer after its restart delay, and the next one moves what is due
                    raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
                return None
            if current_millis() - self._claims_checked_ms >= self.broker.maintenance_interval_ms:
                self._give_back_lost_claims()
            while True:
                if self._cache:
                    delivery = self._deliver(*self._cache.popleft())
                    if delivery is not None:
                        self.misses = 0
                        return delivery
                    continue
                if self._fill():
                    continue
                with self._settled:
                    if self.outstanding_message_count > self._slots - self._batch:
                        # Busy: wait for an ack to free room (bounded, so Dramatiq's loop goes
                        # round to notice a shutdown). Checked under the condition's lock, which
                        # a settling thread takes to notify, so no settle slips in between.
                        self._settled.wait(self.timeout / 1000)
                        return None
                self._idle(self._caps_due_in())
                return None
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]

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
        queue's next due time), or ``2 * timeout`` ms pass."""
        wait_ms = 2 * self.timeout
        if due_in_ms is not None:
            wait_ms = min(wait_ms, due_in_ms)
            if wait_ms <= REDIS_TICK_MS:
                time.sleep(max(wait_ms, 0) / 1000)
                return
            wait_ms -= REDIS_TICK_MS
        limit_s = self.broker.client.connection_pool.connection_kwargs.get("socket_timeout")
        if limit_s:  # the wait must end before the socket's read timeout
            wait_ms = min(wait_ms, int(limit_s * 1000) - 2 * REDIS_TICK_MS)
        broker = self.broker
        try:
            bell = self._bell_client()
            with broker._lock:
                blocking = not broker._stopping and wait_ms > 0
                if blocking:
                    broker._blocked[id(self)] = self._bell_id
            if blocking:
                bell.blpop([self._bell_key], timeout=wait_ms / 1000)
                return
        except redis.RedisError as exc:
            logger.debug("waiting on the doorbell of %s failed (%s)", self.queue_name, exc)
            self._close_bell()
        finally:
            with broker._lock:
                broker._blocked.pop(id(self), None)
        # shutting down (or the wait failed): poll briefly, so Dramatiq's loop sees the stop
        time.sleep(min(max(wait_ms, 0), self.timeout, REDIS_TICK_MS) / 1000)

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
        """Give the doorbell's connection back to the pool."""
        self._close_bell()

    def _give_back_lost_claims(self) -> None:
        """Requeue the ids of this worker's ack set that this process does not hold (see
        "Lost claims" above). What is held is read before the ack set, and only this thread
        claims for this queue, so an id read as not held is not held; an id settled since is
        no longer in the ack set, and ``requeue`` moves only ids that still are."""
        self._claims_checked_ms = current_millis()
        held = self._held.copy()  # one C call: a worker thread's discard cannot interleave
        held.update(rid for rid, _ in self._cache)
        acks = consumer_acks(self.broker.broker_id, self.queue_name, self.broker.namespace)
        claimed = {text(rid) for rid in self.broker.thread_client().smembers(acks)}
        lost = sorted(claimed - held)
        if lost:
            logger.warning(
                "%d message(s) on %s were claimed for this worker by a fetch whose reply never "
                "came back: putting them back on the queue",
                len(lost),
                self.queue_name,
            )
            self.broker.do_requeue(self.queue_name, *lost)

    def _fill(self) -> bool:
        """Fetch what there is room for; ``False`` if nothing was (or could be) fetched."""
        outstanding = self.outstanding_message_count
        room = self._slots - outstanding
        # while capped messages wait (a slot frees one at a time), any room is worth a fetch
        batching = self._caps_due is None
        if room <= 0 or (outstanding and room < self._batch and batching):
            return False
        if not self._lane:
            fetched = self.broker.fetch(self.queue_name, room)
            self._cache.extend(fetched)
            return bool(fetched)
        if self._alone is not None or (self._suspects_waiting and outstanding):
            return False  # a suspect runs alone, or waits for this consumer to drain
        sent_at = time.monotonic()
        result = self.broker.fetch_lane(
            self.queue_name, room, outstanding=outstanding, client=self.broker.thread_client()
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
        self._cache.extend(result.fetched)
        return bool(result.fetched)

    def _deliver(self, rid: str, body: bytes | None) -> Delivery | None:
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
        self._outstanding.add(rid)
        self._held.add(rid)
        return delivery

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
            self.broker.settle(
                self.queue_name,
                rid,
                outcome,
                message_id=rid,
                run=run,
                slot=None if lease is None else (lease[0], lease[1]),
            )
        elif outcome == "dead":
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
        if self._suspects_waiting and not self._outstanding and self._bell is not None:
            # a suspect waits for this consumer to hold nothing: end its wait now
            self.broker.unblock(self._bell_id)
        with self._settled:
            self._settled.notify()

    def ack(self, message: MessageProxy) -> None:
        rid = _redis_id(message)
        settled = True
        try:
            if not self._lane or not isinstance(message, Delivery):
                self.broker.do_ack(self.queue_name, rid)
                return
            settlement = message.settlement
            if settlement.requeue:
                self.broker.do_requeue(self.queue_name, rid)
                if message.slot is not None:
                    self.broker.release_slots(self.queue_name, [message.slot])
                return
            outcome: Outcome = "ack"
            follow_up = settlement.retry or settlement.handoff
            if follow_up is not None:
                outcome = "retry"
            elif settlement.completed:
                outcome = "completed"
            owned = self.broker.settle(
                self.queue_name,
                rid,
                outcome,
                message_id=str(message.message_id),
                retry=follow_up,
                run=settlement.run,
                client=self.broker.thread_client(),
                slot=message.slot,
            )
            if not owned:
                logger.warning(
                    "message %s was recovered by another worker before its ack; "
                    "its outcome is left to that delivery",
                    message.message_id,
                )
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # Dramatiq retries the ack until Redis takes it; settling twice is safe (the
            # second finds the delivery settled and writes no follow-up again)
            settled = False
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        finally:
            self._done(rid, settled=settled)

    def nack(self, message: MessageProxy) -> None:
        rid = _redis_id(message)
        settled = True
        try:
            if self._lane:
                delivery = message if isinstance(message, Delivery) else None
                self.broker.settle(
                    self.queue_name,
                    rid,
                    "dead",
                    message_id=str(message.message_id),
                    run=None if delivery is None else delivery.settlement.run,
                    slot=None if delivery is None else delivery.slot,
                )
            else:
                self.broker.do_nack(self.queue_name, rid)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # Dramatiq retries the ack until Redis takes it; settling twice is safe (the
            # second finds the delivery settled and writes no follow-up again)
            settled = False
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        finally:
            self._done(rid, settled=settled)

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        """Put ``messages`` (and what this consumer fetched but did not hand out) back on
        the queue. Redis not answering raises Dramatiq's ``ConnectionClosed``, which its
        consumer thread survives (a raw Redis error raised while it closes a consumer would
        end the thread)."""
        rids = [_redis_id(message) for message in messages]
        rids += [rid for rid, _ in self._cache]
        self._cache.clear()
        if not rids:
            return
        try:
            self.broker.do_requeue(self.queue_name, *rids)
            slots = [lease[:2] for rid in rids if (lease := self._cap_leases.get(rid))]
            self.broker.release_slots(self.queue_name, slots)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        for rid in rids:
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
