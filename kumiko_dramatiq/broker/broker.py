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
from typing import Any

import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import current_millis, q_name
from dramatiq.middleware import Middleware, SkipMessage
from dramatiq.worker import Worker
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.carrier import carrier
from kumiko_dramatiq.broker.connection import connection_pool
from kumiko_dramatiq.broker.consumer import KumikoConsumer
from kumiko_dramatiq.broker.delivery import Delivery, LaneFetch, MessagePolicy
from kumiko_dramatiq.broker.enqueueing import Enqueueing
from kumiko_dramatiq.broker.holds import HoldReply, Holds
from kumiko_dramatiq.broker.keys import queue_list
from kumiko_dramatiq.broker.lua import LuaFunction, LuaScripts
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.broker.seam import (
    HookTable,
    NoCommandFallback,
    consumed_queues,
    emit_after,
    emit_before,
    set_consumed_queues,
    worker_thread_count,
)
from kumiko_dramatiq.broker.settling import Claim, SettleCalls
from kumiko_dramatiq.broker.wakeups import Wakeups
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


class KumikoBroker(NoCommandFallback, Enqueueing, SettleCalls, RedisBroker):
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
            namespace=keys.namespace(queue_prefix),
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
        #: called with (queue name, reason) for each message a consumer dead-letters at fetch,
        #: before any middleware sees it: reason "worker_died" (the poison bound) or
        #: "malformed" (it does not decode into what kumiko or Dramatiq writes)
        self.fetch_dead_letter_listeners: list[Callable[[str, str], None]] = []
        #: guards the thread clients
        self._lock = threading.Lock()
        #: each thread's own client (:meth:`thread_client`), and all of them
        self._threads = threading.local()
        self._thread_clients: list[tuple[threading.Thread, redis.Redis]] = []
        self._threads_pid = os.getpid()
        #: the consumers' waits on doorbells, and whether the broker's workers are stopping
        self.wakeups = Wakeups(client)
        #: what this broker's consumers hold ahead of their threads (broker/holds.py)
        self.holds = Holds(self)
        #: whether :meth:`close` ran
        self.closed = False
        #: worker threads of the workers booted on this broker, and a moving average of the
        #: time a delivery takes from ``before_process_message`` to its after hooks (seconds)
        self.worker_threads = 0
        self.job_s = 0.0
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
            delivery = args[0]
            if isinstance(delivery, Delivery):
                # the gate of a delivery's start: one its consumer dropped (held ahead and
                # cancelled, purged or paused meanwhile) never starts, and no hook sees it
                consumer = delivery.consumer
                if consumer is not None and not consumer.start(delivery):
                    raise SkipMessage(f"message {delivery.message_id} was dropped unstarted")
                delivery.started_at = time.time()
                self.running[threading.get_ident()] = delivery
        elif signal == "worker_boot":
            self.wakeups.resume()
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
        elif signal == "skip_message" and isinstance(args[0], Delivery) and args[0].refused:
            return  # dropped at the gate: it never started, no hook saw it begin
        emit_after(self, self._current_hooks(), "after_" + signal, *args, **kwargs)
        if signal in ("process_message", "skip_message"):
            delivery = self.running.pop(threading.get_ident(), None)
            if delivery is not None and delivery.started_at is not None:
                took = time.time() - delivery.started_at
                self.job_s += (took - self.job_s) / 16
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
        """Unblock every consumer of this broker waiting on a doorbell and keep them from
        blocking again until a worker boots: a worker that shuts down does not wait out an
        idle wait (:meth:`Wakeups.stop`)."""
        self.wakeups.stop()

    @property
    def stopping(self) -> bool:
        """Whether the broker's workers are shutting down."""
        return self.wakeups.stopping

    def hold_ttls(self) -> str:
        """``"<completed TTL> <failed TTL> <sent TTL>"`` (ms): what a held message dropped
        for a cancel writes (``lua/include/holds.lua``)."""
        completed_ttl, failed_ttl = self.run_ttls_ms
        return f"{completed_ttl} {failed_ttl} {self.resend_window_ms}"

    def is_lane(self, queue_name: str) -> bool:
        """Whether ``queue_name`` is one of this dataset's lane queues (not a delay queue)."""
        return queue_name.startswith(f"{self.queue_prefix}-") and not keys.is_delay_queue(
            queue_name
        )

    # -- broker commands (Dramatiq's semantics, kumiko's Lua) --------------------------------
    def command_head(self, queue_name: str, *, maintenance: bool = True) -> list[Any]:
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
            keys=[self.namespace], args=[*self.command_head(queue_name), redis_message_id, data]
        )

    def do_fetch(self, queue_name: str, count: int) -> list[bytes | None]:
        """Dramatiq's fetch: up to ``count`` encoded messages (``None`` for a vanished one)."""
        return [body for _, body in self.fetch(queue_name, count)]

    def fetch(self, queue_name: str, count: int) -> list[tuple[str, bytes | None]]:
        """Dramatiq's fetch, with the redis id of each message: ``[(rid, body or None)]``."""
        reply = self.lua.fetch(keys=[self.namespace], args=[*self.command_head(queue_name), count])
        return [(text(reply[i]), reply[i + 1]) for i in range(0, len(reply), 2)]

    def fetch_lane(
        self, queue_name: str, claim: Claim, *, client: redis.Redis | None = None
    ) -> tuple[LaneFetch, HoldReply, float]:
        """Claim what ``claim`` says of a lane queue (``lua/fetch_lane.lua``) with this
        broker's hold block, on ``client`` (the calling thread's :meth:`thread_client`) or the
        broker's pool: what it claimed, its hold block's reply (already applied) and when the
        call was sent (monotonic s)."""
        block = self.holds.block(queue_name)
        try:
            reply = self.call(
                self.lua.fetch_lane,
                client,
                keys=[
                    self.namespace,
                    keys.inflight(self.queue_prefix),
                    keys.suspects(self.queue_prefix, queue_name),
                ],
                args=[
                    *self.command_head(queue_name),
                    *self.claim_args(queue_name, claim),
                    *block.args,
                ],
            )
        except BaseException:
            self.holds.failed(block)
            raise
        holds = HoldReply.decode(reply[-1])
        self.holds.applied(block, holds)
        return self.lane_fetch(queue_name, reply[:-2], int(reply[-2])), holds, block.sent_at

    def claim_args(self, queue_name: str, claim: Claim) -> list[Any]:
        """``fetch_lane``'s ARGV[3..7] for ``claim`` (also the claim at the end of a settle)."""
        completed_ttl, failed_ttl = self.run_ttls_ms
        return [
            f"{claim.room} {claim.holding} {self.max_deliveries} {completed_ttl} {failed_ttl} "
            f"{claim.now}",
            keys.completed(self.queue_prefix, ""),
            keys.root(self.queue_prefix),
            self.worker_identity(),
            self.slot_ttl_ms if queue_name in self.capped_queues else "",
        ]

    def lane_fetch(self, queue_name: str, reply: Any, now: int | None = None) -> LaneFetch:
        """A claim's reply (``fetch_lane``'s, or a settle's claim), decoded; ``now``: how many
        of the messages claimed (the first) run now, the rest held (``None``: all run now)."""
        capped = queue_name in self.capped_queues
        fetched, completed, buried, waiting, alone = reply[:5]
        slots: dict[str, tuple[str, str]] = {}
        caps_due_in_ms = None
        if capped:
            taken = reply[5]
            for i in range(0, len(taken), 3):
                slots[text(taken[i])] = (text(taken[i + 1]), text(taken[i + 2]))
            caps_due_in_ms = None if int(reply[6]) < 0 else int(reply[6])
        messages = [(text(fetched[i]), fetched[i + 1]) for i in range(0, len(fetched), 2)]
        return LaneFetch(
            fetched=messages,
            completed=[text(message_id) for message_id in completed],
            buried=[(text(buried[i]), int(buried[i + 1])) for i in range(0, len(buried), 2)],
            suspects_waiting=int(waiting),
            alone=alone == 1,
            slots=slots,
            caps_due_in_ms=caps_due_in_ms,
            now=len(messages) if now is None else now,
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
            args=[*self.command_head(queue_name, maintenance=False), redis_message_id],
        )

    def do_nack(self, queue_name: str, redis_message_id: str) -> None:
        self.lua.nack(
            keys=[self.namespace],
            args=[*self.command_head(queue_name, maintenance=False), redis_message_id],
        )

    def do_requeue(self, queue_name: str, *redis_message_ids: str) -> None:
        lane = [keys.inflight(self.queue_prefix)] if self.is_lane(queue_name) else []
        self.lua.requeue(
            keys=[self.namespace, *lane], args=[*self.command_head(queue_name), *redis_message_ids]
        )

    def do_purge(self, queue_name: str) -> None:
        self.lua.purge(keys=[self.namespace], args=self.command_head(queue_name))

    def do_qsize(self, queue_name: str) -> int:
        return int(self.lua.qsize(keys=[self.namespace], args=self.command_head(queue_name)))

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
    def call(
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
        first call after a fork forgets them, as redis-py's pool forgets its connections.
        Inside :func:`~kumiko_dramatiq.broker.carrier.carried`: the carrier."""
        found = carrier()
        if found is not None:
            return found
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
        self.closed = True
        self.close_thread_clients(live_ones_too=True)
        self.client.connection_pool.disconnect()


def make_connection_pool(
    redis_url: str, timeout_s: float, queue_prefix: str | None = None
) -> redis.ConnectionPool:
    """A runner's pool: connect and read timeouts of ``timeout_s``, and one quick reconnect
    on a dropped connection, never on a timeout (redis-py's default retries ten times,
    timeouts included, which turns an unreachable Redis into a minute-long hang). Any URL
    form of :mod:`kumiko_dramatiq.broker.connection` (TLS, Sentinel, ...); a Sentinel pool
    follows the sentinels' fail-over events (:mod:`kumiko_dramatiq.broker.failover`), a
    cluster pool the primary of ``queue_prefix``'s slot (:mod:`kumiko_dramatiq.broker.cluster`)."""
    return connection_pool(
        redis_url,
        timeout_s=timeout_s,
        follow_failovers=True,
        queue_prefix=queue_prefix,
        retry=Retry(
            ExponentialBackoff(cap=0.5, base=0.05), 1, supported_errors=(redis.ConnectionError,)
        ),
    )
