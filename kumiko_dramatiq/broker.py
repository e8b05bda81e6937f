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
from redis.exceptions import NoScriptError

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

    def enqueue_atomic_many(
        self, items: Sequence[tuple[Message[Any], AtomicStep]], *, delay: int | None = None
    ) -> list[tuple[Message[Any], list[Any]]]:
        """:meth:`enqueue_atomic` for many messages in one pipelined round trip.

        Each script call stays atomic on its own; the batch is not a
        transaction (a crash mid-batch leaves a prefix enqueued, which the
        guards make safe to run again). Scripts run by ``EVALSHA``; only a
        server that lost them (restart, ``SCRIPT FLUSH``) costs a load and a
        second round trip for the affected calls. If some calls fail, the
        others still get ``after_enqueue`` and the first error is raised.
        """
        if not items:
            return []
        prepared = [(self.prepare(message, delay), step) for message, step in items]
        for message, _ in prepared:
            self.emit_before("enqueue", message, delay)
        replies: list[Any] = [None] * len(prepared)
        pending = list(range(len(prepared)))
        for _ in range(2):
            pipe = self.client.pipeline(transaction=False)
            for index in pending:
                message, step = prepared[index]
                pipe.evalsha(
                    step.script.sha,
                    2 + len(step.keys),
                    *self._queue_keys(message),
                    *step.keys,
                    message.options["redis_message_id"],
                    message.encode(),
                    *step.args,
                )
            results = pipe.execute(raise_on_error=False)
            missing = []
            for index, result in zip(pending, results, strict=True):
                replies[index] = result
                if isinstance(result, NoScriptError):
                    missing.append(index)
            if not missing:
                break
            for script in {
                id(prepared[i][1].script): prepared[i][1].script for i in missing
            }.values():
                self.client.script_load(script.script)
            pending = missing
        done: list[tuple[Message[Any], list[Any]]] = []
        errors = [reply for reply in replies if isinstance(reply, Exception)]
        for (message, _), reply in zip(prepared, replies, strict=True):
            if isinstance(reply, Exception):
                continue
            answer = _as_list(reply)
            if answer[0] == 1:
                self.emit_after("enqueue", message, delay)
            done.append((message, answer))
        if errors:
            raise errors[0]
        return done

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
