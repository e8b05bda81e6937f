"""``KumikoBroker``: Dramatiq's ``RedisBroker`` plus atomic "check-and-enqueue" steps.

Dramatiq's Redis broker never dedups by message id. Wherever kumiko gives a
message a deterministic id (fan-out children, cron ticks, boot-once jobs,
dedup keys), the guard record and the message are written by ONE Lua script
(:meth:`KumikoBroker.enqueue_atomic`), so a crash can neither lose the
message nor enqueue it twice. Every message still passes through the
middleware chain: ``before_enqueue`` runs for each message and
``after_enqueue`` for each message the script actually enqueued.

Script convention (see :mod:`kumiko_dramatiq.scripts`): ``KEYS[1]`` is the
queue's message hash, ``KEYS[2]`` the queue list, ``ARGV[1]`` the redis
message id, ``ARGV[2]`` the encoded message; the script calls
``enqueue_message()`` to write them and returns ``{enqueued, ...}`` where
``enqueued`` is 1 or 0.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID, uuid4, uuid5

import redis
from dramatiq.broker import MessageProxy
from dramatiq.brokers.redis import RedisBroker, _RedisConsumer
from dramatiq.common import current_millis, dq_name
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from redis.commands.core import Script

from . import keys
from .scripts import Scripts

logger = logging.getLogger("kumiko_dramatiq")

#: How long the "sent" marker of a freshly enqueued message lives: the window
#: in which a re-sent write is recognised (redis-py re-sends within ~0.1 s).
RESEND_WINDOW_MS = 60_000

_MOVED_NAMESPACE = UUID("9d4b7e0c-2f5a-5c8e-b1d3-7a6f4c2e9b01")


@dataclass(frozen=True)
class AtomicStep:
    """A Lua script (following the convention above) and its own keys and args."""

    script: Script
    keys: Sequence[str] = ()
    args: Sequence[Any] = ()


class KumikoBroker(RedisBroker):
    """A ``RedisBroker`` that can enqueue a message and its guard atomically,
    and that never runs a message id again once it completed.

    ``kumiko_scripts`` holds kumiko's Lua scripts, registered on the broker's
    client.

    "Already completed" markers: the ack of a message that completed
    (``MessageProxy.kumiko_completed``, set by the ``Executions`` middleware)
    also writes ``keys.completed(queue_prefix, message_id)`` with a TTL of
    ``completed_ttl_ms``, in the same Lua call as the ack (no extra round
    trip). Each fetch from a lane queue checks the fetched ids' markers with
    one ``MGET`` and acks, without running them, messages whose id already
    completed: a redelivery after a crash between the handler's end and the
    ack, or a second copy of a message id. Delay queues are not checked
    (their messages are checked when they come due).
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
        #: Lifetime of the "sent" marker of a moved delayed message.
        self.moved_marker_ttl_ms = moved_marker_ttl_ms
        self.completed_ttl_ms = completed_ttl_ms
        self.kumiko_scripts = Scripts.register(client)

    @property
    def consumer_class(self) -> type[_RedisConsumer]:
        return _KumikoConsumer

    def do_fetch(self, queue_name: str, count: int) -> list[bytes | None]:
        """Dramatiq's fetch, minus what must not reach Dramatiq's consumer.

        - a message that cannot be decoded (garbage bytes, missing fields) is
          dead-lettered with a logged reason: Dramatiq's consumer would crash
          on it, restart, and leave it unacked, a poison pill that returns
          with every crash recovery;
        - on a lane queue (not a delay queue), a message whose id already
          completed is acked without running (one ``MGET`` per fetch).
        """
        fetched: list[bytes | None] = self._dispatch("fetch")(queue_name, count)  # type: ignore[no-untyped-call]
        if not fetched:
            return fetched
        decoded: list[Message[Any] | None] = []
        undecodable: list[tuple[bytes, str]] = []
        for data in fetched:
            if data is None:  # vanished from the hash: Dramatiq logs and skips it
                decoded.append(None)
                continue
            try:
                decoded.append(Message.decode(data))
            except Exception as exc:
                decoded.append(None)
                undecodable.append((data, str(exc.__cause__ or exc)))
        if undecodable:
            self._dead_letter_undecodable(queue_name, undecodable)
            bad = {data for data, _ in undecodable}
            fetched, decoded = (
                [d for d in fetched if d not in bad],
                [m for d, m in zip(fetched, decoded, strict=True) if d not in bad],
            )
        if queue_name.endswith(".DQ"):
            return fetched
        known = [message for message in decoded if message is not None]
        if not known:
            return fetched
        markers = self.client.mget(
            [keys.completed(self.queue_prefix, message.message_id) for message in known]
        )
        done = {
            m.message_id for m, marker in zip(known, markers, strict=True) if marker is not None
        }
        if not done:
            return fetched
        kept: list[bytes | None] = []
        for data, message in zip(fetched, decoded, strict=True):
            if message is None or message.message_id not in done:
                kept.append(data)
                continue
            logger.warning(
                "message %s on %s already completed: acked without running it again",
                message.message_id,
                queue_name,
            )
            self.do_ack(queue_name, message.options["redis_message_id"])
        return kept

    def _dead_letter_undecodable(self, queue_name: str, items: list[tuple[bytes, str]]) -> None:
        """Move fetched messages that cannot be decoded to the dead-letter queue.

        Dramatiq's fetch returns message bodies without their redis ids, so
        the ids are found among this consumer's unacked ones (rare path).
        """
        redis_ids = list(
            self.client.smembers(keys.consumer_acks(self.broker_id, queue_name, self.namespace))
        )
        bodies = self.client.hmget(keys.queue_messages(queue_name, self.namespace), redis_ids)
        by_body = {body: rid for rid, body in zip(redis_ids, bodies, strict=True) if body}
        for data, reason in items:
            rid = by_body.get(data)
            logger.error("dead-lettering an undecodable message on %s: %.160s", queue_name, reason)
            if rid is not None:
                self.do_nack(queue_name, rid.decode() if isinstance(rid, bytes) else rid)

    def ack_completed(self, queue_name: str, message: MessageProxy) -> None:
        """Ack ``message`` on ``queue_name`` and mark its id completed: one Lua call."""
        self.kumiko_scripts.ack_completed(
            keys=[
                keys.consumer_acks(self.broker_id, queue_name, self.namespace),
                keys.queue_messages(queue_name, self.namespace),
                keys.completed(self.queue_prefix, message.message_id),
                keys.heartbeats(self.namespace),
            ],
            args=[
                message.options["redis_message_id"],
                self.completed_ttl_ms,
                current_millis(),
                self.broker_id,
            ],
        )

    def prepare(
        self, message: Message[Any], delay: int | None, *, redis_message_id: str | None = None
    ) -> Message[Any]:
        """Give ``message`` a redis message id (fresh unless given) and, if
        delayed, its delay queue and eta: what ``RedisBroker.enqueue`` does
        before writing."""
        rid = str(uuid4()) if redis_message_id is None else redis_message_id
        message = message.copy(options={"redis_message_id": rid})
        if delay is not None:
            message = message.copy(
                queue_name=dq_name(message.queue_name),
                options={"eta": current_millis() + delay},
            )
        return message

    def enqueue(self, message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        """Dramatiq's ``RedisBroker.enqueue``, made idempotent.

        Each write leaves a "sent" marker of its redis message id
        (``keys.sent``), and a write whose marker exists does nothing:

        - the runner's pool re-sends a command once when its connection
          drops; if the first send had executed (only the reply was lost),
          Dramatiq's enqueue would store the message twice. The marker of a
          fresh message lives :data:`RESEND_WINDOW_MS`;
        - a worker moves a due delayed message to its queue by enqueuing it
          and then acking it on the delay queue; a crash between the two
          redelivers the delayed copy, which would be moved twice. A message
          that carries the redis id it was delivered under (a move) gets a
          redis id derived from it, so the second move is a no-op while the
          marker lives (``Retention.completed_age_s``).
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
        self.kumiko_scripts.enqueue_once(
            keys=[*self._queue_keys(prepared), keys.sent(self.queue_prefix, rid)],
            args=[rid, prepared.encode(), marker_ttl_ms],
        )
        self.emit_after("enqueue", prepared, delay)
        return prepared

    def ack_and_retry(
        self, queue_name: str, delivered: MessageProxy, retry: Message[Any], delay: int | None
    ) -> bool:
        """Ack ``delivered`` on ``queue_name`` and enqueue its prepared ``retry``
        in one Lua call; ``False`` if ``delivered`` was no longer this
        worker's (then nothing happened)."""
        done = self.kumiko_scripts.ack_and_retry(
            keys=[
                keys.consumer_acks(self.broker_id, queue_name, self.namespace),
                keys.queue_messages(queue_name, self.namespace),
                *self._queue_keys(retry),
                keys.heartbeats(self.namespace),
            ],
            args=[
                delivered.options["redis_message_id"],
                retry.options["redis_message_id"],
                retry.encode(),
                current_millis(),
                self.broker_id,
            ],
        )
        if done == 1:
            self.emit_after("enqueue", retry, delay)
        return bool(done == 1)

    def enqueue_atomic(
        self, message: Message[Any], step: AtomicStep, *, delay: int | None = None
    ) -> tuple[Message[Any], list[Any]]:
        """Run ``step`` and the enqueue of ``message`` as one Lua call.

        Returns the prepared message and the script's reply list; the message
        was enqueued iff ``reply[0] == 1``.
        """
        prepared = self.prepare(message, delay)
        self.emit_before("enqueue", prepared, delay)
        reply = _as_list(
            step.script(
                keys=[*self._queue_keys(prepared), *step.keys],
                args=[prepared.options["redis_message_id"], prepared.encode(), *step.args],
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
        """Enqueue each message of ``messages`` (all on ONE queue) unless its
        guard in ``guard_keys`` exists, writing guard and message together:
        one Lua call, one round trip, for the whole batch.

        Every message passes ``before_enqueue``; those enqueued pass
        ``after_enqueue``. Returns, per message, whether it was enqueued. A
        crash mid-way leaves each message either enqueued with its guard or
        not at all (the script is atomic).
        """
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
        reply = self.kumiko_scripts.guarded_enqueue_batch(
            keys=list(self._queue_keys(prepared[0])), args=args
        )
        enqueued = [flag == 1 for flag in reply]
        for message, fresh in zip(prepared, enqueued, strict=True):
            if fresh:
                self.emit_after("enqueue", message, delay)
        return enqueued

    def _queue_keys(self, message: Message[Any]) -> tuple[str, str]:
        return (
            keys.queue_messages(message.queue_name, self.namespace),
            keys.queue_list(message.queue_name, self.namespace),
        )


class _KumikoConsumer(_RedisConsumer):
    """Dramatiq's Redis consumer whose ack also writes what the run left to it:
    the "already completed" marker, or the retry of a failed attempt."""

    broker: KumikoBroker

    def ack(self, message: MessageProxy) -> None:
        retry = getattr(message, "kumiko_retry", None)
        completed = getattr(message, "kumiko_completed", False)
        if retry is None and not completed:
            super().ack(message)  # type: ignore[no-untyped-call]
            return
        try:
            if retry is not None:
                if not self.broker.ack_and_retry(self.queue_name, message, *retry):
                    logger.warning(
                        "message %s was recovered by another worker before its ack; "
                        "its retry is left to that delivery",
                        message.message_id,
                    )
            else:
                self.broker.ack_completed(self.queue_name, message)
        except redis.ConnectionError as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call]
        finally:
            self.queued_message_ids.discard(message.message_id)


def _as_list(reply: Any) -> list[Any]:
    if isinstance(reply, list):
        return [_decode(item) for item in reply]
    return [_decode(reply)]


def _decode(item: Any) -> Any:
    return item.decode() if isinstance(item, bytes) else item


def make_connection_pool(redis_url: str, timeout_s: float) -> redis.ConnectionPool:
    """The pool of a runner: connect and read timeouts of ``timeout_s``, and one
    quick reconnect on a dropped connection, never on a timeout (redis-py's
    default retries ten times, timeouts included, which turns an unreachable
    Redis into a minute-long hang)."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return redis.ConnectionPool.from_url(
        redis_url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(
            ExponentialBackoff(cap=0.5, base=0.05), 1, supported_errors=(redis.ConnectionError,)
        ),
    )
