"""The one seam to Dramatiq's Redis broker: kumiko's implementation of its Redis layout.

Everything that knows how Dramatiq keeps messages in Redis lives here and nowhere else:
the key layout (:func:`queue_list` and friends), the broker commands (enqueue, fetch, ack,
nack, requeue, purge, qsize, maintenance: kumiko's own Lua in ``lua/``, writing exactly the
state Dramatiq's own dispatch script writes), and the consumer that Dramatiq's worker pulls
messages from. Only public Dramatiq names are used (``RedisBroker``, ``Consumer``,
``MessageProxy``, ``Message``, ``dramatiq.common``); ``tests/integration/test_layout.py``
runs Dramatiq's own commands and these on the same keys and compares the Redis state, so a
Dramatiq release that changes its layout fails that test. Dramatiq is pinned to the minor
series checked (see the README, "Upgrading Dramatiq").

What kumiko adds on top of that layout, each in the same Lua call as the command it rides on:

- **idempotent enqueue** (:meth:`KumikoBroker.enqueue`): each write leaves a "sent" marker of
  its redis message id (``keys.sent``), and a write whose marker exists does nothing. The pool
  re-sends a command once when a connection drops; if the first send had executed, Dramatiq's
  enqueue would store the message twice. A worker moves a due delayed message to its queue by
  enqueuing it and then acking it on the delay queue; a crash between the two redelivers the
  delayed copy, whose second move gets the same derived redis id and is a no-op;
- **enqueue steps** (:meth:`KumikoBroker.enqueue_step`): a message written together with a
  guard or record (fan-out children, cron ticks, boot-once jobs, dedup keys, hand-offs);
- **settlement on ack** (:class:`Settlement`): what the run left for its ack to write, the
  retry of a failed attempt (:mod:`kumiko_dramatiq.retries`) or the "already completed" marker
  (:mod:`kumiko_dramatiq.completed`);
- **strict fetch**: a fetched message that does not decode is dead-lettered by its redis id
  with a logged reason (Dramatiq's consumer would crash on it and leave it unacked, a poison
  pill returning with every crash recovery); on a kumiko lane, a message whose id already
  completed is acked unrun inside the fetch.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol
from uuid import UUID, uuid4, uuid5

import redis
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import current_millis, dq_name, q_name
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry

from . import keys
from .connection import connection_pool
from .errors import RedisAccessError
from .guests import Hooks, emit_after, emit_before
from .lua import LuaScripts
from .lua import commands as lua_commands
from .lua import source as lua_source
from .settings import MAINTENANCE_SCALE

logger = logging.getLogger("kumiko_dramatiq")

#: Dramatiq's key namespace.
NAMESPACE = "dramatiq"

#: How long the "sent" marker of a freshly enqueued message lives: the window in which a
#: re-sent write is recognised (redis-py re-sends within a second). The "already completed"
#: markers live as long by default: the one window in which a second copy of a completed
#: message could still be written (see :mod:`kumiko_dramatiq.completed`).
RESEND_WINDOW_MS = 60_000

#: One settle call in this many also trims the run history (ages and cap), dropping at most
#: this many records beyond the cap: the trimming keeps pace with the writes at a shared cost.
TRIM_BUDGET = 32

#: Redis ends a blocked command's timeout on its clock tick (``hz``, 10 a second by default),
#: so a ``BLPOP`` may return up to this much after its timeout: a wait for a due time leaves
#: its last tick to a local sleep.
REDIS_TICK_MS = 100

_MOVED_NAMESPACE = UUID("9d4b7e0c-2f5a-5c8e-b1d3-7a6f4c2e9b01")


# -- Dramatiq's Redis layout ---------------------------------------------------------------
def queue_list(queue_name: str, namespace: str = NAMESPACE) -> str:
    """The list of redis message ids of ``queue_name`` (consumers pop from the left)."""
    return f"{namespace}:{queue_name}"


def queue_messages(queue_name: str, namespace: str = NAMESPACE) -> str:
    """The hash redis message id -> encoded message of ``queue_name``."""
    return f"{namespace}:{queue_name}.msgs"


def consumer_acks(worker_id: str, queue_name: str, namespace: str = NAMESPACE) -> str:
    """The set of redis ids one worker fetched from ``queue_name`` and has not acked."""
    return f"{namespace}:__acks__.{worker_id}.{queue_name}"


def heartbeats(namespace: str = NAMESPACE) -> str:
    """The sorted set of worker ids by last heartbeat (ms)."""
    return f"{namespace}:__heartbeats__"


def queue_bell(queue_name: str, namespace: str = NAMESPACE) -> str:
    """The doorbell of a queue (kumiko's, beside Dramatiq's layout): a list holding at most
    one token, pushed by every write onto the queue, that idle consumers wait on."""
    return f"{queue_list(queue_name, namespace)}:bell"


def dead_letters(queue_name: str, namespace: str = NAMESPACE) -> str:
    """The sorted set of dead-lettered redis ids of ``queue_name`` (its ``.XQ``), by time."""
    return f"{namespace}:{q_name(queue_name)}.XQ"


def dead_letter_messages(queue_name: str, namespace: str = NAMESPACE) -> str:
    """The hash redis id -> encoded message of ``queue_name``'s dead letters."""
    return f"{dead_letters(queue_name, namespace)}.msgs"


# -- what an ack writes --------------------------------------------------------------------
@dataclass(frozen=True)
class RunWrite:
    """A run record the settle call writes (see :mod:`kumiko_dramatiq.history`)."""

    message_id: str
    attempt: int
    job: str
    #: the run's status; "" drops the running record (a hand-off, no attempt)
    status: str
    tenant: str
    origin: str
    record: str
    dead_note: str


@dataclass
class Settlement:
    """What the ack of one delivery writes besides the ack itself (one Lua call in all).

    ``retry``: the prepared retry of a failed attempt and its delay, enqueued with the ack;
    ``handoff``: likewise, a sequential job's hand-off (a new message) when its lock is held;
    ``completed``: the message completed, so the ack also writes its "already completed"
    marker (at most one of the three is set); ``run``: the run record to write.
    """

    retry: tuple[Message[Any], int | None] | None = None
    handoff: tuple[Message[Any], int | None] | None = None
    completed: bool = False
    run: RunWrite | None = None


class Delivery(MessageProxy):
    """One delivery of a message to this worker: Dramatiq's proxy, plus the queue and redis
    id it was fetched under, what its ack should write (:class:`Settlement`) and kumiko's
    per-delivery state (``execution``, set by :mod:`kumiko_dramatiq.executions`)."""

    def __init__(self, message: Message[Any], *, fetched_from: str, redis_message_id: str) -> None:
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
        self.settlement = Settlement()
        #: what the broker's ``message_policy`` decoded from the message (kumiko's options)
        self.decoded: object = None
        self.execution: object | None = None


#: What ``settle`` does with a delivery: forget it ("ack"), forget it and mark its id
#: completed, forget it and enqueue its retry, or dead-letter it.
Outcome = Literal["ack", "completed", "retry", "dead"]


class MessagePolicy(Protocol):
    """What the broker's owner says about the messages its consumers fetch."""

    def check(self, message: Message[Any]) -> tuple[str | None, object]:
        """Why a decoded ``message`` must be dead-lettered (``None``: it is fine), and
        anything to keep on its :class:`Delivery` (``decoded``)."""

    def rejected(self, message: Message[Any]) -> None:
        """``message`` was dead-lettered by ``check``, before it ran: clean up after it."""


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


# -- the broker ----------------------------------------------------------------------------
class KumikoBroker(RedisBroker):
    """Dramatiq's ``RedisBroker`` with kumiko's consumer, commands and enqueue steps.

    ``lua`` holds every kumiko script, registered on the broker's client. ``queue_prefix``
    names the dataset; ``resend_window_ms`` is the lifetime of the "sent" markers and
    ``completed_ttl_ms`` that of the "already completed" markers (both
    :data:`RESEND_WINDOW_MS` unless given; public attributes, so a test can shorten them).
    Dramatiq's maintenance (a dead worker's messages back to their queue) runs on a broker
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
        completed_ttl_ms: int = RESEND_WINDOW_MS,
        resend_window_ms: int = RESEND_WINDOW_MS,
        max_deliveries: int = 5,
        message_policy: MessagePolicy | None = None,
        run_ttls_ms: tuple[int, int] = (86_400_000, 604_800_000),
        history_cap: int = 100_000,
    ) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            client=client,
            middleware=middleware,
            heartbeat_timeout=heartbeat_timeout,
            maintenance_chance=maintenance_chance,
            dead_message_ttl=dead_message_ttl,
        )
        self.queue_prefix = queue_prefix
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
        #: redis ids of delayed messages this process's delay-queue consumers hold, and of
        #: those already moved by ``move`` (their ack on the delay queue has nothing left to do)
        self._identity = (0, "")
        self._held_delayed: set[str] = set()
        self._moved: set[str] = set()
        #: per queue, the redis ids this process's consumers fetched and have not settled yet
        #: (handed to Dramatiq's worker, or running; see ``KumikoConsumer``, "lost claims")
        self._held: dict[str, set[str]] = {}
        #: Redis client ids of this broker's consumers blocked on a doorbell, by consumer
        self._blocked: dict[int, int] = {}
        #: per delay queue, redis ids a closed consumer held and could not put back
        self._abandoned: dict[str, set[str]] = {}
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
        self.lua = LuaScripts.register(client)
        #: kumiko's chain (``id()`` of the middleware built with); later ones are guests
        self._chain = frozenset(id(each) for each in self.middleware)
        self._hooks: Hooks | None = None
        #: whether ``process_boot`` was emitted (:meth:`add_middleware` boots late ones)
        self.booted = False

    def __getattr__(self, name: str) -> Any:
        # RedisBroker maps unknown ``do_*`` names onto its own dispatch script; every
        # command kumiko supports is a method here, so anything else is an error.
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def consumer_class(self) -> type[KumikoConsumer]:
        return KumikoConsumer

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> KumikoConsumer:
        return KumikoConsumer(self, queue_name, prefetch, timeout)

    def emit_before(self, signal: str, *args: Any, **kwargs: Any) -> None:
        if signal == "worker_boot":
            self._stopping = False
        elif signal == "worker_shutdown":
            self.wake_consumers()
        emit_before(self, self._current_hooks(), "before_" + signal, *args, **kwargs)

    def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None:
        if signal == "process_boot":
            self.booted = True
        emit_after(self, self._current_hooks(), "after_" + signal, *args, **kwargs)
        if signal == "worker_shutdown":  # its threads are gone
            self.close_thread_clients()

    def _current_hooks(self) -> Hooks:
        """The hook table of ``self.middleware`` as it is now (:mod:`kumiko_dramatiq.guests`)."""
        hooks = self._hooks
        if hooks is None or hooks.middleware != self.middleware:
            hooks = self._hooks = Hooks(self.middleware, self._chain)
        return hooks

    def add_middleware(
        self,
        middleware: Middleware,
        *,
        before: type[Middleware] | None = None,
        after: type[Middleware] | None = None,
    ) -> None:
        """Dramatiq's ``add_middleware``. Added after the broker was built, a middleware is a
        guest (:mod:`kumiko_dramatiq.guests`): appended after kumiko's chain unless placed,
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
        return queue_name.startswith(f"{self.queue_prefix}-") and not queue_name.endswith(".DQ")

    # -- broker commands (Dramatiq's semantics, kumiko's Lua) --------------------------------
    def _head(self, queue_name: str, *, maintenance: bool = True) -> list[Any]:
        """The two arguments every broker command starts with (``lua/_dispatch.lua``)."""
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
        return [(_text(reply[i]), reply[i + 1]) for i in range(0, len(reply), 2)]

    def fetch_lane(
        self, queue_name: str, count: int, *, outstanding: int, client: redis.Redis | None = None
    ) -> LaneFetch:
        """Claim up to ``count`` messages of a lane queue (``lua/fetch_lane.lua``), on
        ``client`` (the calling thread's :meth:`thread_client`) or the broker's pool."""
        completed_ttl, failed_ttl = self.run_ttls_ms
        fetched, completed, buried, waiting, alone = self._call(
            self.lua.fetch_lane,
            client,
            keys=[
                self.namespace,
                keys.inflight(self.queue_prefix),
                keys.suspects(self.queue_prefix, queue_name),
            ],
            args=[
                *self._head(queue_name),
                f"{count} {outstanding} {self.max_deliveries} {completed_ttl} {failed_ttl}",
                keys.completed(self.queue_prefix, ""),
                keys.root(self.queue_prefix),
                self.worker_identity(),
            ],
        )
        return LaneFetch(
            fetched=[(_text(fetched[i]), fetched[i + 1]) for i in range(0, len(fetched), 2)],
            completed=[_text(message_id) for message_id in completed],
            buried=[(_text(buried[i]), int(buried[i + 1])) for i in range(0, len(buried), 2)],
            suspects_waiting=int(waiting),
            alone=alone == 1,
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
    ) -> bool:
        """The outcome of one delivery from a lane queue, in one Lua call
        (``lua/settle.lua``, on ``client``, the calling thread's :meth:`thread_client`, or the
        broker's pool); ``False`` if the delivery was no longer this worker's and its
        recovered copy was taken by another worker already (then nothing but its in-flight
        entry, marker and run record was written)."""
        header, record, note = "", "", ""
        if run is not None:
            trim = TRIM_BUDGET if random.random() < 1 / TRIM_BUDGET else 0
            header = "\t".join(
                (
                    keys.root(self.queue_prefix),
                    run.message_id,
                    str(run.attempt),
                    run.job,
                    run.status,
                    run.tenant,
                    run.origin,
                    *map(str, self.run_ttls_ms),
                    str(self.history_cap),
                    str(trim),
                )
            )
            record, note = run.record, run.dead_note
        args = [
            *self._head(queue_name, maintenance=False),
            redis_message_id,
            f"{outcome} {self.completed_ttl_ms}",
            header,
            record,
            note,
        ]
        if retry is not None:
            message = retry[0]
            args += [message.queue_name, message.options["redis_message_id"], message.encode()]
        done = self._call(
            self.lua.settle,
            client,
            keys=[
                self.namespace,
                keys.inflight(self.queue_prefix),
                keys.completed(self.queue_prefix, message_id),
                keys.suspects(self.queue_prefix, queue_name),
            ],
            args=args,
        )
        if done == 1 and retry is not None:
            self.emit_after("enqueue", *retry)
        return bool(done == 1)

    @staticmethod
    def _call(
        script: Script, client: redis.Redis | None, *, keys: list[str], args: list[Any]
    ) -> Any:
        """Run ``script`` on ``client`` (a :meth:`thread_client`) or the broker's pool. A kept
        connection is dropped on any exception, an interruption included (Dramatiq raises
        ``TimeLimitExceeded`` and ``Shutdown`` into worker threads): a reply left unread
        would be read as the next command's. (The pool probes each connection it hands out
        for that; a kept one is not handed out.) It reconnects on its next command."""
        if client is None:
            return script(keys=keys, args=args)
        try:
            return script(keys=keys, args=args, client=client)
        except BaseException:
            if client.connection is not None:
                client.connection.disconnect()  # type: ignore[no-untyped-call]
            raise

    # -- enqueueing --------------------------------------------------------------------------
    def prepare(
        self, message: Message[Any], delay: int | None, *, redis_message_id: str | None = None
    ) -> Message[Any]:
        """Give ``message`` a redis message id (fresh unless given) and, if delayed, its delay
        queue and eta: what Dramatiq's enqueue does before it writes."""
        rid = str(uuid4()) if redis_message_id is None else redis_message_id
        message = message.copy(options={"redis_message_id": rid})
        if delay is not None:
            message = message.copy(
                queue_name=dq_name(message.queue_name),
                options={"eta": current_millis() + delay},
            )
        return message

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Dramatiq's enqueue, made idempotent; a due delayed message's move, made atomic.

        Dramatiq's worker moves a due delayed message by enqueuing a copy (carrying the redis
        id it was delivered under) and then acking it on the delay queue. When that id is one
        this process's delay-queue consumers hold, the copy goes through ``lua/move.lua``: off
        the delay queue and onto the queue in one step, or dropped if it was cancelled meanwhile.
        Anything else is written behind its "sent" marker (``keys.sent``, kept
        :data:`RESEND_WINDOW_MS`): the pool re-sends a command once when a connection drops,
        and if the first send had executed, Dramatiq's enqueue would store the message twice.
        """
        moved_from = message.options.get("redis_message_id")
        if moved_from is not None and delay is None and moved_from in self._held_delayed:
            return self._move(message, moved_from)
        prepared = self.prepare(message, delay)
        rid = prepared.options["redis_message_id"]
        self.emit_before("enqueue", prepared, delay)
        self._call(
            self.lua.guarded_enqueue,
            self.thread_client(),
            keys=[*self._queue_keys(prepared), keys.sent(self.queue_prefix, rid)],
            args=[rid, prepared.encode(), self.resend_window_ms, "1"],
        )
        self.emit_after("enqueue", prepared, delay)
        return prepared

    def _move(self, message: Message[Any], delayed_rid: str) -> Message[Any]:
        rid = str(uuid5(_MOVED_NAMESPACE, f"{delayed_rid}>{message.queue_name}"))
        prepared = self.prepare(message, None, redis_message_id=rid)
        self.emit_before("enqueue", prepared, None)
        moved = self._call(
            self.lua.move,
            self.thread_client(),
            keys=[self.namespace, keys.cancelled(self.queue_prefix, str(message.message_id))],
            args=[
                *self._head(dq_name(prepared.queue_name), maintenance=False),
                delayed_rid,
                prepared.queue_name,
                rid,
                prepared.encode(),
            ],
        )
        self._held_delayed.discard(delayed_rid)
        self._moved.add(delayed_rid)
        if moved == 1:
            self.emit_after("enqueue", prepared, None)
        elif moved == 2:
            logger.info("delayed message %s was cancelled: not moved", message.message_id)
        return prepared

    def enqueue_step(
        self,
        message: Message[Any],
        script: Script,
        *,
        keys: Sequence[str] = (),
        args: Sequence[Any] = (),
        delay: int | None = None,
    ) -> tuple[Message[Any], list[Any]]:
        """Run enqueue step ``script`` (see :mod:`kumiko_dramatiq.lua`) for ``message``: one
        Lua call that writes the message together with the step's own ``keys``/``args``.

        Returns the prepared message and the script's reply as a list; the script's first
        reply item is 1 iff it enqueued the message (``after_enqueue`` runs only then).
        """
        prepared = self.prepare(message, delay)
        self.emit_before("enqueue", prepared, delay)
        reply = _as_list(
            self._call(
                script,
                self.thread_client(),
                keys=[*self._queue_keys(prepared), *keys],
                args=[prepared.options["redis_message_id"], prepared.encode(), *args],
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
            argv += (lead, message.options["redis_message_id"], message.encode())
            if tails is not None:
                argv += tails[i]
        reply = _as_list(script(keys=list(self._queue_keys(prepared[0])), args=argv))
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
        behind its own "sent" marker as :meth:`enqueue` writes it."""
        self.enqueue_guarded_batch(
            messages,
            lambda message: keys.sent(self.queue_prefix, message.options["redis_message_id"]),
            guard_ttl_ms=self.resend_window_ms,
            guard_value="1",
            delay=delay,
        )

    def _queue_keys(self, message: Message[Any]) -> tuple[str, str]:
        return (
            queue_messages(message.queue_name, self.namespace),
            queue_list(message.queue_name, self.namespace),
        )

    def check_access(self, redis_url: str) -> None:
        """Raise :class:`~kumiko_dramatiq.errors.RedisAccessError` (one line) if Redis answers
        but refuses what kumiko needs: the credentials, the database number, or any command
        kumiko runs (``SCRIPT LOAD``, ``EVALSHA``, ``MGET``, ``DEL`` and every command of its
        scripts, probed on keys of both namespaces by ``lua/probe.lua``). Connection errors
        propagate as they are (see ``JobRunner.wait_for_redis``)."""
        client = self.client
        try:
            client.ping()
        except redis.AuthenticationError as exc:
            raise RedisAccessError(redis_url, f"refuses the credentials: {exc}") from None
        except redis.ResponseError as exc:
            raise RedisAccessError(redis_url, f"refuses the connection: {exc}") from None
        probe_keys = [
            queue_list(f"{self.queue_prefix}-kumiko-probe", self.namespace),
            keys.probe(self.queue_prefix),
        ]
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("SCRIPT LOAD", lambda: client.script_load(lua_source("probe"))),
            ("EVALSHA", lambda: self.lua.probe(keys=probe_keys, args=lua_commands())),
            ("MGET", lambda: client.mget(probe_keys)),
            ("DEL", lambda: client.delete(*probe_keys)),
        ]
        for command, step in steps:
            try:
                reply = step()
            except redis.exceptions.NoPermissionError as exc:
                if "key" in str(exc):
                    raise RedisAccessError(
                        redis_url,
                        f"does not let this user access the keys kumiko needs "
                        f"({self.namespace}:* and kumiko:{self.queue_prefix}:*): {exc}",
                    ) from None
                raise RedisAccessError(
                    redis_url, f"does not let this user run {command}, which kumiko needs: {exc}"
                ) from None
            if command == "EVALSHA" and reply:
                refused, key, error = (_text(item) for item in reply[:3])
                raise RedisAccessError(
                    redis_url,
                    f"does not let this user run {refused.upper()} on {key}, which kumiko "
                    f"needs: {error}",
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


# -- the consumer --------------------------------------------------------------------------
class KumikoConsumer(Consumer):
    """What Dramatiq's worker pulls the messages of one queue from.

    Fetches in one Lua call per batch and acks each delivery together with its
    :class:`Settlement`. With nothing to fetch it does not poll: it blocks on the queue's
    doorbell (:func:`queue_bell`, ``BLPOP`` on a connection of its own), which every write
    onto the queue rings in the same Lua call, so a message enqueued into an idle system
    starts within a round trip or two. The wait is bounded by ``2 * timeout`` (a lost
    wake-up, say a connection killed while blocked, costs at most that; an idle consumer
    sends two commands per bound, fewer than Dramatiq's polling) and, on a delay queue, by
    the due time of the earliest delayed message it holds (its last Redis clock tick,
    :data:`REDIS_TICK_MS`, is slept locally, so a due message moves on time). A worker
    shutting down unblocks its consumers (:meth:`KumikoBroker.wake_consumers`).

    On a kumiko lane queue a fetched message is a running one: Dramatiq's worker asks for
    twice its threads (``prefetch``), but the consumer holds at most ``prefetch // 2``
    messages, so every message it fetches goes straight to an idle thread (no message waits
    in a worker's memory where ``cancel`` could not reach it). It fetches when half its
    threads are free (or all of them), so a batch still serves several messages, and while
    they are all busy it waits for an ack, not for a poll. Delay queues keep Dramatiq's
    prefetch: their messages wait in memory until due, and their move is checked (and
    dropped if cancelled) in the same Lua call that makes it.

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
        self._delayed = queue_name.endswith(".DQ")
        #: how many messages this consumer holds at most, and the free room it fetches at
        self._slots = max(1, prefetch // 2) if self._lane else prefetch
        self._batch = max(1, self._slots // 2) if self._lane else 1
        self._cache: deque[tuple[str, bytes | None]] = deque()
        self._outstanding: set[str] = set()
        #: what this process holds of the queue (shared by its consumers of the queue), and
        #: when this consumer last gave back lost claims (ms; 0: never)
        self._held = broker._held.setdefault(queue_name, set())
        self._claims_checked_ms = 0
        self._settled = threading.Condition()
        #: the suspect this consumer runs alone, if any
        self._alone: str | None = None
        self._suspects_waiting = 0
        #: (eta, redis id) of the delayed messages held (delay queues; stale entries are
        #: dropped when they reach the top)
        self._etas: list[tuple[int, str]] = []
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
            if current_millis() - self._claims_checked_ms >= self.broker.maintenance_interval_ms:
                self._give_back_lost_claims()
            if self._delayed and self.queue_name in self.broker._abandoned:
                self._requeue_abandoned()
            while True:
                if self._cache:
                    delivery = self._deliver(*self._cache.popleft())
                    if delivery is not None:
                        self.misses = 0
                        return delivery
                    continue
                if self._fill():
                    continue
                if self._lane and self.outstanding_message_count > self._slots - self._batch:
                    # Busy: wait for an ack to free room (bounded, so Dramatiq's loop goes
                    # round to notice a shutdown).
                    with self._settled:
                        self._settled.wait(self.timeout / 1000)
                    return None
                self._idle()
                return None
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]

    def _idle(self) -> None:
        """Wait until a message may be there: the doorbell rings, the earliest held delayed
        message comes due, or ``2 * timeout`` ms pass."""
        wait_ms = 2 * self.timeout
        due = self._next_due()
        if due is not None:
            wait_ms = min(wait_ms, due - current_millis())
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

    def _next_due(self) -> int | None:
        """The eta of the earliest delayed message held, if any."""
        while self._etas and self._etas[0][1] not in self._outstanding:
            heapq.heappop(self._etas)
        return self._etas[0][0] if self._etas else None

    def close(self) -> None:
        """Give the doorbell's connection back to the pool. A delay-queue consumer closed
        while it still holds delayed messages (Dramatiq drops its in-memory delay queue on a
        connection error, then closes the consumer) puts them back on the delay queue, or,
        if Redis does not answer, leaves them to the next consumer of the queue in this
        process: a held message is never stranded in a live worker's ack set."""
        self._close_bell()
        if self._delayed and self._outstanding:
            held = set(self._outstanding)
            try:
                self.broker.do_requeue(self.queue_name, *held)
            except redis.RedisError:
                self.broker._abandoned.setdefault(self.queue_name, set()).update(held)
            for rid in held:
                self._done(rid)

    def _requeue_abandoned(self) -> None:
        held = self.broker._abandoned.pop(self.queue_name, set())
        try:
            self.broker.do_requeue(self.queue_name, *held)
        except redis.RedisError:
            self.broker._abandoned.setdefault(self.queue_name, set()).update(held)
            raise

    def _give_back_lost_claims(self) -> None:
        """Requeue the ids of this worker's ack set that this process does not hold (see
        "Lost claims" above). What is held is read before the ack set, and only this thread
        claims for this queue, so an id read as not held is not held; an id settled since is
        no longer in the ack set, and ``requeue`` moves only ids that still are."""
        self._claims_checked_ms = current_millis()
        held = self._held.copy()  # one C call: a worker thread's discard cannot interleave
        held.update(rid for rid, _ in self._cache)
        acks = consumer_acks(self.broker.broker_id, self.queue_name, self.broker.namespace)
        claimed = {_text(rid) for rid in self.broker.thread_client().smembers(acks)}
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
        if room <= 0 or (outstanding and room < self._batch):
            return False
        if not self._lane:
            fetched = self.broker.fetch(self.queue_name, room)
            self._cache.extend(fetched)
            return bool(fetched)
        if self._alone is not None or (self._suspects_waiting and outstanding):
            return False  # a suspect runs alone, or waits for this consumer to drain
        result = self.broker.fetch_lane(
            self.queue_name, room, outstanding=outstanding, client=self.broker.thread_client()
        )
        self._suspects_waiting = result.suspects_waiting
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
        decoded: object = None
        policy = self.broker.message_policy
        if message is not None and problem is None and policy is not None:
            problem, decoded = policy.check(message)
        if message is None or problem is not None:
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
        if self._delayed:
            self.broker._held_delayed.add(rid)
            eta = message.options.get("eta")
            if isinstance(eta, int | float):
                heapq.heappush(self._etas, (int(eta), rid))
        delivery = Delivery(message, fetched_from=self.queue_name, redis_message_id=rid)
        delivery.decoded = decoded
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
            self.broker.settle(self.queue_name, rid, outcome, message_id=rid, run=run)
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
        if rid == self._alone:
            self._alone = None
        if self._suspects_waiting and not self._outstanding and self._bell is not None:
            # a suspect waits for this consumer to hold nothing: end its wait now
            self.broker.unblock(self._bell_id)
        if self._delayed:
            self.broker._held_delayed.discard(rid)
            self.broker._moved.discard(rid)
        with self._settled:
            self._settled.notify()

    def ack(self, message: MessageProxy) -> None:
        rid = _redis_id(message)
        settled = True
        try:
            if rid in self.broker._moved:
                return  # moved off the delay queue by ``move``: nothing left to ack
            if not self._lane or not isinstance(message, Delivery):
                self.broker.do_ack(self.queue_name, rid)
                return
            settlement = message.settlement
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
                run = message.settlement.run if isinstance(message, Delivery) else None
                self.broker.settle(
                    self.queue_name, rid, "dead", message_id=str(message.message_id), run=run
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
        rids = [_redis_id(message) for message in messages]
        rids += [rid for rid, _ in self._cache]
        self._cache.clear()
        if not rids:
            return
        self.broker.do_requeue(self.queue_name, *rids)
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


def _text(item: Any) -> str:
    return item.decode() if isinstance(item, bytes) else str(item)


def _as_list(reply: Any) -> list[Any]:
    items = reply if isinstance(reply, list) else [reply]
    return [item.decode() if isinstance(item, bytes) else item for item in items]


def make_connection_pool(redis_url: str, timeout_s: float) -> redis.ConnectionPool:
    """A runner's pool: connect and read timeouts of ``timeout_s``, and one quick reconnect
    on a dropped connection, never on a timeout (redis-py's default retries ten times,
    timeouts included, which turns an unreachable Redis into a minute-long hang). Any URL
    form of :mod:`kumiko_dramatiq.connection` (TLS, Sentinel, ...)."""
    return connection_pool(
        redis_url,
        timeout_s=timeout_s,
        retry=Retry(
            ExponentialBackoff(cap=0.5, base=0.05), 1, supported_errors=(redis.ConnectionError,)
        ),
    )
