"""The one place that turns a kumiko Redis URL into connections: pools and clients.

Every Redis connection kumiko opens (a runner's pool, the start-up probe, ``reset_boot`` by
URL) is built by :func:`connection_pool` or :func:`client` from a URL parsed by
:mod:`kumiko_dramatiq.broker.urls`. A ``redis+sentinel://`` pool asks the sentinels for the
primary's address whenever a connection (re)connects and checks with ``ROLE`` that it reached
a primary; its :class:`~kumiko_dramatiq.broker.failover.PrimaryWatch` follows the sentinels'
fail-over events, so that no connection of the process writes to a primary being demoted
(see :mod:`kumiko_dramatiq.broker.failover`): a fail-over is a few failed commands, then the
same pool works against the new primary. A reply by which Redis refuses writes for now is a
connection error (:class:`WritesRefusedAreUnavailable`). When no sentinel knows a healthy
primary, the error says so in one line, naming each sentinel and what it answered.
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
from redis.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
)
from redis.utils import HIREDIS_AVAILABLE

from kumiko_dramatiq.broker.cluster import cluster_pool, owner_of
from kumiko_dramatiq.broker.failover import Address, PrimaryWatch
from kumiko_dramatiq.broker.packer import RespPacker
from kumiko_dramatiq.broker.refusals import WritesRefusedAreUnavailable
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.broker.seam import has_socket
from kumiko_dramatiq.broker.urls import parse


class KumikoConnection(WritesRefusedAreUnavailable, Connection):
    """A TCP connection (see :class:`WritesRefusedAreUnavailable`)."""


class KumikoSSLConnection(WritesRefusedAreUnavailable, SSLConnection):
    """A TLS connection (see :class:`WritesRefusedAreUnavailable`)."""


class KumikoUnixConnection(WritesRefusedAreUnavailable, UnixDomainSocketConnection):
    """A Unix socket connection (see :class:`WritesRefusedAreUnavailable`)."""


class KumikoSentinelConnection(WritesRefusedAreUnavailable, SentinelManagedConnection):
    """A connection to the primary Sentinel names (see :class:`WritesRefusedAreUnavailable`;
    redis-py's own class already drops a connection that answers ``READONLY``), following
    fail-overs with its pool's :class:`~kumiko_dramatiq.broker.failover.PrimaryWatch`:

    - before each command it compares the watch's generation with its own, and reconnects
      when a fail-over moved on since it connected (also a connection a thread keeps,
      ``KumikoBroker.thread_client``, which redis-py would otherwise reconnect to the address
      it had, the old primary's);
    - connecting, it asks the sentinels for the primary, refuses an address the watch says
      is being or was demoted, and checks with ``ROLE`` that the node is a primary;
    - a ``READONLY`` reply tells the watch, so that every other connection leaves that node.
    """

    def __init__(self, *, watch: PrimaryWatch, **kwargs: Any) -> None:
        self._watch = watch
        self._generation = -1
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]

    def connect_to(self, address: Address) -> None:
        watch = self._watch
        watch.ensure_listening()
        self._generation = watch.generation
        host, port = address[0], int(address[1])
        watch.check((host, port))
        super().connect_to(address)  # type: ignore[no-untyped-call]
        self.send_command("ROLE")  # type: ignore[no-untyped-call]
        role = self.read_response()
        if not role or text(role[0]) != "master":
            self.disconnect()  # type: ignore[no-untyped-call]
            shown = text(role[0]) if role else "?"
            raise redis.ConnectionError(
                f"{host}:{port} is a {shown}, not the primary (a fail-over in progress?)"
            )
        watch.connected((host, port))

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if has_socket(self) and self._generation != self._watch.generation:
            self.disconnect()  # type: ignore[no-untyped-call]
        if not has_socket(self):
            self.connect()  # type: ignore[no-untyped-call]
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ConnectionError as exc:
            if isinstance(exc.__context__, redis.exceptions.ReadOnlyError) and self.host:
                self._watch.demoted_reply((str(self.host), int(self.port)))
            raise


_CONNECTION_CLASSES: Final[dict[type[Connection] | type[UnixDomainSocketConnection], type]] = {
    Connection: KumikoConnection,
    SSLConnection: KumikoSSLConnection,
    UnixDomainSocketConnection: KumikoUnixConnection,
}


class KumikoSentinel(Sentinel):
    """redis-py's ``Sentinel`` whose "no primary found" error is one line: each sentinel and
    what it answered (redis-py's names each sentinel by its client object's repr)."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        problems: list[str] = []
        for index, sentinel in enumerate(self.sentinels):
            where = _address_of(sentinel)
            try:
                masters: Any = sentinel.sentinel_masters()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                problems.append(f"{where}: {str(exc).rstrip('.')}")
                continue
            state = masters.get(service_name)
            if state is None:
                problems.append(f"{where}: does not monitor it")
            elif not self.check_master_state(state, service_name):  # type: ignore[no-untyped-call]
                problems.append(f"{where}: reports it down or not a primary")
            else:
                self.sentinels[0], self.sentinels[index] = sentinel, self.sentinels[0]
                return str(state["ip"]), int(state["port"])
        raise MasterNotFoundError(f"No master found for {service_name!r} ({'; '.join(problems)})")

    def reports(self, service_name: str) -> list[tuple[Address | None, bool]]:
        """What each sentinel that answers says of ``service_name`` now: the primary's
        address (``None`` if it does not monitor it) and whether a fail-over is in progress."""
        found: list[tuple[Address | None, bool]] = []
        for sentinel in self.sentinels:
            try:
                masters: Any = sentinel.sentinel_masters()
            except (redis.ConnectionError, redis.TimeoutError):
                continue
            state = masters.get(service_name)
            if state is None:
                found.append((None, False))
                continue
            busy = "failover_in_progress" in str(state.get("flags", ""))
            found.append(((str(state["ip"]), int(state["port"])), busy))
        return found


def _address_of(client: redis.Redis) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


class SentinelPool(SentinelConnectionPool):
    """redis-py's Sentinel pool with a :class:`~kumiko_dramatiq.broker.failover.PrimaryWatch`
    its connections share, which also closes its connections to the sentinels, and stops
    the watch, when it is disconnected (``JobRunner.stop()`` closes every connection the
    runner opened). Only the idle ones when only the pool's idle ones go: redis-py does that
    when it sees the primary move, while other threads may be asking a sentinel for the
    primary on theirs."""

    sentinel_manager: KumikoSentinel

    def __init__(
        self,
        service_name: str,
        sentinel_manager: KumikoSentinel,
        *,
        watch: PrimaryWatch,
        **kwargs: Any,
    ) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]
        self.watch = watch
        self.connection_kwargs["watch"] = watch

    def disconnect(self, inuse_connections: bool = True) -> None:
        super().disconnect(inuse_connections)
        for sentinel in self.sentinel_manager.sentinels:
            sentinel.connection_pool.disconnect(inuse_connections)
        if inuse_connections:
            self.watch.close()


def connection_pool(
    redis_url: str,
    *,
    timeout_s: float,
    retry: Retry | None = None,
    follow_failovers: bool = False,
    queue_prefix: str | None = None,
) -> redis.ConnectionPool:
    """A pool for ``redis_url`` (any form above) with connect and read timeouts of
    ``timeout_s`` and ``retry`` as its commands' retry policy (``None``: no retry).
    ``follow_failovers``: a Sentinel pool subscribes to the sentinels' fail-over events once it
    connects (a runner's pool; a one-off client does not). On a cluster
    (``redis+cluster://``), the pool's connections go to the primary of ``queue_prefix``'s
    slot (:mod:`kumiko_dramatiq.broker.cluster`; without a prefix, that of the default
    ``kumiko``). ``JobConfigError`` for a bad URL; opens no connection."""
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
    if target.is_cluster:
        return cluster_pool(
            target.nodes, queue_prefix or "kumiko", dict(target.connection), **settings, **packing
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
    # one try per sentinel per discovery: a dead sentinel costs one refused connection
    sentinel_kwargs = {**target.sentinel_auth, **settings, "retry": Retry(NoBackoff(), 0)}
    sentinel = KumikoSentinel(  # type: ignore[no-untyped-call, unused-ignore]
        list(target.sentinels), sentinel_kwargs=sentinel_kwargs
    )
    master = target.master
    watch = PrimaryWatch(
        master,
        list(target.sentinels),
        {**target.sentinel_auth, "socket_connect_timeout": timeout_s, "socket_timeout": timeout_s},
        ask=lambda: sentinel.reports(master),
        listen=follow_failovers,
    )
    return SentinelPool(
        master,
        sentinel,
        watch=watch,
        **{
            **target.connection,
            **settings,
            **packing,
            "connection_class": KumikoSentinelConnection,
        },
    )


def client(
    redis_url: str,
    *,
    timeout_s: float,
    retry: Retry | None = None,
    queue_prefix: str | None = None,
) -> redis.Redis:
    """A client on a pool of its own (:func:`connection_pool`); ``close()`` closes both."""
    pool = connection_pool(redis_url, timeout_s=timeout_s, retry=retry, queue_prefix=queue_prefix)
    made = redis.Redis(connection_pool=pool)
    made.auto_close_connection_pool = True
    return made


def describe(client: redis.Redis) -> str:
    """``redis://host:port/db`` (or ``unix://``, ``redis+sentinel://``) of ``client``'s pool,
    without credentials, for messages."""
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    owner = owner_of(pool)
    if owner is not None:
        scheme = "rediss" if issubclass(pool.connection_class, SSLConnection) else "redis"
        hosts = ",".join(f"{host}:{port}" for host, port in owner.nodes[:3])
        known = owner.known
        at = f" (slot {owner.slot}" + (f" at {known[0]}:{known[1]})" if known else ")")
        return f"{scheme}+cluster://{hosts}/0{at}"
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
