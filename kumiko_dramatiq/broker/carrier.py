"""The seam where a command's bytes leave the process: the sync socket, or a carrier.

Every kumiko call builds its messages and commands with the same code, whoever calls it
(:mod:`kumiko_dramatiq.messages`, :mod:`kumiko_dramatiq.broker.enqueueing`, the admin
reads). Only how a command travels differs:

- by default, on redis-py's sync connections: the runner's pool (:class:`CarriedRedis`) or
  a thread's own connection (``KumikoBroker.thread_client``);
- inside :func:`carried`, on the *carrier* set for the current context: a ``redis.Redis``
  whose ``execute_command`` and ``pipeline`` send elsewhere. The asyncio producer
  (:mod:`kumiko_dramatiq.aio`) runs a sync call in a greenlet whose context carries a
  client that hands each command to the event loop: the whole call, guards and hooks
  included, is the sync one, and no socket call blocks the loop's thread.

A carrier is found through a context variable, so it holds for exactly the call it was set
for: another thread, another task, or the code around the call never sees it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import redis
from redis.client import Pipeline, PubSub

_CARRIER: ContextVar[redis.Redis | None] = ContextVar("kumiko.carrier", default=None)


def carrier() -> redis.Redis | None:
    """The client that carries this context's commands, or ``None`` (the sync sockets)."""
    return _CARRIER.get()


def carry_on(client: redis.Redis) -> None:
    """From now on in this context, commands travel on ``client`` (for a context made for
    one call, such as a greenlet's own: see :mod:`kumiko_dramatiq.aio.bridge`)."""
    _CARRIER.set(client)


@contextmanager
def carried(client: redis.Redis) -> Iterator[None]:
    """Within this block (this context only), every command of a :class:`CarriedRedis` and
    every ``thread_client`` command travels on ``client``."""
    token = _CARRIER.set(client)
    try:
        yield
    finally:
        _CARRIER.reset(token)


class CarriedRedis(redis.Redis):
    """The runner's client: redis-py's, except that inside :func:`carried` its commands,
    scripts (``Script`` objects registered on it call back into ``execute_command``) and
    pipelines travel on the carrier. A subscription cannot be carried: it belongs to a
    thread of its own (``ResultListener``)."""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        found = _CARRIER.get()
        if found is not None:
            return found.execute_command(*args, **options)  # type: ignore[no-untyped-call]
        return super().execute_command(*args, **options)  # type: ignore[no-untyped-call]

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        found = _CARRIER.get()
        if found is not None:
            return found.pipeline(transaction, shard_hint)
        return super().pipeline(transaction, shard_hint)

    def pubsub(self, **kwargs: Any) -> PubSub:
        if _CARRIER.get() is not None:
            raise RuntimeError("kumiko: a subscription cannot travel on a carrier")
        return super().pubsub(**kwargs)
