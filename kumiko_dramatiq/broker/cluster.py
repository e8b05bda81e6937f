"""Redis Cluster: every connection of a dataset goes to the primary that serves its slot.

Every key of a dataset on a cluster carries its queue prefix's hash tag
(``kumiko:{prefix}:...``, ``dramatiq:{prefix}:...``; :mod:`kumiko_dramatiq.broker.keys`), so
the whole dataset lives in one slot, served by one primary at a time. Kumiko does not route
each command by its keys, as a cluster client does: a dataset's pool connects to the primary
of that slot, which it asks the cluster's nodes for (``CLUSTER SLOTS``) whenever the slot's
owner is not known, so that every command, script, function, pipeline and transaction runs
there as on one Redis.

When the slot moves, the pool follows. A reply by which the cluster says the slot is served
elsewhere or is being moved (``MOVED``, ``ASK``, ``TRYAGAIN``, ``CLUSTERDOWN``), or by which a
demoted primary refuses writes (``READONLY``), and a connection that cannot be opened, make
the owner unknown: the connection is dropped and the command fails as a
``ConnectionError``, which the pool's retry re-sends and every caller already treats as a
Redis it cannot reach for now (a refused command did not run). Every other connection of the
pool reconnects before its next command (:attr:`SlotOwner.generation`), so a
``CLUSTER FAILOVER`` or a resharding of the dataset's slot is a few failed commands, then the
same pool works against the new owner. The function library is loaded there on the first
call that misses it (:mod:`kumiko_dramatiq.broker.lua`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Final

import redis
from redis.connection import Connection, SSLConnection
from redis.crc import key_slot

from kumiko_dramatiq.broker.refusals import WritesRefusedAreUnavailable
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.broker.seam import has_socket

Address = tuple[str, int]

#: The replies by which a cluster says that a slot is served elsewhere, or is moving.
SLOT_MOVED: Final = (
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
)


def hash_tag(queue_prefix: str) -> str:
    """``{queue_prefix}``: the hash tag every key of the dataset carries on a cluster."""
    return "{" + queue_prefix + "}"


def slot_of(queue_prefix: str) -> int:
    """The cluster slot of the dataset ``queue_prefix`` (CRC16 of its hash tag, mod 16384)."""
    return int(key_slot(hash_tag(queue_prefix).encode()))


class SlotOwner:
    """Which primary serves one slot: asked of the cluster's nodes when not known, shared by
    a pool's connections. ``generation`` counts the times the owner was forgotten."""

    def __init__(self, nodes: Iterable[Address], slot: int, connect_kwargs: dict[str, Any]) -> None:
        self.nodes: list[Address] = list(dict.fromkeys(nodes))
        self.slot = slot
        self.generation = 0
        self._connect_kwargs = connect_kwargs
        self._owner: Address | None = None
        self._lock = threading.Lock()

    @property
    def known(self) -> Address | None:
        """The owner as last found (``None``: not known now)."""
        return self._owner

    def owner(self) -> Address:
        """The primary of the slot; asks the nodes when it is not known."""
        with self._lock:
            if self._owner is None:
                self._owner = self._ask()
            return self._owner

    def forget(self, address: Address | None) -> None:
        """The slot is not (or no longer) served at ``address``: the next connection asks."""
        with self._lock:
            if self._owner is not None and (address is None or self._owner == address):
                self._owner = None
                self.generation += 1

    def _ask(self) -> Address:
        problems: list[str] = []
        for host, port in list(self.nodes):
            try:
                slots = self._slots_of(host, port)
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
                problems.append(f"{host}:{port}: {str(exc).splitlines()[0][:80]}")
                continue
            found: Address | None = None
            for entry in slots:
                start, end, *members = entry
                for member in members:
                    address = (text(member[0]) or host, int(member[1]))
                    if address not in self.nodes:
                        self.nodes.append(address)  # so that the seeds may go
                if int(start) <= self.slot <= int(end) and members:
                    found = (text(members[0][0]) or host, int(members[0][1]))
            if found is not None:
                return found
            problems.append(f"{host}:{port}: no node serves slot {self.slot}")
        raise redis.ConnectionError(
            f"no node of the cluster names the primary of slot {self.slot} ({'; '.join(problems)})"
        )

    def _slots_of(self, host: str, port: int) -> list[Any]:
        kind = self._connect_kwargs.get("connection_class", Connection)
        kwargs = {k: v for k, v in self._connect_kwargs.items() if k != "connection_class"}
        connection = kind(host=host, port=port, **kwargs)
        try:
            connection.send_command("CLUSTER", "SLOTS")
            reply = connection.read_response()
        finally:
            connection.disconnect()
        return list(reply or [])


class _SlotMember:
    """A connection to the primary of its pool's slot (see the module docstring)."""

    host: str
    port: int

    def __init__(self, *, owner: SlotOwner, **kwargs: Any) -> None:
        self._owner = owner
        self._generation = -1
        super().__init__(**kwargs)

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        # every (re)connect of redis-py's passes here: ``connect()``, and a command sent on a
        # connection without a socket
        if has_socket(self):
            return
        try:
            self.host, self.port = self._owner.owner()
            self._generation = self._owner.generation
            super().connect_check_health(*args, **kwargs)  # type: ignore[misc]
        except (redis.ConnectionError, redis.TimeoutError):
            self._owner.forget((self.host, self.port))
            raise

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if has_socket(self) and self._generation != self._owner.generation:
            self.disconnect()  # type: ignore[attr-defined]
        super().send_packed_command(command, check_health)  # type: ignore[misc]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except SLOT_MOVED as exc:
            self._owner.forget((self.host, self.port))
            self.disconnect()  # type: ignore[attr-defined]
            raise redis.ConnectionError(
                f"the dataset's slot {self._owner.slot} is served elsewhere now: {exc}"
            ) from exc
        except redis.ConnectionError:
            self._owner.forget((self.host, self.port))
            raise


class ClusterConnection(_SlotMember, WritesRefusedAreUnavailable, Connection):
    """A TCP connection to the primary of the pool's slot."""


class ClusterSSLConnection(_SlotMember, WritesRefusedAreUnavailable, SSLConnection):
    """A TLS connection to the primary of the pool's slot."""


def cluster_pool(
    nodes: Iterable[Address], queue_prefix: str, connection: dict[str, Any], **settings: Any
) -> redis.ConnectionPool:
    """A pool whose connections go to the primary of ``queue_prefix``'s slot."""
    tls = connection.get("connection_class") is SSLConnection
    seed = {
        k: v
        for k, v in {**connection, **settings}.items()
        if k not in ("retry", "command_packer", "db")
    }
    owner = SlotOwner(nodes, slot_of(queue_prefix), seed)
    first = owner.nodes[0]
    return redis.ConnectionPool(
        **{
            **connection,
            **settings,
            "host": first[0],
            "port": first[1],
            "owner": owner,
            "connection_class": ClusterSSLConnection if tls else ClusterConnection,
        }
    )


def owner_of(pool: redis.ConnectionPool) -> SlotOwner | None:
    """The :class:`SlotOwner` of a cluster pool, ``None`` for any other pool."""
    found = pool.connection_kwargs.get("owner")
    return found if isinstance(found, SlotOwner) else None
