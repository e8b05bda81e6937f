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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import current_millis, dq_name
from dramatiq.message import Message
from dramatiq.middleware import Middleware
from redis.commands.core import Script

from . import keys
from .scripts import Scripts


@dataclass(frozen=True)
class AtomicStep:
    """A Lua script (following the convention above) and its own keys and args."""

    script: Script
    keys: Sequence[str] = ()
    args: Sequence[Any] = ()


class KumikoBroker(RedisBroker):
    """A ``RedisBroker`` that can enqueue a message and its guard atomically.

    ``scripts`` holds kumiko's Lua scripts, registered on the broker's client.
    """

    def __init__(
        self,
        *,
        client: redis.Redis,
        middleware: list[Middleware],
        heartbeat_timeout: int,
        maintenance_chance: int,
        dead_message_ttl: int,
    ) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            client=client,
            middleware=middleware,
            heartbeat_timeout=heartbeat_timeout,
            maintenance_chance=maintenance_chance,
            dead_message_ttl=dead_message_ttl,
        )
        self.kumiko_scripts = Scripts.register(client)

    def prepare(self, message: Message[Any], delay: int | None) -> Message[Any]:
        """Give ``message`` a fresh redis message id and, if delayed, its
        delay queue and eta: what ``RedisBroker.enqueue`` does before writing."""
        message = message.copy(options={"redis_message_id": str(uuid4())})
        if delay is not None:
            message = message.copy(
                queue_name=dq_name(message.queue_name),
                options={"eta": current_millis() + delay},
            )
        return message

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
