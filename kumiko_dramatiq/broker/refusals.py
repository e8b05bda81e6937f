"""Replies by which Redis refuses writes for now, turned into connection errors."""

from __future__ import annotations

from typing import Any

import redis


def unavailable_reply(exc: BaseException) -> bool:
    """Whether ``exc`` is a reply by which Redis refuses writes for now, not for good: a
    replica (``READONLY``: a primary demoted by a fail-over), a primary without enough good
    replicas (``NOREPLICAS``: ``min-replicas-to-write``), or a replica cut off from its
    primary (``MASTERDOWN``)."""
    if isinstance(exc, redis.exceptions.ReadOnlyError | redis.exceptions.MasterDownError):
        return True
    return isinstance(exc, redis.ResponseError) and str(exc).startswith(
        ("NOREPLICAS", "MASTERDOWN", "READONLY")
    )


class WritesRefusedAreUnavailable:
    """Turns an :func:`unavailable_reply` into a ``ConnectionError`` (after dropping the
    connection, so that the next one finds the current primary): kumiko treats a Redis that
    refuses writes for now like one it cannot reach. A producer's ``dispatch`` raises
    ``RedisUnavailableError``, a worker retries its ack until Redis takes it, the scheduler
    retries the tick, and the pool's one retry re-sends the command (a refused command did
    not run). Without this, the reply is a ``ResponseError``, which Dramatiq's worker does
    not retry: a refused ack would leave its message unacked until the worker restarts."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.ResponseError as exc:
            if not unavailable_reply(exc):
                raise
            self.disconnect()  # type: ignore[attr-defined]
            raise redis.ConnectionError(f"Redis refuses writes for now: {exc}") from exc
