"""The Redis ACL rule set kumiko needs, and the start-up check that a user has it.

A Redis user for kumiko needs the commands of :func:`commands` (every command kumiko's Lua
scripts run, from :func:`kumiko_dramatiq.broker.lua.commands`, plus :data:`CLIENT_COMMANDS`, those
it sends from Python) and the key patterns of :func:`key_patterns`; no pub/sub channel.
:func:`setuser` spells it as one ``ACL SETUSER`` line::

    ACL SETUSER kumiko on >secret resetkeys resetchannels -@all +blpop +client|id ... \\
        ~kumiko:orders:* ~dramatiq ~dramatiq:orders-* ~dramatiq:__acks__.*.orders-* \\
        ~dramatiq:__heartbeats__

With a queue prefix the keys are that dataset's alone (several teams can share one Redis, each
its own user and prefix); without one, ``~kumiko:* ~dramatiq ~dramatiq:*``. Plain
``@dramatiq.actor`` queues on a kumiko broker (``dramatiq:<their queue>``) need
``~dramatiq:*``. On Redis 7.2 and
later, add ``+client|setinfo`` too: redis-py announces its name and version on each new
connection and ignores a refusal, which then only fills ``ACL LOG``.

:func:`check_server` is the start-up check every worker, scheduler and ``kumiko`` command runs
(:meth:`JobRunner.check_redis`, the ``Boot`` middleware of CLI workers): the broker's probe of
``SCRIPT LOAD``, ``EVALSHA``, ``MGET``, ``DEL`` and every script command on keys of both
namespaces (:meth:`~kumiko_dramatiq.broker.KumikoBroker.check_access`), then
:func:`check_client_commands` for the commands sent from Python. ``PING`` and ``SELECT``
are checked by connecting at all (a connection that cannot run them fails, naming
the command). The first refusal stops the start with one
:class:`~kumiko_dramatiq.errors.RedisAccessError` line naming the command (or the keys); a TLS
failure (:func:`~kumiko_dramatiq.broker.tls.tls_problem`, and a TLS connection the server
closes at once, :func:`~kumiko_dramatiq.broker.tls.tls_hint`) is one such line too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import redis

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.broker.keys import queue_bell
from kumiko_dramatiq.broker.lua import commands as lua_commands
from kumiko_dramatiq.broker.tls import tls_hint, tls_problem
from kumiko_dramatiq.errors import RedisAccessError

#: The commands kumiko sends from Python (not from a Lua script), and what for. Subcommands
#: are spelt as ACL spells them (``client|id``).
CLIENT_COMMANDS: Final[dict[str, str]] = {
    # connecting (HELLO and AUTH need no permission)
    "ping": "the start-up check and idle connection health checks",
    "select": "every new connection to a database other than 0",
    # scripts
    "evalsha": "runs every Lua script",
    "script|load": "loads a script the server does not hold yet (after a restart or fail-over)",
    "multi": "drain's consistent count of pending work",
    "exec": "drain's consistent count of pending work",
    # idle consumers
    "blpop": "an idle consumer waits on its queue's doorbell",
    "client|id": "names the doorbell connection, so that shutdown can wake it",
    "client|setname": "names the doorbell connection (kumiko-bell:<queue>) for CLIENT LIST",
    "client|unblock": "wakes consumers waiting on a doorbell at shutdown",
    # reads and writes outside scripts: status, listings, presence, run history
    "del": "presence records, reset-boot, the start-up probe",
    "get": "status, locks, dedup records, dead-letter details",
    "hget": "run records",
    "hgetall": "run records, dedup records",
    "hkeys": "cancel and dead-letter lookups: the attempts a message has records of",
    "hlen": "status: delayed messages",
    "hmget": "dead letters, run records",
    "hscan": "drain: messages in flight",
    "llen": "status: queued messages",
    "lrange": "parked messages of paused jobs",
    "mget": "presence, boot markers, the start-up probe",
    "pexpire": "presence records",
    "pttl": "locks and dedup records: time left",
    "sadd": "pause",
    "scan": "testing.delete_dataset (no command or page walks the keyspace)",
    "scard": "status: running messages",
    "set": "presence records",
    "sismember": "paused jobs",
    "smembers": "paused jobs",
    "zadd": "presence",
    "zcard": "status: dead letters",
    "zcount": "run history counts",
    "zrange": "presence, status: live workers",
    "zrem": "presence",
    "zrevrange": "dead letters, newest first",
    "zrevrangebyscore": "run history and dead letters by time",
    "zscore": "dead letter lookups",
}

#: Commands checked by connecting (a connection that may not run them fails at once, the
#: error naming the command), and those :meth:`KumikoBroker.check_access` checks itself.
_CHECKED_ELSEWHERE: Final = frozenset({"ping", "select", "script|load", "evalsha", "mget", "del"})


def commands() -> list[str]:
    """Every command kumiko needs, sorted: its scripts' and :data:`CLIENT_COMMANDS`."""
    return sorted(set(lua_commands()) | set(CLIENT_COMMANDS))


def key_patterns(queue_prefix: str | None = None) -> list[str]:
    """The ACL key patterns kumiko needs (:func:`kumiko_dramatiq.broker.keys.patterns`)."""
    return keys.patterns(queue_prefix)


def rules(queue_prefix: str | None = None, *, without: str | None = None) -> list[str]:
    """The ACL rules of a kumiko user (``without``: leave that one command out, for tests)."""
    return [
        "resetkeys",
        "resetchannels",
        "-@all",
        *(f"+{command}" for command in commands() if command != without),
        *(f"~{pattern}" for pattern in key_patterns(queue_prefix)),
    ]


def setuser(user: str, queue_prefix: str | None = None, password: str = "<password>") -> str:
    """The ``ACL SETUSER`` line that creates (or resets) ``user`` with :func:`rules`."""
    return " ".join(["ACL SETUSER", user, "on", f">{password}", *rules(queue_prefix)])


# -- the start-up check ---------------------------------------------------------------------
def check_server(broker: KumikoBroker, redis_url: str) -> None:
    """Raise :class:`RedisAccessError` (one line) if Redis refuses anything kumiko needs
    (see the module docstring). Other connection errors propagate as they are."""
    try:
        broker.check_access(redis_url)
        check_client_commands(broker.client, redis_url, broker.queue_prefix, broker.namespace)
    except (redis.ConnectionError, OSError) as exc:
        problem = tls_problem(exc) or tls_hint(exc)
        if problem is not None:
            raise RedisAccessError(redis_url, problem) from None
        raise


def check_client_commands(
    client: redis.Redis, redis_url: str, queue_prefix: str, namespace: str = keys.NAMESPACE
) -> None:
    """Run each command of :data:`CLIENT_COMMANDS` that nothing else checks, with harmless
    arguments on probe keys of both namespaces (deleted after), in a few round trips; raise
    :class:`RedisAccessError` naming the first refused. Connection errors propagate."""
    probes = [
        keys.probe(queue_prefix) + ":client",
        queue_bell(f"{queue_prefix}-kumiko-probe", namespace),
    ]
    try:
        _check_namespace_key(client, redis_url, namespace)
        _check_data_commands(client, redis_url, probes)
        _check_transactions(client, redis_url, probes[0] + ":v")
        _check_consumer_commands(client, redis_url, probes[1])
    finally:
        client.delete(*probes, *(key + suffix for key in probes for suffix in _PROBE_SUFFIXES))


#: Harmless calls of each data command on a probe key (each type its own key; ``scan``
#: takes a pattern).
_DATA_PROBES: Final[dict[str, Callable[[Any, str], Any]]] = {
    "get": lambda pipe, key: pipe.get(key + ":v"),
    "set": lambda pipe, key: pipe.set(key + ":v", "v", px=60_000),
    "pexpire": lambda pipe, key: pipe.pexpire(key + ":v", 60_000),
    "pttl": lambda pipe, key: pipe.pttl(key + ":v"),
    "scan": lambda pipe, key: pipe.scan(0, match=key + ":v", count=1),
    "hget": lambda pipe, key: pipe.hget(key + ":h", "f"),
    "hgetall": lambda pipe, key: pipe.hgetall(key + ":h"),
    "hkeys": lambda pipe, key: pipe.hkeys(key + ":h"),
    "hlen": lambda pipe, key: pipe.hlen(key + ":h"),
    "hmget": lambda pipe, key: pipe.hmget(key + ":h", ["f"]),
    "hscan": lambda pipe, key: pipe.hscan(key + ":h", 0, count=1),
    "llen": lambda pipe, key: pipe.llen(key + ":l"),
    "lrange": lambda pipe, key: pipe.lrange(key + ":l", 0, 0),
    "sadd": lambda pipe, key: pipe.sadd(key + ":s", "m"),
    "scard": lambda pipe, key: pipe.scard(key + ":s"),
    "sismember": lambda pipe, key: pipe.sismember(key + ":s", "m"),
    "smembers": lambda pipe, key: pipe.smembers(key + ":s"),
    "zadd": lambda pipe, key: pipe.zadd(key + ":z", {"m": 0}),
    "zcard": lambda pipe, key: pipe.zcard(key + ":z"),
    "zcount": lambda pipe, key: pipe.zcount(key + ":z", 0, 0),
    "zrange": lambda pipe, key: pipe.zrange(key + ":z", 0, 0),
    "zrem": lambda pipe, key: pipe.zrem(key + ":z", "m"),
    "zrevrange": lambda pipe, key: pipe.zrevrange(key + ":z", 0, 0),
    "zrevrangebyscore": lambda pipe, key: pipe.zrevrangebyscore(key + ":z", 0, 0),
    "zscore": lambda pipe, key: pipe.zscore(key + ":z", "m"),
}
#: The suffixes of the probe keys those calls use.
_PROBE_SUFFIXES: Final = (":v", ":h", ":l", ":s", ":z")
_CONSUMER_COMMANDS: Final = ("client|setname", "client|id", "client|unblock", "rpush", "blpop")

#: Every command the start-up check tries (or checks by connecting): a test keeps
#: :data:`CLIENT_COMMANDS` inside it.
CHECKED_COMMANDS: Final = frozenset(
    {*_CHECKED_ELSEWHERE, *_DATA_PROBES, "multi", "exec", *_CONSUMER_COMMANDS}
)


def _check_namespace_key(client: redis.Redis, redis_url: str, namespace: str) -> None:
    try:
        client.exists(namespace)
    except redis.exceptions.NoPermissionError as exc:
        raise RedisAccessError(
            redis_url,
            f"does not let this user access the key {namespace!r}, which every broker script "
            f"of kumiko names (add ~{namespace} to its key patterns): {exc}",
        ) from None


def _check_data_commands(client: redis.Redis, redis_url: str, probes: list[str]) -> None:
    pipe = client.pipeline(transaction=False)
    sent: list[str] = []
    for command, probe in _DATA_PROBES.items():
        for key in probes:
            probe(pipe, key)
            sent.append(command)
    for command, reply in zip(sent, pipe.execute(raise_on_error=False), strict=True):
        if isinstance(reply, redis.exceptions.NoPermissionError):
            raise _refusal(redis_url, command, reply)
        if isinstance(reply, redis.ConnectionError):
            raise reply


def _check_transactions(client: redis.Redis, redis_url: str, key: str) -> None:
    pipe = client.pipeline(transaction=True)
    pipe.get(key)
    try:
        pipe.execute()
    except redis.ResponseError as exc:
        # a refused MULTI leaves a lone EXEC; a refused EXEC aborts the transaction
        text = str(exc)
        if "EXEC without MULTI" in text:
            raise _refusal(redis_url, "multi", exc) from None
        if "NOPERM" in text or isinstance(exc, redis.exceptions.NoPermissionError):
            raise _refusal(redis_url, "exec", exc) from None
        raise


def _check_consumer_commands(client: redis.Redis, redis_url: str, bell: str) -> None:
    # on a connection of its own, as a doorbell wait: named, its id read, woken (not
    # blocked, so a no-op), then a BLPOP on a list holding one item (it returns at once)
    probe = redis.Redis(connection_pool=client.connection_pool, single_connection_client=True)
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("client|setname", lambda: probe.client_setname("kumiko-probe")),
        ("client|id", probe.client_id),
        ("client|unblock", lambda: probe.client_unblock(0)),
        ("rpush", lambda: probe.rpush(bell, "1")),
        ("blpop", lambda: probe.blpop([bell], timeout=1)),
    ]
    try:
        for command, step in steps:
            try:
                step()
            except redis.exceptions.NoPermissionError as exc:
                raise _refusal(redis_url, command, exc) from None
    finally:
        probe.close()


def _refusal(redis_url: str, command: str, exc: BaseException) -> RedisAccessError:
    name = command.upper().replace("|", " ")
    if "key" in str(exc).lower():
        return RedisAccessError(
            redis_url, f"does not let this user access the keys kumiko needs ({name}): {exc}"
        )
    return RedisAccessError(
        redis_url, f"does not let this user run {name}, which kumiko needs: {exc}"
    )
