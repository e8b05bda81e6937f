"""The one place that turns a kumiko Redis URL into connections: pools and clients.

Every Redis connection kumiko opens (a runner's pool, the start-up probe, ``reset_boot`` by
URL) is built by :func:`connection_pool` or :func:`client` from a URL parsed by
:mod:`kumiko_dramatiq.broker.urls`. A ``redis+sentinel://`` pool asks the sentinels for the
primary's address whenever a connection (re)connects, and a connection still talking to a
primary that was demoted (``READONLY``) is dropped, so a fail-over is a few failed commands,
then the same pool works against the new primary. A reply by which Redis refuses writes for
now is a connection error (:class:`_WritesRefusedAreUnavailable`).
"""

from __future__ import annotations

from typing import Any, Final

import redis
from redis.backoff import NoBackoff
from redis.connection import (
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.utils import HIREDIS_AVAILABLE

from kumiko_dramatiq.broker.packer import RespPacker
from kumiko_dramatiq.broker.urls import parse


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


class _WritesRefusedAreUnavailable:
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


class KumikoConnection(_WritesRefusedAreUnavailable, Connection):
    """A TCP connection (see :class:`_WritesRefusedAreUnavailable`)."""


class KumikoSSLConnection(_WritesRefusedAreUnavailable, SSLConnection):
    """A TLS connection (see :class:`_WritesRefusedAreUnavailable`)."""


class KumikoUnixConnection(_WritesRefusedAreUnavailable, UnixDomainSocketConnection):
    """A Unix socket connection (see :class:`_WritesRefusedAreUnavailable`)."""


class KumikoSentinelConnection(_WritesRefusedAreUnavailable, SentinelManagedConnection):
    """A connection to the primary Sentinel names (see
    :class:`_WritesRefusedAreUnavailable`; redis-py's own class already drops a connection
    that answers ``READONLY``). One that lost its socket asks the sentinels again before it
    sends: redis-py does that only when the pool hands a connection out, and a connection a
    thread keeps (``KumikoBroker.thread_client``) would otherwise reconnect to the address
    it had, the old primary's."""

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self._sock is None:
            self.connect()  # type: ignore[no-untyped-call]
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


_CONNECTION_CLASSES: Final[dict[type[Connection] | type[UnixDomainSocketConnection], type]] = {
    Connection: KumikoConnection,
    SSLConnection: KumikoSSLConnection,
    UnixDomainSocketConnection: KumikoUnixConnection,
}


class SentinelPool(SentinelConnectionPool):
    """redis-py's Sentinel pool that also closes its connections to the sentinels when it
    is disconnected (``JobRunner.stop()`` closes every connection the runner opened)."""

    sentinel_manager: Sentinel

    def disconnect(self, inuse_connections: bool = True) -> None:
        super().disconnect(inuse_connections)
        for sentinel in self.sentinel_manager.sentinels:
            sentinel.connection_pool.disconnect()


def connection_pool(
    redis_url: str, *, timeout_s: float, retry: Retry | None = None
) -> redis.ConnectionPool:
    """A pool for ``redis_url`` (any form above) with connect and read timeouts of
    ``timeout_s`` and ``retry`` as its commands' retry policy (``None``: no retry).
    ``JobConfigError`` for a bad URL; opens no connection."""
    target = parse(redis_url)
    policy = Retry(NoBackoff(), 0) if retry is None else retry
    settings: dict[str, Any] = {
        "socket_connect_timeout": timeout_s,
        "socket_timeout": timeout_s,
        "retry": policy,
    }
    packing: dict[str, Any] = {}
    if not HIREDIS_AVAILABLE:
        packing["command_packer"] = RespPacker(
            target.connection.get("encoding", "utf-8"),
            target.connection.get("encoding_errors", "strict"),
            6000,  # redis-py's buffer cutoff
        )
    if target.master is None:
        kind = target.connection.get("connection_class", Connection)
        return redis.ConnectionPool(
            **{
                **target.connection,
                **settings,
                **packing,
                "connection_class": _CONNECTION_CLASSES[kind],
            }
        )
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        list(target.sentinels),
        # one try per sentinel per discovery: a dead sentinel costs one refused connection
        sentinel_kwargs={**target.sentinel_auth, **settings, "retry": Retry(NoBackoff(), 0)},
    )
    return SentinelPool(  # type: ignore[no-untyped-call]
        target.master,
        sentinel,
        **{
            **target.connection,
            **settings,
            **packing,
            "connection_class": KumikoSentinelConnection,
        },
    )


def client(redis_url: str, *, timeout_s: float, retry: Retry | None = None) -> redis.Redis:
    """A client on a pool of its own (:func:`connection_pool`); ``close()`` closes both."""
    pool = connection_pool(redis_url, timeout_s=timeout_s, retry=retry)
    made = redis.Redis(connection_pool=pool)
    made.auto_close_connection_pool = True
    return made


def describe(client: redis.Redis) -> str:
    """``redis://host:port/db`` (or ``unix://``, ``redis+sentinel://``) of ``client``'s pool,
    without credentials, for messages."""
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    if isinstance(pool, SentinelConnectionPool):
        hosts = ",".join(
            f"{s.connection_pool.connection_kwargs.get('host', '?')}:"
            f"{s.connection_pool.connection_kwargs.get('port', '?')}"
            for s in pool.sentinel_manager.sentinels
        )
        return f"redis+sentinel://{hosts}/{kwargs.get('db', 0)}?master={pool.service_name}"
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    scheme = "rediss" if issubclass(pool.connection_class, SSLConnection) else "redis"
    return f"{scheme}://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"
