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
import random
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
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
from .lua import LuaScripts
from .settings import MAINTENANCE_SCALE

logger = logging.getLogger("kumiko_dramatiq")

#: Dramatiq's key namespace.
NAMESPACE = "dramatiq"

#: How long the "sent" marker of a freshly enqueued message lives: the window in which a
#: re-sent write is recognised (redis-py re-sends within a second).
RESEND_WINDOW_MS = 60_000

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
@dataclass
class Settlement:
    """What the ack of one delivery writes besides the ack itself (one Lua call in all).

    ``retry``: the prepared retry of a failed attempt and its delay, enqueued with the ack;
    ``completed``: the message completed, so the ack also writes its "already completed"
    marker. At most one of them is set.
    """

    retry: tuple[Message[Any], int | None] | None = None
    completed: bool = False


class Delivery(MessageProxy):
    """One delivery of a message to this worker: Dramatiq's proxy, plus the queue and redis
    id it was fetched under, what its ack should write (:class:`Settlement`) and kumiko's
    per-delivery state (``execution``, set by :mod:`kumiko_dramatiq.executions`)."""

    def __init__(self, message: Message[Any], *, fetched_from: str, redis_message_id: str) -> None:
        super().__init__(message)
        self.fetched_from = fetched_from
        self.redis_message_id = redis_message_id
        self.settlement = Settlement()
        self.execution: object | None = None


# -- the broker ----------------------------------------------------------------------------
class KumikoBroker(RedisBroker):
    """Dramatiq's ``RedisBroker`` with kumiko's consumer, commands and enqueue steps.

    ``lua`` holds every kumiko script, registered on the broker's client. ``queue_prefix``
    names the dataset; ``completed_ttl_ms`` and ``moved_marker_ttl_ms`` are the lifetimes of
    the "already completed" markers and of the "sent" markers of moved delayed messages.
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
        moved_marker_ttl_ms: int,
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
        self.moved_marker_ttl_ms = moved_marker_ttl_ms
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
        chance = maintenance and random.randint(1, MAINTENANCE_SCALE) <= self.maintenance_chance
        return [
            queue_name,
            current_millis(),
            self.broker_id,
            self.heartbeat_timeout,
            self.dead_message_ttl,
            "1" if chance else "0",
        ]

    def do_enqueue(self, queue_name: str, redis_message_id: str | bytes, data: bytes) -> None:
        self.lua.enqueue(
            keys=[self.namespace], args=[*self._head(queue_name), redis_message_id, data]
        )

    def do_fetch(self, queue_name: str, count: int) -> list[bytes | None]:
        """Dramatiq's fetch: up to ``count`` encoded messages (``None`` for a vanished one)."""
        pairs, _ = self.fetch(queue_name, count, check_completed=False)
        return [body for _, body in pairs]

    def fetch(
        self, queue_name: str, count: int, *, check_completed: bool
    ) -> tuple[list[tuple[str, bytes | None]], list[str]]:
        """Claim up to ``count`` messages: ``([(redis id, body or None)], [message ids acked
        unrun because they already completed])``."""
        done_prefix = keys.completed(self.queue_prefix, "") if check_completed else ""
        pairs, dropped = self.lua.fetch(
            keys=[self.namespace], args=[*self._head(queue_name), count, done_prefix]
        )
        fetched = [(_text(pairs[i]), pairs[i + 1]) for i in range(0, len(pairs), 2)]
        return fetched, [_text(message_id) for message_id in dropped]

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
        self.lua.requeue(keys=[self.namespace], args=[*self._head(queue_name), *redis_message_ids])

    def do_purge(self, queue_name: str) -> None:
        self.lua.purge(keys=[self.namespace], args=self._head(queue_name))

    def do_qsize(self, queue_name: str) -> int:
        return int(self.lua.qsize(keys=[self.namespace], args=self._head(queue_name)))

    def ack_completed(self, queue_name: str, redis_message_id: str, message_id: str) -> None:
        """Ack and write the "already completed" marker of ``message_id``: one Lua call."""
        self.lua.ack(
            keys=[self.namespace, keys.completed(self.queue_prefix, message_id)],
            args=[
                *self._head(queue_name, maintenance=False),
                redis_message_id,
                self.completed_ttl_ms,
            ],
        )

    def ack_and_retry(
        self, queue_name: str, redis_message_id: str, retry: Message[Any], delay: int | None
    ) -> bool:
        """Ack a delivery and enqueue its prepared ``retry`` in one Lua call; ``False`` if the
        delivery was no longer this worker's (then nothing happened)."""
        done = self.lua.ack_retry(
            keys=[self.namespace],
            args=[
                *self._head(queue_name, maintenance=False),
                redis_message_id,
                retry.queue_name,
                retry.options["redis_message_id"],
                retry.encode(),
            ],
        )
        if done == 1:
            self.emit_after("enqueue", retry, delay)
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
        """Dramatiq's enqueue, made idempotent (see the module docstring).

        A message that carries the redis id it was delivered under (a delayed message moved
        to its queue, or a copy of a delivered message) gets a redis id derived from it, so a
        second move of the same copy is a no-op while the marker lives.
        """
        moved_from = message.options.get("redis_message_id")
        if moved_from is None:
            prepared = self.prepare(message, delay)
            marker_ttl_ms = RESEND_WINDOW_MS
        else:
            rid = str(uuid5(_MOVED_NAMESPACE, f"{moved_from}>{message.queue_name}"))
            prepared = self.prepare(message, delay, redis_message_id=rid)
            marker_ttl_ms = self.moved_marker_ttl_ms
        rid = prepared.options["redis_message_id"]
        self.emit_before("enqueue", prepared, delay)
        self.lua.guarded_enqueue(
            keys=[*self._queue_keys(prepared), keys.sent(self.queue_prefix, rid)],
            args=[rid, prepared.encode(), marker_ttl_ms, "1"],
        )
        self.emit_after("enqueue", prepared, delay)
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

    Fetches up to ``prefetch`` outstanding messages at a time (one Lua call), waits with
    Dramatiq's progressive backoff (up to ``timeout`` ms) when the queue is empty, and acks
    each delivery together with its :class:`Settlement`.
    """

    def __init__(self, broker: KumikoBroker, queue_name: str, prefetch: int, timeout: int) -> None:
        self.broker = broker
        self.queue_name = queue_name
        self.prefetch = prefetch
        self.timeout = timeout
        self.misses = 0
        self._check_completed = broker.is_lane(queue_name)
        self._cache: deque[tuple[str, bytes | None]] = deque()
        self._outstanding: set[str] = set()

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
                room = self.prefetch - self.outstanding_message_count
                if room > 0 and self._fill(room):
                    continue
                self.misses, backoff_ms = compute_backoff(self.misses, max_backoff=self.timeout)
                time.sleep(backoff_ms / 1000)
                return None
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]

    def _fill(self, count: int) -> bool:
        fetched, dropped = self.broker.fetch(
            self.queue_name, count, check_completed=self._check_completed
        )
        for message_id in dropped:
            logger.warning(
                "message %s on %s already completed: acked without running it again",
                message_id,
                self.queue_name,
            )
        self._cache.extend(fetched)
        return bool(fetched)

    def _deliver(self, rid: str, body: bytes | None) -> Delivery | None:
        if body is None:
            logger.warning("message %s vanished from %s before its fetch", rid, self.queue_name)
            self.broker.do_ack(self.queue_name, rid)
            return None
        try:
            message = Message.decode(body)
        except Exception as exc:
            logger.error(
                "dead-lettering an undecodable message %s on %s: %.160s",
                rid,
                self.queue_name,
                exc.__cause__ or exc,
            )
            self.broker.do_nack(self.queue_name, rid)
            return None
        self._outstanding.add(rid)
        return Delivery(message, fetched_from=self.queue_name, redis_message_id=rid)

    def ack(self, message: MessageProxy) -> None:
        rid = _redis_id(message)
        try:
            settlement = message.settlement if isinstance(message, Delivery) else None
            if settlement is not None and settlement.retry is not None:
                if not self.broker.ack_and_retry(self.queue_name, rid, *settlement.retry):
                    logger.warning(
                        "message %s was recovered by another worker before its ack; "
                        "its retry is left to that delivery",
                        message.message_id,
                    )
            elif settlement is not None and settlement.completed:
                self.broker.ack_completed(self.queue_name, rid, str(message.message_id))
            else:
                self.broker.do_ack(self.queue_name, rid)
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        finally:
            self._outstanding.discard(rid)

    def nack(self, message: MessageProxy) -> None:
        rid = _redis_id(message)
        try:
            self.broker.do_nack(self.queue_name, rid)
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        finally:
            self._outstanding.discard(rid)

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        rids = [_redis_id(message) for message in messages]
        rids += [rid for rid, _ in self._cache]
        self._cache.clear()
        if not rids:
            return
        self.broker.do_requeue(self.queue_name, *rids)
        self._outstanding.difference_update(rids)


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
