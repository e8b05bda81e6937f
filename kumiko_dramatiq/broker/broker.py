"""Dramatiq's Redis broker, kumiko's way: :class:`KumikoBroker` and its commands.

Everything that knows how Dramatiq keeps messages in Redis lives in this package: the key
layout (:mod:`kumiko_dramatiq.broker.keys`), the broker commands (enqueue, fetch, ack, nack,
requeue, purge, qsize, maintenance: kumiko's own Lua in ``lua/``, writing exactly the state
Dramatiq's own dispatch script writes), and the consumer that Dramatiq's worker pulls
messages from (:mod:`kumiko_dramatiq.broker.consumer`). What leans on Dramatiq's internals
is in :mod:`kumiko_dramatiq.broker.seam`; ``tests/integration/test_layout.py`` runs
Dramatiq's own commands and these on the same keys and compares the Redis state, so a
Dramatiq release that changes its layout fails that test. Dramatiq is pinned to the minor
series checked (see docs/upgrading.md).

What kumiko adds on top of that layout, each in the same Lua call as the command it rides on:

- **redis ids derived from message ids** (:meth:`KumikoBroker.prepare`): a kumiko message's
  first write takes :func:`~kumiko_dramatiq.ids.redis_message_id` of its message id, a retry
  the one of its attempt, a sequential hand-off one of two ids of its origin
  (:func:`~kumiko_dramatiq.ids.handoff_redis_id`), where Dramatiq draws a random one: so the
  admin's ``cancel`` finds a waiting message by reading a few hash fields, and no index of
  message ids is written on the hot path. Plain Dramatiq messages, and a written copy enqueued
  again, keep random ids;
- **idempotent enqueue** (:meth:`KumikoBroker.enqueue`): the pool re-sends a command once when
  a connection drops; if the first send had executed, Dramatiq's enqueue would store the
  message twice. A new message on a lane queue is written only if neither its body nor the
  "sent" key of its redis message id (``keys.sent``) exists: while it waits or runs its body
  is there; where it ends, the same Lua call leaves the key for the resend window (a
  completion its "already completed" marker instead, which makes the fetch drop a copy). So
  the hot path writes no key of its own. Elsewhere (a delay queue, whose due move deletes the
  body, and a plain actor's queue) each write sets that key for the window, and a write that
  finds it does nothing;
- **delayed messages on a schedule** (:meth:`KumikoBroker.encode`, :meth:`KumikoBroker.move_due`):
  where Dramatiq appends a delayed message to its ``<queue>.DQ`` list, which every worker reads
  into memory and holds until due, kumiko's enqueue puts its id on the queue's schedule, a
  sorted set by due time (:func:`~kumiko_dramatiq.broker.keys.queue_schedule`, Redis's clock),
  and its body, already in the form it takes on the queue, in the delay queue's hash. The
  consumer of a delay queue holds nothing: it moves due messages onto the queue in bounded
  atomic batches (``lua/move.lua``, whichever process comes first), moves what an older writer
  left on the ``.DQ`` list onto the schedule (``lua/schedule_legacy.lua``) and sleeps until the
  next due time or the delay queue's doorbell. Dramatiq's own middleware still sees a delayed
  message as Dramatiq builds it (on ``<queue>.DQ``, with its ``eta``), but once, at enqueue: a
  due message's move is not an enqueue;
- **enqueue steps** (:meth:`KumikoBroker.enqueue_step`): a message written together with a
  guard or record (fan-out children, cron ticks, boot-once jobs, dedup keys, hand-offs);
- **settlement on ack** (:class:`~kumiko_dramatiq.broker.delivery.Settlement`): what the run
  left for its ack to write, the retry of a failed attempt
  (:mod:`kumiko_dramatiq.middleware.retries`) or the "already completed" marker
  (:mod:`kumiko_dramatiq.middleware.history`);
- **caps at the fetch** (``capped_queues``, ``lua/include/caps.lua``): on a lane queue with a
  capped job (``max_running``, ``rate_limit``), the fetch claims a capped message only when
  its job has a free slot (taken in the same call, a lease of ``slot_ttl_ms``) and its rate
  window allows, else sets it waiting in Redis; the settle gives the slot back and looks at
  the waiters (:mod:`kumiko_dramatiq.middleware.caps`). Other queues do no cap work at all;
- **strict fetch**: a fetched message that does not decode is dead-lettered by its redis id
  with a logged reason (Dramatiq's consumer would crash on it and leave it unacked, a poison
  pill returning with every crash recovery); on a kumiko lane, a message whose id already
  completed is acked unrun inside the fetch.

Two more duties ride on the signals the broker emits, with no middleware of their own:

- **lanes**: a worker that was given no queues (``dramatiq kumiko_dramatiq.app`` without
  ``--queues``, or a ``dramatiq.Worker`` built on ``runner.broker``) consumes, like any
  Dramatiq worker, the queue of every actor declared on the broker, and delay queues with
  them, except the dataset's other lane (``f"{queue_prefix}-{lane}"`` for every lane but the
  broker's own): kumiko's jobs of the other lane wait for that lane's workers, while a plain
  ``@dramatiq.actor``'s queue (``default``, say) is consumed. At ``worker_boot`` the worker's
  queues become its lane plus every queue declared so far that is not another lane; each
  queue declared later joins them unless it is another lane. A worker given queues
  (``dramatiq --queues``, ``JobRunner.start()``, which consumes its lane only) keeps them;
- **the running deliveries** (:attr:`KumikoBroker.running`): which delivery each worker
  thread processes, from ``before_process_message`` until its ``after_*`` hooks ran (the
  actor body finds its execution there, :meth:`KumikoBroker.current`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple
from uuid import UUID, uuid4, uuid5

import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import current_millis, dq_name, q_name
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from dramatiq.worker import Worker
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.connection import connection_pool
from kumiko_dramatiq.broker.consumer import KumikoConsumer
from kumiko_dramatiq.broker.delivery import (
    SETTLED_MINE,
    Delivery,
    LaneFetch,
    MessagePolicy,
    Outcome,
    RunWrite,
)
from kumiko_dramatiq.broker.keys import queue_list, queue_messages
from kumiko_dramatiq.broker.lua import LuaFunction, LuaScripts
from kumiko_dramatiq.broker.replies import as_list, text
from kumiko_dramatiq.broker.seam import (
    HookTable,
    NoCommandFallback,
    consumed_queues,
    copy_message,
    emit_after,
    emit_before,
    encode_message,
    set_consumed_queues,
    worker_thread_count,
)
from kumiko_dramatiq.broker.settling import LINGER_S, SettleBatcher
from kumiko_dramatiq.codec import TRIGGER
from kumiko_dramatiq.ids import redis_message_id as derived_redis_id
from kumiko_dramatiq.options import LANES, lane_queue

logger = logging.getLogger("kumiko_dramatiq")


#: How long a "sent" key lives (the marker of a new message off the lane queues, the tombstone
#: of a lane message whose body ended otherwise than completed): the window in which a
#: re-sent write is recognised (redis-py re-sends within a second). The "already completed"
#: markers live as long by default: the one window in which a second copy of a completed
#: message could still be written (see :mod:`kumiko_dramatiq.middleware.history`).
RESEND_WINDOW_MS = 60_000

#: Dramatiq's maintenance chance is counted per this many broker calls.
MAINTENANCE_SCALE = 1_000_000

#: One settle call in this many also trims the run history (ages and cap), dropping at most
#: this many records beyond the cap: the trimming keeps pace with the writes at a shared cost.
TRIM_BUDGET = 32

#: How long a settle may vouch for the TTLs of the run indexes (a job's and a status's) it
#: refreshed last: while every record of a settle call goes to indexes this process refreshed
#: less than this long ago, the call refreshes none (two writes fewer per call; an index
#: lives 2 minutes longer than its longest-lived record, ``include/history.lua``). An index
#: that vanishes meanwhile (emptied, a Redis restarted without persistence) comes back without
#: a TTL until this process's next refresh, within the minute; if the process dies first and
#: nobody writes that job and status again, the entries of that minute keep no TTL.
INDEX_VOUCH_S = 60.0

#: The arguments of one delivery in a ``lua/settle.lua`` call; a delivery's extras (its tenant,
#: origin, dead letter's note, retry and dedup end: :data:`NO_EXTRAS` for most) follow all
#: of the call's deliveries.
SETTLE_FIELDS: Final = 11
NO_EXTRAS: Final = ("",) * 7


_MOVED_NAMESPACE = UUID("9d4b7e0c-2f5a-5c8e-b1d3-7a6f4c2e9b01")


class KumikoBroker(NoCommandFallback, RedisBroker):
    """Dramatiq's ``RedisBroker`` with kumiko's consumer, commands and enqueue steps.

    ``lua`` holds every kumiko script, registered on the broker's client. ``queue_prefix``
    names the dataset and ``lane`` the lane its workers consume (``None``: no lane rule);
    ``resend_window_ms`` is the lifetime of the "sent" keys and ``completed_ttl_ms`` that of
    the "already completed" markers (both :data:`RESEND_WINDOW_MS` unless given; public
    attributes, so a test can shorten them). Dramatiq's maintenance (a dead worker's messages
    back to their queue) runs on a broker
    call with chance ``maintenance_chance`` per million and, whatever the chance, on a queue
    whose last maintenance by this broker is older than :attr:`maintenance_interval_ms`
    (a quarter of ``heartbeat_timeout``): a consumer calls at least once per idle wait, so a
    dead worker's messages are back within ``heartbeat_timeout`` + that interval + one
    idle wait of its last heartbeat, as long as some worker consumes the queue.
    """

    def __init__(
        self,
        *,
        client: redis.Redis,
        middleware: list[Middleware],
        heartbeat_timeout: int,
        maintenance_chance: int,
        dead_message_ttl: int,
        queue_prefix: str,
        lane: str | None = None,
        completed_ttl_ms: int = RESEND_WINDOW_MS,
        resend_window_ms: int = RESEND_WINDOW_MS,
        max_deliveries: int = 5,
        message_policy: MessagePolicy | None = None,
        run_ttls_ms: tuple[int, int] = (86_400_000, 604_800_000),
        history_cap: int = 100_000,
        capped_queues: frozenset[str] = frozenset(),
        slot_ttl_ms: int = 30_000,
    ) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            client=client,
            middleware=middleware,
            heartbeat_timeout=heartbeat_timeout,
            maintenance_chance=maintenance_chance,
            dead_message_ttl=dead_message_ttl,
        )
        self.queue_prefix = queue_prefix
        #: the lane queue this broker's workers consume, and the dataset's other lanes
        self.lane_queue = None if lane is None else lane_queue(queue_prefix, lane)
        self.other_lanes = frozenset(
            lane_queue(queue_prefix, each) for each in LANES if each != lane
        )
        #: the workers that were given no queues (their queues follow the lane rule)
        self._routed: list[Worker] = []
        #: the delivery each worker thread processes now (by thread ident)
        self.running: dict[int, Delivery] = {}
        self.completed_ttl_ms = completed_ttl_ms
        self.resend_window_ms = resend_window_ms
        self.maintenance_interval_ms = max(1, heartbeat_timeout // 4)
        #: when this broker last ran maintenance on each queue (ms)
        self._maintained: dict[str, int] = {}
        self.max_deliveries = max_deliveries
        self.message_policy = message_policy
        #: (TTL of completed records, TTL of failed ones) in ms
        self.run_ttls_ms = run_ttls_ms
        self.history_cap = history_cap
        #: the lane queues of jobs with caps (their fetch keeps the caps, ``lua/include/caps.lua``)
        #: and the lease TTL of a slot; any other queue's fetch does no cap work at all
        self.capped_queues = capped_queues
        self.slot_ttl_ms = slot_ttl_ms
        self._identity = (0, "")
        #: per queue, the redis ids this process's consumers fetched and have not settled yet
        #: (handed to Dramatiq's worker, or running; see ``KumikoConsumer``, "lost claims")
        self.held: dict[str, set[str]] = {}
        #: Redis client ids of this broker's consumers blocked on a doorbell, by consumer
        self._blocked: dict[int, int] = {}
        #: called with (queue name, reason) for each message a consumer dead-letters at fetch,
        #: before any middleware sees it: reason "worker_died" (the poison bound) or
        #: "malformed" (it does not decode into what kumiko or Dramatiq writes)
        self.fetch_dead_letter_listeners: list[Callable[[str, str], None]] = []
        #: guards the blocked consumers, the stopping flag and the thread clients
        self._lock = threading.Lock()
        #: each thread's own client (:meth:`thread_client`), and all of them
        self._threads = threading.local()
        self._thread_clients: list[tuple[threading.Thread, redis.Redis]] = []
        self._threads_pid = os.getpid()
        self._stopping = False
        #: gathers the settles of deliveries that end at about the same time into one call
        self.settler = SettleBatcher(self.settle_batch, self.settle_expected)
        #: worker threads of the workers booted on this broker, and a moving average of the
        #: time a delivery takes from ``before_process_message`` to its after hooks (seconds)
        self.worker_threads = 0
        self._processing_s = 0.0
        self.lua = LuaScripts.register(client)
        #: queue name -> (its counts hash, the kind of its fields): see :meth:`_counts_of`
        self._counts_keys: dict[str, tuple[str, str]] = {}
        #: (job, status) -> when a settle of this process last refreshed the TTLs of the run
        #: indexes of that job and status (monotonic s): see :meth:`_vouched`
        self._indexes_refreshed: dict[tuple[str, str], float] = {}
        #: kumiko's chain (``id()`` of the middleware built with); later ones are guests
        self._chain = frozenset(id(each) for each in self.middleware)
        self._hooks: HookTable | None = None
        #: whether ``process_boot`` was emitted (:meth:`add_middleware` boots late ones)
        self.booted = False

    @property
    def consumer_class(self) -> type[KumikoConsumer]:
        return KumikoConsumer

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> KumikoConsumer:
        return KumikoConsumer(self, queue_name, prefetch, timeout)

    def emit_before(self, signal: str, *args: Any, **kwargs: Any) -> None:
        if signal == "process_message":
            if isinstance(args[0], Delivery):
                args[0].started_at = time.time()
                self.running[threading.get_ident()] = args[0]
        elif signal == "worker_boot":
            self._stopping = False
            self.route_worker(args[0])
            self.worker_threads += worker_thread_count(args[0])
        elif signal == "declare_queue":
            self._route_declared(args[0])
        elif signal == "worker_shutdown":
            self.wake_consumers()
        emit_before(self, self._current_hooks(), "before_" + signal, *args, **kwargs)

    def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None:
        if signal == "process_boot":
            self.booted = True
        emit_after(self, self._current_hooks(), "after_" + signal, *args, **kwargs)
        if signal in ("process_message", "skip_message"):
            delivery = self.running.pop(threading.get_ident(), None)
            if delivery is not None and delivery.started_at is not None:
                took = time.time() - delivery.started_at
                self._processing_s += (took - self._processing_s) / 16
        elif signal == "worker_shutdown":  # its threads are gone
            self.worker_threads = max(0, self.worker_threads - worker_thread_count(args[0]))
            self._routed = [each for each in self._routed if each is not args[0]]
            self.close_thread_clients()

    def current(self) -> Delivery | None:
        """The delivery the calling worker thread processes now, if any."""
        return self.running.get(threading.get_ident())

    def _current_hooks(self) -> HookTable:
        """The hook table of ``self.middleware`` as it is now (see the seam)."""
        hooks = self._hooks
        if hooks is None or hooks.middleware != self.middleware:
            hooks = self._hooks = HookTable(self.middleware, self._chain)
        return hooks

    def consumes(self, queue_name: str) -> bool:
        """Whether a worker of this broker that was given no queues consumes ``queue_name``
        (every queue but the dataset's other lanes, and their delay queues)."""
        return q_name(queue_name) not in self.other_lanes

    def route_worker(self, worker: Worker) -> None:
        """Apply the lane rule to ``worker`` (at its ``worker_boot``; see the module)."""
        if self.lane_queue is None or consumed_queues(worker):
            return
        declared = self.get_declared_queues()
        set_consumed_queues(
            worker, {self.lane_queue} | {q_name(q) for q in declared if self.consumes(q)}
        )
        self._routed.append(worker)

    def _route_declared(self, queue_name: str) -> None:
        if not self.consumes(queue_name):
            return
        for worker in self._routed:
            queues = consumed_queues(worker)
            assert queues is not None
            queues.add(q_name(queue_name))

    def add_middleware(
        self,
        middleware: Middleware,
        *,
        before: type[Middleware] | None = None,
        after: type[Middleware] | None = None,
    ) -> None:
        """Dramatiq's ``add_middleware``. Added after the broker was built, a middleware is a
        guest (:mod:`kumiko_dramatiq.broker.seam`): appended after kumiko's chain unless placed,
        it sees no sequential hand-off; added after the process booted, it is booted at once."""
        super().add_middleware(middleware, before=before, after=after)
        if getattr(self, "booted", False):
            middleware.after_process_boot(self)

    def wake_consumers(self) -> None:
        """Unblock every consumer of this broker waiting on a doorbell (``CLIENT UNBLOCK``)
        and keep them from blocking again until a worker boots: a worker that shuts down
        does not wait out an idle wait."""
        with self._lock:
            self._stopping = True
            client_ids = list(self._blocked.values())
        for client_id in client_ids:
            self.unblock(client_id)

    def unblock(self, client_id: int) -> None:
        """End the blocking wait of Redis client ``client_id`` now (a no-op if it is not
        blocked; a Redis error is logged: the wait ends by its timeout)."""
        try:
            self.client.client_unblock(client_id)
        except redis.RedisError as exc:
            logger.debug("could not unblock a consumer's wait (%s)", exc)

    def is_lane(self, queue_name: str) -> bool:
        """Whether ``queue_name`` is one of this dataset's lane queues (not a delay queue)."""
        return queue_name.startswith(f"{self.queue_prefix}-") and not keys.is_delay_queue(
            queue_name
        )

    # -- broker commands (Dramatiq's semantics, kumiko's Lua) --------------------------------
    def _head(self, queue_name: str, *, maintenance: bool = True) -> list[Any]:
        """The two arguments every broker command starts with (``lua/include/dispatch.lua``)."""
        now = current_millis()
        due = maintenance and (
            random.randint(1, MAINTENANCE_SCALE) <= self.maintenance_chance
            or now - self._maintained.setdefault(queue_name, now) >= self.maintenance_interval_ms
        )
        if due:
            self._maintained[queue_name] = now
        return [
            queue_name,
            f"{now} {self.broker_id} {self.heartbeat_timeout} "
            f"{self.dead_message_ttl} {1 if due else 0}",
        ]

    def do_enqueue(self, queue_name: str, redis_message_id: str | bytes, data: bytes) -> None:
        self.lua.enqueue(
            keys=[self.namespace], args=[*self._head(queue_name), redis_message_id, data]
        )

    def do_fetch(self, queue_name: str, count: int) -> list[bytes | None]:
        """Dramatiq's fetch: up to ``count`` encoded messages (``None`` for a vanished one)."""
        return [body for _, body in self.fetch(queue_name, count)]

    def fetch(self, queue_name: str, count: int) -> list[tuple[str, bytes | None]]:
        """Dramatiq's fetch, with the redis id of each message: ``[(rid, body or None)]``."""
        reply = self.lua.fetch(keys=[self.namespace], args=[*self._head(queue_name), count])
        return [(text(reply[i]), reply[i + 1]) for i in range(0, len(reply), 2)]

    def fetch_lane(
        self, queue_name: str, count: int, *, outstanding: int, client: redis.Redis | None = None
    ) -> LaneFetch:
        """Claim up to ``count`` messages of a lane queue (``lua/fetch_lane.lua``), on
        ``client`` (the calling thread's :meth:`thread_client`) or the broker's pool."""
        reply = self._call(
            self.lua.fetch_lane,
            client,
            keys=[
                self.namespace,
                keys.inflight(self.queue_prefix),
                keys.suspects(self.queue_prefix, queue_name),
            ],
            args=[*self._head(queue_name), *self._claim_args(queue_name, count, outstanding)],
        )
        return self._lane_fetch(queue_name, reply)

    def _claim_args(self, queue_name: str, count: int, outstanding: int) -> list[Any]:
        """``fetch_lane``'s ARGV[3..7] (also the claim at the end of a ``settle``)."""
        completed_ttl, failed_ttl = self.run_ttls_ms
        args: list[Any] = [
            f"{count} {outstanding} {self.max_deliveries} {completed_ttl} {failed_ttl}",
            keys.completed(self.queue_prefix, ""),
            keys.root(self.queue_prefix),
            self.worker_identity(),
        ]
        if queue_name in self.capped_queues:
            args.append(self.slot_ttl_ms)
        return args

    def _lane_fetch(self, queue_name: str, reply: Any) -> LaneFetch:
        """``fetch_lane``'s reply, decoded."""
        capped = queue_name in self.capped_queues
        fetched, completed, buried, waiting, alone = reply[:5]
        slots: dict[str, tuple[str, str]] = {}
        caps_due_in_ms = None
        if capped:
            taken = reply[5]
            for i in range(0, len(taken), 3):
                slots[text(taken[i])] = (text(taken[i + 1]), text(taken[i + 2]))
            caps_due_in_ms = None if int(reply[6]) < 0 else int(reply[6])
        return LaneFetch(
            fetched=[(text(fetched[i]), fetched[i + 1]) for i in range(0, len(fetched), 2)],
            completed=[text(message_id) for message_id in completed],
            buried=[(text(buried[i]), int(buried[i + 1])) for i in range(0, len(buried), 2)],
            suspects_waiting=int(waiting),
            alone=alone == 1,
            slots=slots,
            caps_due_in_ms=caps_due_in_ms,
        )

    def worker_identity(self) -> str:
        """``"host:pid"`` of this process (looked up again after a fork)."""
        pid = os.getpid()
        if self._identity[0] != pid:
            self._identity = (pid, f"{socket.gethostname()}:{pid}")
        return self._identity[1]

    def do_ack(self, queue_name: str, redis_message_id: str) -> None:
        self.lua.ack(
            keys=[self.namespace],
            args=[*self._head(queue_name, maintenance=False), redis_message_id],
        )

    def do_nack(self, queue_name: str, redis_message_id: str) -> None:
        self.lua.nack(
            keys=[self.namespace],
            args=[*self._head(queue_name, maintenance=False), redis_message_id],
        )

    def do_requeue(self, queue_name: str, *redis_message_ids: str) -> None:
        lane = [keys.inflight(self.queue_prefix)] if self.is_lane(queue_name) else []
        self.lua.requeue(
            keys=[self.namespace, *lane], args=[*self._head(queue_name), *redis_message_ids]
        )

    def do_purge(self, queue_name: str) -> None:
        self.lua.purge(keys=[self.namespace], args=self._head(queue_name))

    def do_qsize(self, queue_name: str) -> int:
        return int(self.lua.qsize(keys=[self.namespace], args=self._head(queue_name)))

    def settle(
        self,
        queue_name: str,
        redis_message_id: str,
        outcome: Outcome,
        *,
        message_id: str,
        retry: tuple[Message[Any], int | None] | None = None,
        run: RunWrite | None = None,
        client: redis.Redis | None = None,
        slot: tuple[str, str] | None = None,
        claimer: KumikoConsumer | None = None,
        actor: str = "",
        dedup: tuple[str, str, str] | None = None,
        tombstone: bool = True,
    ) -> int:
        """The outcome of one delivery from a lane queue (``lua/settle.lua``), sent together
        with the settles of the other deliveries of ``queue_name`` that end at about the same
        time (:class:`~kumiko_dramatiq.broker.settling.SettleBatcher`), on ``client``, the
        calling thread's :meth:`thread_client`, or the broker's pool; returns when it is
        written, with its reply: :data:`SETTLED_MINE` set unless the delivery was no longer this
        worker's and its recovered copy was taken by another worker already (then nothing but
        its in-flight entry, marker and run record was written); or :data:`DEDUP_FOLLOW_UP`
        alone if ``dedup`` (index, message id, key: the job ended for good under that dedup key)
        found the key's record holding a follow-up: then nothing of the delivery was written,
        for the caller to hand the key over and settle it again without ``dedup`` (else the
        record was freed, if it still pointed at the message). ``slot``: the (slots key, owner
        token) of the capped job's slot the delivery holds, given back in the same call (also
        when it is not this worker's any more: the token is this delivery's own); such a settle
        is sent without waiting to gather others. ``claimer``: the consumer the delivery came
        from, whose next messages the call may claim too (:meth:`settle_batch`). ``actor``: the
        message's actor name as decoded at fetch ("" if not known): its per-job count is then
        kept without reading its body back into the script. ``tombstone``: whether an outcome
        other than "completed" leaves the "sent" tombstone of ``redis_message_id`` (see
        :meth:`enqueue`); ``False`` for a copy a settle wrote (a retry, a hand-off), whose
        redis id no enqueue command carries."""
        header: tuple[str, ...] = ("", "", "", "", "")
        record = tenant = origin = note = ""
        if run is not None:
            header = (
                run.message_id,
                str(run.attempt),
                run.job,
                run.status,
                "" if run.started_ms is None else str(run.started_ms),
            )
            record, tenant, note = run.record, run.tenant, run.dead_note
            origin = "" if run.origin == run.message_id else run.origin
        retried: tuple[Any, ...] = ("", "", "")
        if retry is not None:
            message, delay = retry
            retried = (
                message.queue_name,
                message.options["redis_message_id"],
                self.encode(message, delay),
            )
        extras = (tenant, origin, note, *retried, "" if dedup is None else "\t".join(dedup))
        entry: list[Any] = [
            redis_message_id,
            outcome if slot is None else f"{outcome} {slot[0]} {slot[1]}",
            keys.completed(self.queue_prefix, message_id)
            if outcome == "completed"
            else keys.sent(self.queue_prefix, redis_message_id)
            if tombstone
            else "",
            *header,
            record,
            actor,
        ]
        if extras == NO_EXTRAS:
            entry.append("")
        else:
            entry += ["+", *extras]
        done = self.settler.settle(
            queue_name, entry, client, claimer=claimer, urgent=slot is not None
        )
        if done & SETTLED_MINE and retry is not None:
            self.emit_after("enqueue", *retry)
        return done

    def settle_batch(
        self,
        queue_name: str,
        entries: Sequence[Sequence[Any]],
        client: redis.Redis | None,
        claimers: Sequence[object | None] = (),
    ) -> list[int]:
        """One call of ``lua/settle.lua`` for ``entries`` (each the :data:`SETTLE_FIELDS`
        arguments of one delivery, then its extras if it has them: those go after every
        delivery's fields); one reply per entry. When the first of ``claimers`` (the consumers
        the deliveries came from) has room once they are settled, the same call claims its
        next messages (:meth:`KumikoConsumer.begin_claim`), as its own fetch would: a steadily
        draining consumer sends no fetch of its own, and a capped job's slot given back here
        goes to the waiter that this consumer can start at once. That call also runs
        maintenance when due (the consumer's fetches, which did, become rare)."""
        consumer = next((each for each in claimers if isinstance(each, KumikoConsumer)), None)
        claim = None
        if consumer is not None:
            claim = consumer.begin_claim(
                [
                    entry[0]
                    for entry, each in zip(entries, claimers, strict=False)
                    if each is consumer
                ]
            )
        try:
            trim = TRIM_BUDGET if random.random() < len(entries) / TRIM_BUDGET else 0
            completed_ttl, failed_ttl = self.run_ttls_ms
            indexes, vouched = self._vouched(entries)
            args: list[Any] = [
                *self._head(queue_name, maintenance=claim is not None),
                f"{len(entries)} {self.completed_ttl_ms} {completed_ttl} {failed_ttl} "
                f"{self.history_cap} {trim} {self.resend_window_ms} {int(vouched)}",
                keys.root(self.queue_prefix),
            ]
            extras: list[Any] = []
            for entry in entries:
                args.extend(entry[:SETTLE_FIELDS])
                extras.extend(entry[SETTLE_FIELDS:])
            args.extend(extras)
            if claim is not None:
                room, held = claim
                args.extend(self._claim_args(queue_name, room, held))
            sent_at = time.monotonic()
            reply = self._call(
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
                    self._indexes_refreshed[index] = sent_at
            replies = reply
            if claim is not None and consumer is not None:
                replies = reply[0]
                fetch = self._lane_fetch(queue_name, reply[1])
                claim = None
                consumer.claimed(fetch, sent_at, room)  # ends the claim
        finally:
            if consumer is not None and claim is not None:
                consumer.end_claim(lost=True)
        return [int(each) for each in replies]

    def _vouched(self, entries: Sequence[Sequence[Any]]) -> tuple[set[tuple[str, str]], bool]:
        """The (job, status) of each run record among settle ``entries``, and whether this
        process refreshed the TTLs of all their indexes less than :data:`INDEX_VOUCH_S` ago
        (then the call does not refresh them; when it does, they count as refreshed when it
        was sent, once it answered). A malformed delivery's record is the job's its body
        names, not known here: never vouched for."""
        indexes: set[tuple[str, str]] = set()
        for entry in entries:
            status = entry[6]
            if status == "malformed":
                return indexes, False
            if entry[3] and status:
                indexes.add((entry[5], status))
        since = time.monotonic() - INDEX_VOUCH_S
        refreshed = self._indexes_refreshed
        return indexes, all(refreshed.get(index, since) > since for index in indexes)

    def settle_expected(self, queue_name: str) -> int:
        """How many settles of ``queue_name`` a batch may wait for (0: send at once): every
        delivery this process holds of it, at most one per worker thread, while deliveries
        take less than the batch's linger to process (a moving average); else none."""
        if self._processing_s > LINGER_S or self.worker_threads < 2:
            return 0
        return min(self.worker_threads, len(self.held.get(queue_name, ())))

    def release_slots(self, queue_name: str, slots: Sequence[tuple[str, str]]) -> None:
        """Give back capped jobs' slots ((slots key, owner token) each) of deliveries that
        go back to ``queue_name`` unrun or cut short (``lua/slot_release.lua``). A Redis error
        is logged, not raised: the slots then wait out their leases."""
        if not slots:
            return
        try:
            self.lua.slot_release(
                keys=[key for key, _ in slots],
                args=[
                    queue_name,
                    queue_list(queue_name, self.namespace),
                    *(token for _, token in slots),
                ],
            )
        except redis.RedisError as exc:
            logger.warning(
                "could not give back %d slot(s) of capped jobs on %s (%s); they are free "
                "again once their leases run out",
                len(slots),
                queue_name,
                exc,
            )

    @staticmethod
    def _call(
        script: Script | LuaFunction,
        client: redis.Redis | None,
        *,
        keys: list[str],
        args: list[Any],
    ) -> Any:
        """Run ``script`` on ``client`` (a :meth:`thread_client`) or the broker's pool. A kept
        connection is dropped on any exception, an interruption included (Dramatiq raises
        ``TimeLimitExceeded`` and ``Shutdown`` into worker threads): a reply left unread
        would be read as the next command's. (The pool probes each connection it hands out
        for that; a kept one is not handed out.) It reconnects on its next command.

        On a kept connection it sends ``EVALSHA`` (``FCALL`` for a :class:`LuaFunction`)
        itself and loads the script when the server does not have it, as
        ``Script.__call__`` does, without that call's copies of the arguments and its
        ``isinstance`` check against redis-py's ``Pipeline`` protocol (a few microseconds of
        every enqueue and settle)."""
        if client is None:
            return script(keys=keys, args=args)
        if isinstance(script, LuaFunction):
            try:
                return script.call(client, keys, args)
            except BaseException:
                if client.connection is not None:
                    client.connection.disconnect()  # type: ignore[no-untyped-call]
                raise
        try:
            command = client.execute_command
            try:
                return command("EVALSHA", script.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]
            except redis.exceptions.NoScriptError:
                script.sha = client.script_load(script.script)
                return command("EVALSHA", script.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]
        except BaseException:
            if client.connection is not None:
                client.connection.disconnect()  # type: ignore[no-untyped-call]
            raise

    # -- enqueueing --------------------------------------------------------------------------
    def prepare(
        self, message: Message[Any], delay: int | None, *, redis_message_id: str | None = None
    ) -> Message[Any]:
        """Give ``message`` a redis message id and, if delayed, its delay queue and eta: what
        Dramatiq's enqueue does before it writes. The id is ``redis_message_id`` if given;
        for a kumiko message written the first time (one that carries kumiko's options and
        no redis id yet), the one its message id derives
        (:func:`~kumiko_dramatiq.ids.redis_message_id`: ``cancel`` finds it without a
        search); else a random one, as Dramatiq draws."""
        if redis_message_id is not None:
            rid = redis_message_id
        elif TRIGGER in message.options and "redis_message_id" not in message.options:
            rid = derived_redis_id(str(message.message_id))
        else:
            rid = str(uuid4())
        message = copy_message(message, {"redis_message_id": rid})
        if delay is not None:
            message = message.copy(
                queue_name=dq_name(message.queue_name),
                options={"eta": current_millis() + delay},
            )
        return message

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Dramatiq's enqueue, made idempotent: the pool re-sends a command once when a
        connection drops, and if the first send had executed, Dramatiq's enqueue would store
        the message twice. On a lane queue the message is written unless its body is there
        already or its "sent" key (``keys.sent``) holds the tombstone its end left for
        :attr:`resend_window_ms` (``lua/include/guarded.lua``): no key of its own on the hot
        path. Elsewhere (a delay queue, a plain actor's queue) it is written behind that key,
        set for the window. A delayed message goes on its queue's schedule
        (:meth:`encode`)."""
        prepared = self.prepare(message, delay)
        rid = prepared.options["redis_message_id"]
        self.emit_before("enqueue", prepared, delay)
        counts, kind = self._counts_of(prepared.queue_name)
        self._call(
            self.lua.guarded_enqueue,
            self.thread_client(),
            keys=[*self._queue_keys(prepared), keys.sent(self.queue_prefix, rid), counts],
            args=[
                rid,
                self.encode(prepared, delay),
                self._sent_ttl(message.queue_name, delay),
                "1",
                f"{kind}:{prepared.actor_name}",
            ],
        )
        self.emit_after("enqueue", prepared, delay)
        return prepared

    @staticmethod
    def encode(prepared: Message[Any], delay: int | None) -> bytes:
        """What an enqueue script is handed for ``prepared`` (a message from :meth:`prepare`):
        its encoding, or for a delayed one ``b"<delay ms> "`` and the encoding of the message
        as it will wait on its queue once due (its queue's name, no ``eta``), which
        ``lua/include/enqueue.lua`` puts on the queue's schedule at Redis's clock plus the
        delay. Dramatiq's worker would hold a fetched message that has an ``eta`` in memory
        until due: the stored form has none, so a due message's move rewrites nothing."""
        if delay is None or not keys.is_delay_queue(prepared.queue_name):
            return encode_message(prepared)
        waiting = prepared.copy(queue_name=q_name(prepared.queue_name))
        waiting.options.pop("eta", None)
        return b"%d " % max(0, int(delay)) + encode_message(waiting)

    def move_due(self, queue_name: str, limit: int) -> MoveResult:
        """Move up to ``limit`` due delayed messages of delay queue ``queue_name``
        (``<queue>.DQ``) onto ``<queue>`` in one atomic step (``lua/move.lua``), by Redis's
        clock, on the calling thread's client."""
        moved, next_due, now, legacy = self._call(
            self.lua.move,
            self.thread_client(),
            keys=[self.namespace],
            args=[*self._head(queue_name), limit],
        )
        return MoveResult(
            int(moved), None if int(next_due) < 0 else int(next_due), int(now), int(legacy)
        )

    def schedule_legacy(self, queue_name: str, limit: int) -> int:
        """Move up to ``limit`` messages from the head of Dramatiq's own list of delay queue
        ``queue_name`` (written by an older version or a plain ``RedisBroker``) onto the
        queue's schedule, at their ``eta`` (``lua/schedule_legacy.lua``); returns how many it
        took off the list (a cancelled one, whose body is gone, is dropped). Each
        is re-encoded here in the form it takes on its queue (Lua could not re-encode a message
        without changing it); one that does not decode is scheduled as it is, due now: the
        queue's consumer dead-letters it with a logged reason."""
        client = self.thread_client()
        rids = [
            text(rid)
            for rid in client.lrange(keys.queue_list(queue_name, self.namespace), 0, limit - 1)
        ]
        if not rids:
            return 0
        bodies = client.hmget(keys.queue_messages(queue_name, self.namespace), rids)
        args: list[Any] = []
        now = current_millis()
        for rid, body in zip(rids, bodies, strict=True):
            if body is None:
                args += [rid, now, b""]  # cancelled: the step drops its id
                continue
            if not isinstance(body, bytes):
                body = str(body).encode()
            try:
                message = Message.decode(body)
                eta = message.options.get("eta")
                due = int(eta) if isinstance(eta, int | float) else now
                waiting = message.copy(queue_name=q_name(queue_name))
                waiting.options.pop("eta", None)
                args += [rid, due, waiting.encode()]
            except Exception:
                args += [rid, now, body]
        scheduled = self._call(
            self.lua.schedule_legacy,
            client,
            keys=[self.namespace],
            args=[*self._head(queue_name, maintenance=False), *args],
        )
        return int(scheduled)

    def enqueue_step(
        self,
        message: Message[Any],
        script: Script,
        *,
        keys: Sequence[str] = (),
        args: Sequence[Any] = (),
        delay: int | None = None,
    ) -> tuple[Message[Any], list[Any]]:
        """Run enqueue step ``script`` (see :mod:`kumiko_dramatiq.broker.lua`) for ``message``: one
        Lua call that writes the message together with the step's own ``keys``/``args``.

        Returns the prepared message and the script's reply as a list; the script's first
        reply item is 1 iff it enqueued the message (``after_enqueue`` runs only then).
        """
        prepared = self.prepare(message, delay)
        self.emit_before("enqueue", prepared, delay)
        reply = as_list(
            self._call(
                script,
                self.thread_client(),
                keys=[*self._queue_keys(prepared), *keys],
                args=[prepared.options["redis_message_id"], self.encode(prepared, delay), *args],
            )
        )
        if reply[0] == 1:
            self.emit_after("enqueue", prepared, delay)
        return prepared, reply

    def enqueue_batch(
        self,
        messages: Sequence[Message[Any]],
        script: Script,
        *,
        args: Sequence[Any],
        leads: Sequence[Any] | Callable[[Message[Any]], Any],
        tails: Sequence[Sequence[Any]] | None = None,
        delay: int | None = None,
    ) -> list[Any]:
        """Run batch enqueue step ``script`` for ``messages`` (all on ONE queue): one Lua call
        with ``KEYS`` = the queue's hash and list, ``ARGV`` = ``args``, then per message its
        ``leads[i]`` (or ``leads(prepared message)``), redis message id, encoded message and
        ``tails[i]``. The script returns
        the same number of items per message, the first 1 iff it enqueued the message. Every
        message passes ``before_enqueue``; those enqueued pass ``after_enqueue``. Returns the
        script's reply."""
        if not messages:
            return []
        prepared = [self.prepare(message, delay) for message in messages]
        queue_names = {message.queue_name for message in prepared}
        if len(queue_names) != 1:
            raise ValueError(f"a batch targets one queue, got {sorted(queue_names)}")
        argv: list[Any] = list(args)
        for i, message in enumerate(prepared):
            self.emit_before("enqueue", message, delay)
            lead = leads(message) if callable(leads) else leads[i]
            argv += (lead, message.options["redis_message_id"], self.encode(message, delay))
            if tails is not None:
                argv += tails[i]
        reply = as_list(script(keys=list(self._queue_keys(prepared[0])), args=argv))
        step = len(reply) // len(prepared)
        for i, message in enumerate(prepared):
            if reply[i * step] == 1:
                self.emit_after("enqueue", message, delay)
        return reply

    def enqueue_guarded_batch(
        self,
        messages: Sequence[Message[Any]],
        guard_keys: Sequence[str] | Callable[[Message[Any]], str],
        *,
        guard_ttl_ms: int,
        guard_value: str,
        delay: int | None = None,
    ) -> list[bool]:
        """Enqueue each message (all on ONE queue) unless its guard exists, writing guard and
        message together: one Lua call for the whole batch. Returns, per message, whether it
        was enqueued."""
        reply = self.enqueue_batch(
            messages,
            self.lua.guarded_enqueue_batch,
            args=[guard_ttl_ms, guard_value],
            leads=guard_keys,
            delay=delay,
        )
        return [flag == 1 for flag in reply]

    def enqueue_many(self, messages: Sequence[Message[Any]], *, delay: int | None = None) -> None:
        """:meth:`enqueue` for many new messages of ONE queue: one Lua call, each message
        guarded by its own "sent" key as :meth:`enqueue` writes it."""
        self.enqueue_guarded_batch(
            messages,
            lambda message: keys.sent(self.queue_prefix, message.options["redis_message_id"]),
            guard_ttl_ms=self._sent_ttl(messages[0].queue_name if messages else "", delay),
            guard_value="1",
            delay=delay,
        )

    def _sent_ttl(self, queue_name: str, delay: int | None) -> int:
        """The guard TTL of the "sent" key of a new message for ``queue_name``: 0 if it goes
        straight onto a lane queue (the key is only read there: the tombstone a body's end
        leaves, see ``lua/include/guarded.lua``), else the resend window."""
        return 0 if delay is None and self.is_lane(queue_name) else self.resend_window_ms

    def _counts_of(self, queue_name: str) -> tuple[str, str]:
        """The per-job counts hash of the queue a message is written to (its delay queue's
        goes to its queue's) and the kind of its field there: "d" on a delay queue, else
        "q" (``lua/include/counts.lua``)."""
        found = self._counts_keys.get(queue_name)
        if found is None:
            queue = q_name(queue_name)
            kind = "d" if queue_name == dq_name(queue) else "q"
            found = (keys.queue_counts(queue, self.namespace), kind)
            self._counts_keys[queue_name] = found
        return found

    def _queue_keys(self, message: Message[Any]) -> tuple[str, str]:
        return (
            queue_messages(message.queue_name, self.namespace),
            queue_list(message.queue_name, self.namespace),
        )

    def boot_process(self) -> None:
        """Emit ``process_boot``, as Dramatiq's CLI does in each worker process. An in-process
        worker (``JobRunner.start()``) must do it itself: ``Worker.start()`` does not, and
        Dramatiq's ``TimeLimit`` starts its timer thread there."""
        self.emit_after("process_boot")

    def thread_client(self) -> redis.Redis:
        """A client on one connection of the calling thread's own, from the broker's pool: what
        the hot paths talk on (a consumer's fetches, a worker thread's settles, every single
        enqueue). A command on it skips the pool's check-out and return, which in redis-py
        cost more CPU than a settle (each checked-out connection is probed for unread data, a
        system call, and the pool's usage recorded). Given back to the pool once its thread
        has ended (checked whenever a thread takes its first one, and when a worker shuts
        down) or when the broker closes: a process holds one per live thread that used it.
        A forked child never uses its parent's (it would talk on the parent's socket): the
        first call after a fork forgets them, as redis-py's pool forgets its connections."""
        if self._threads_pid != os.getpid():
            # a forked child's first call: the parent's lock may be held by a thread that is
            # not here, so nothing of the parent's is kept, the lock included
            self._lock = threading.Lock()
            self._threads = threading.local()
            self._thread_clients = []
            self._threads_pid = os.getpid()
        client: redis.Redis | None = getattr(self._threads, "client", None)
        if client is None:
            client = redis.Redis(
                connection_pool=self.client.connection_pool, single_connection_client=True
            )
            self._threads.client = client
            with self._lock:
                self._thread_clients.append((threading.current_thread(), client))
            self.close_thread_clients()  # a producer's threads come and go
        return client

    def close_thread_clients(self, *, live_ones_too: bool = False) -> None:
        """Give the :meth:`thread_client` connections of threads that have ended back to the
        pool (a worker's threads, once it shut down); ``live_ones_too``: every one (a live
        thread that asks again gets a new one). A live thread's is kept otherwise: it may be
        in the middle of a command (a worker thread that outlived the worker's stop timeout)."""
        done: list[redis.Redis] = []
        kept: list[tuple[threading.Thread, redis.Redis]] = []
        with self._lock:
            for thread, client in self._thread_clients:
                if live_ones_too or not thread.is_alive():
                    done.append(client)
                else:
                    kept.append((thread, client))
            self._thread_clients = kept
            if live_ones_too:
                self._threads = threading.local()
        for client in done:
            with contextlib.suppress(redis.RedisError):
                client.close()

    def close(self) -> None:
        """Disconnect every connection of the broker's pool."""
        self.close_thread_clients(live_ones_too=True)
        self.client.connection_pool.disconnect()


class MoveResult(NamedTuple):
    """What one ``lua/move.lua`` step did: ``moved`` messages onto the queue; the ``next_due``
    time left on the schedule (ms, Redis's clock; ``None``: none); Redis's clock ``now`` (ms);
    ``legacy``: the length of Dramatiq's own delay queue list (work for
    :meth:`KumikoBroker.schedule_legacy`)."""

    moved: int
    next_due: int | None
    now: int
    legacy: int


def moved_redis_id(delayed_redis_id: str, queue_name: str) -> str:
    """The redis id a delayed message took on ``queue_name`` when an older version's worker
    moved it there from Dramatiq's delay queue list (derived, so that a second move of the
    same delayed copy was a no-op); ``cancel`` still looks there, for a rolling deploy."""
    return str(uuid5(_MOVED_NAMESPACE, f"{delayed_redis_id}>{queue_name}"))


def make_connection_pool(redis_url: str, timeout_s: float) -> redis.ConnectionPool:
    """A runner's pool: connect and read timeouts of ``timeout_s``, and one quick reconnect
    on a dropped connection, never on a timeout (redis-py's default retries ten times,
    timeouts included, which turns an unreachable Redis into a minute-long hang). Any URL
    form of :mod:`kumiko_dramatiq.broker.connection` (TLS, Sentinel, ...); a Sentinel pool
    follows the sentinels' fail-over events (:mod:`kumiko_dramatiq.broker.failover`)."""
    return connection_pool(
        redis_url,
        timeout_s=timeout_s,
        follow_failovers=True,
        retry=Retry(
            ExponentialBackoff(cap=0.5, base=0.05), 1, supported_errors=(redis.ConnectionError,)
        ),
    )
