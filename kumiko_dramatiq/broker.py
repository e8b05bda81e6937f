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
from dramatiq.common import compute_backoff, current_millis, dq_name, q_name
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry

from . import keys
from .errors import RedisAccessError
from .lua import LuaScripts
from .lua import commands as lua_commands
from .lua import source as lua_source
from .settings import MAINTENANCE_SCALE

logger = logging.getLogger("kumiko_dramatiq")

#: Dramatiq's key namespace.
NAMESPACE = "dramatiq"

#: How long the "sent" marker of a freshly enqueued message lives: the window in which a
#: re-sent write is recognised (redis-py re-sends within a second).
RESEND_WINDOW_MS = 60_000

#: One settle call in this many also trims the run history (ages and cap), dropping at most
#: this many records beyond the cap: the trimming keeps pace with the writes at a shared cost.
TRIM_BUDGET = 32

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
    ``completed``: the message completed, so the ack also writes its "already completed"
    marker (at most one of the two is set); ``run``: the run record to write.
    """

    retry: tuple[Message[Any], int | None] | None = None
    completed: bool = False
    run: RunWrite | None = None


class Delivery(MessageProxy):
    """One delivery of a message to this worker: Dramatiq's proxy, plus the queue and redis
    id it was fetched under, what its ack should write (:class:`Settlement`) and kumiko's
    per-delivery state (``execution``, set by :mod:`kumiko_dramatiq.executions`)."""

    def __init__(self, message: Message[Any], *, fetched_from: str, redis_message_id: str) -> None:
        super().__init__(message)
        self.message = message
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
    names the dataset; ``completed_ttl_ms`` is the lifetime of the "already completed" markers.
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
        completed_ttl_ms: int,
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
        self.lua = LuaScripts.register(client)

    def __getattr__(self, name: str) -> Any:
        # RedisBroker maps unknown ``do_*`` names onto its own dispatch script; every
        # command kumiko supports is a method here, so anything else is an error.
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def consumer_class(self) -> type[KumikoConsumer]:
        return KumikoConsumer

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> KumikoConsumer:
        return KumikoConsumer(self, queue_name, prefetch, timeout)

    def is_lane(self, queue_name: str) -> bool:
        """Whether ``queue_name`` is one of this dataset's lane queues (not a delay queue)."""
        return queue_name.startswith(f"{self.queue_prefix}-") and not queue_name.endswith(".DQ")

    # -- broker commands (Dramatiq's semantics, kumiko's Lua) --------------------------------
    def _head(self, queue_name: str, *, maintenance: bool = True) -> list[Any]:
        """The two arguments every broker command starts with (``lua/_dispatch.lua``)."""
        chance = maintenance and random.randint(1, MAINTENANCE_SCALE) <= self.maintenance_chance
        return [
            queue_name,
            f"{current_millis()} {self.broker_id} {self.heartbeat_timeout} "
            f"{self.dead_message_ttl} {1 if chance else 0}",
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

    def fetch_lane(self, queue_name: str, count: int, *, outstanding: int) -> LaneFetch:
        """Claim up to ``count`` messages of a lane queue (``lua/fetch_lane.lua``)."""
        completed_ttl, failed_ttl = self.run_ttls_ms
        fetched, completed, buried, waiting, alone = self.lua.fetch_lane(
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
    ) -> bool:
        """The outcome of one delivery from a lane queue, in one Lua call
        (``lua/settle.lua``); ``False`` if the delivery was no longer this worker's (then
        nothing but its in-flight entry, marker and run record was written)."""
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
        done = self.lua.settle(
            keys=[
                self.namespace,
                keys.inflight(self.queue_prefix),
                keys.completed(self.queue_prefix, message_id),
            ],
            args=args,
        )
        if done == 1 and retry is not None:
            self.emit_after("enqueue", *retry)
        return bool(done == 1)

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
        self.lua.guarded_enqueue(
            keys=[*self._queue_keys(prepared), keys.sent(self.queue_prefix, rid)],
            args=[rid, prepared.encode(), RESEND_WINDOW_MS, "1"],
        )
        self.emit_after("enqueue", prepared, delay)
        return prepared

    def _move(self, message: Message[Any], delayed_rid: str) -> Message[Any]:
        rid = str(uuid5(_MOVED_NAMESPACE, f"{delayed_rid}>{message.queue_name}"))
        prepared = self.prepare(message, None, redis_message_id=rid)
        self.emit_before("enqueue", prepared, None)
        moved = self.lua.move(
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
            script(
                keys=[*self._queue_keys(prepared), *keys],
                args=[prepared.options["redis_message_id"], prepared.encode(), *args],
            )
        )
        if reply[0] == 1:
            self.emit_after("enqueue", prepared, delay)
        return prepared, reply

    def enqueue_guarded_batch(
        self,
        messages: Sequence[Message[Any]],
        guard_keys: Sequence[str],
        *,
        guard_ttl_ms: int,
        guard_value: str,
        delay: int | None = None,
    ) -> list[bool]:
        """Enqueue each message (all on ONE queue) unless its guard exists, writing guard and
        message together: one Lua call for the whole batch. Every message passes
        ``before_enqueue``; those enqueued pass ``after_enqueue``. Returns, per message,
        whether it was enqueued."""
        if not messages:
            return []
        prepared = [self.prepare(message, delay) for message in messages]
        queue_names = {message.queue_name for message in prepared}
        if len(queue_names) != 1:
            raise ValueError(f"a guarded batch targets one queue, got {sorted(queue_names)}")
        args: list[Any] = [guard_ttl_ms, guard_value]
        for message, guard in zip(prepared, guard_keys, strict=True):
            self.emit_before("enqueue", message, delay)
            args += (guard, message.options["redis_message_id"], message.encode())
        reply = self.lua.guarded_enqueue_batch(keys=list(self._queue_keys(prepared[0])), args=args)
        enqueued = [flag == 1 for flag in reply]
        for message, fresh in zip(prepared, enqueued, strict=True):
            if fresh:
                self.emit_after("enqueue", message, delay)
        return enqueued

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

    def close(self) -> None:
        """Disconnect every connection of the broker's pool."""
        self.client.connection_pool.disconnect()


# -- the consumer --------------------------------------------------------------------------
class KumikoConsumer(Consumer):
    """What Dramatiq's worker pulls the messages of one queue from.

    Fetches in one Lua call per batch, waits with Dramatiq's progressive backoff (up to
    ``timeout`` ms) when there is nothing to fetch, and acks each delivery together with its
    :class:`Settlement`.

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
        self._settled = threading.Condition()
        #: the suspect this consumer runs alone, if any
        self._alone: str | None = None
        self._suspects_waiting = 0

    @property
    def outstanding_message_count(self) -> int:
        """Messages fetched and not yet acked, nacked or requeued (cached ones included)."""
        return len(self._outstanding) + len(self._cache)

    def __next__(self) -> Delivery | None:
        try:
            while True:
                if self._cache:
                    delivery = self._deliver(*self._cache.popleft())
                    if delivery is not None:
                        self.misses = 0
                        return delivery
                    continue
                if self._fill():
                    continue
                if self.outstanding_message_count >= self._batch and self._lane:
                    # Busy: wait for an ack to free room (bounded, so Dramatiq's loop goes
                    # round to move due delayed messages and to notice a shutdown).
                    with self._settled:
                        self._settled.wait(self.timeout / 1000)
                    return None
                self.misses, backoff_ms = compute_backoff(self.misses, max_backoff=self.timeout)
                time.sleep(backoff_ms / 1000)
                return None
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]

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
        result = self.broker.fetch_lane(self.queue_name, room, outstanding=outstanding)
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
            if message is not None and policy is not None:
                policy.rejected(message)
            return None
        self._outstanding.add(rid)
        if self._delayed:
            self.broker._held_delayed.add(rid)
        delivery = Delivery(message, fetched_from=self.queue_name, redis_message_id=rid)
        delivery.decoded = decoded
        return delivery

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

    def _done(self, rid: str) -> None:
        self._outstanding.discard(rid)
        if rid == self._alone:
            self._alone = None
        if self._delayed:
            self.broker._held_delayed.discard(rid)
            self.broker._moved.discard(rid)
        with self._settled:
            self._settled.notify()

    def ack(self, message: MessageProxy) -> None:
        rid = _redis_id(message)
        try:
            if rid in self.broker._moved:
                return  # moved off the delay queue by ``move``: nothing left to ack
            if not self._lane or not isinstance(message, Delivery):
                self.broker.do_ack(self.queue_name, rid)
                return
            settlement = message.settlement
            outcome: Outcome = "ack"
            if settlement.retry is not None:
                outcome = "retry"
            elif settlement.completed:
                outcome = "completed"
            owned = self.broker.settle(
                self.queue_name,
                rid,
                outcome,
                message_id=str(message.message_id),
                retry=settlement.retry,
                run=settlement.run,
            )
            if not owned:
                logger.warning(
                    "message %s was recovered by another worker before its ack; "
                    "its outcome is left to that delivery",
                    message.message_id,
                )
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        finally:
            self._done(rid)

    def nack(self, message: MessageProxy) -> None:
        rid = _redis_id(message)
        try:
            if self._lane:
                run = message.settlement.run if isinstance(message, Delivery) else None
                self.broker.settle(
                    self.queue_name, rid, "dead", message_id=str(message.message_id), run=run
                )
            else:
                self.broker.do_nack(self.queue_name, rid)
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        finally:
            self._done(rid)

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
    timeouts included, which turns an unreachable Redis into a minute-long hang)."""
    return redis.ConnectionPool.from_url(
        redis_url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(
            ExponentialBackoff(cap=0.5, base=0.05), 1, supported_errors=(redis.ConnectionError,)
        ),
    )
