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
(:meth:`JobRunner.check_redis`, the ``Boot`` middleware of CLI workers). ``PING`` and ``SELECT``
are checked by connecting at all; ``SCRIPT LOAD`` and ``EVALSHA`` by loading and running the
probe (``lua/probe.lua``), which checks every other command of :func:`commands` with
``redis.acl_check_cmd`` (Redis 7): the keyless ones once, the others on one key of each shape
the process touches (:func:`sample_keys`: kumiko's keys, Dramatiq's namespace key, the queue
list, message hash, delay queue, schedule, dead letters, doorbells and this worker's ack sets
of both lanes and of every plain actor's queue declared on the broker, and the shared heartbeats).
Nothing is run, read or written, so the check costs the same on an empty Redis and on one with
millions of keys (one script of about a thousand permission checks, under a millisecond). Then
one ``MGET`` of two keys of different hash slots: a Redis Cluster node refuses it
(:func:`cluster_problem`). The first problem stops the start with one
:class:`~kumiko_dramatiq.errors.RedisAccessError` line naming what to change: the key pattern
to add (``~dramatiq:__heartbeats__``), the command (``+client|setname``), that Cluster is not
supported; a TLS failure (:func:`~kumiko_dramatiq.broker.tls.tls_problem`, and a TLS connection
the server closes at once, :func:`~kumiko_dramatiq.broker.tls.tls_hint`) is one such line too.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any, Final

import redis
from dramatiq.common import dq_name, q_name

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.broker.lua import commands as lua_commands
from kumiko_dramatiq.broker.lua import source as lua_source
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.broker.tls import scheme_problem, tls_hint, tls_problem
from kumiko_dramatiq.errors import RedisAccessError
from kumiko_dramatiq.options import LANES, lane_queue

#: The commands kumiko sends from Python (not from a Lua script), and what for. Subcommands
#: are spelt as ACL spells them (``client|id``).
CLIENT_COMMANDS: Final[dict[str, str]] = {
    # connecting (HELLO and AUTH need no permission)
    "ping": "the start-up check and idle connection health checks",
    "select": "every new connection to a database other than 0",
    # scripts
    "evalsha": "runs kumiko's Lua scripts",
    "script|load": "loads a script the server does not hold yet (after a restart or fail-over)",
    "fcall": "runs the scripts every job passes (enqueue, lane fetch, settle): Redis functions",
    "function|load": "loads kumiko's function library when the server does not hold it yet "
    "(a new version, a restart without persistence)",
    "multi": "drain's consistent count of pending work",
    "exec": "drain's consistent count of pending work",
    # idle consumers
    "subscribe": "runner.result waits for the end of its message to be announced",
    "publish": "a cancel wakes the waiters of the message's result",
    "blpop": "an idle consumer waits on its queue's doorbell; a worker's keeper waits for "
    "asks about what it holds; cancel, purge, pause and stop_run wait for their answers",
    "client|id": "names the doorbell connection, so that shutdown can wake it",
    "client|setname": "names the doorbell connection (kumiko-bell:<queue>) for CLIENT LIST",
    "client|unblock": "wakes consumers waiting on a doorbell at shutdown, or when a settle "
    "claimed messages for them",
    # reads and writes outside scripts: status, listings, presence, run history
    "del": "presence records, reset-boot, stop requests a worker acted on, the progress of "
    "an attempt that ended",
    "exists": "stop_run: whether a message that does not run left a trace",
    "get": "status, locks, dedup records, dead-letter details",
    "hget": "run records",
    "hgetall": "run records, dedup records, messages waiting for caps",
    "hkeys": "cancel and dead-letter lookups: the attempts a message has records of",
    "hlen": "status: delayed messages",
    "hmget": "dead letters, run records, bodies on an older version's delay queue list",
    "incr": "reset-boot: the boot job's id generation",
    "info": "worker start and status: Redis's maxmemory-policy (INFO memory)",
    "hscan": "drain: messages in flight; kumiko queued: delayed messages",
    "llen": "status: queued messages",
    "lrange": "parked messages of paused jobs; the head of an older version's delay queue list; "
    "kumiko queued: waiting messages",
    "mget": "presence, boot markers, the start-up check's Cluster probe, stop requests, "
    "the progress of running attempts",
    "pexpire": "presence records",
    "pttl": "locks and dedup records: time left",
    "role": "a connection to a Sentinel-managed primary checks it is one",
    "sadd": "pause",
    "scan": "testing.delete_dataset (no command or page walks the keyspace)",
    "scard": "status: running messages",
    "set": "presence records, stop requests, ctx.progress",
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
        *(f"&{pattern}" for pattern in keys.channel_patterns(queue_prefix)),
    ]


def setuser(user: str, queue_prefix: str | None = None, password: str = "<password>") -> str:
    """The ``ACL SETUSER`` line that creates (or resets) ``user`` with :func:`rules`."""
    return " ".join(["ACL SETUSER", user, "on", f">{password}", *rules(queue_prefix)])


# -- the start-up check ---------------------------------------------------------------------
def check_server(broker: KumikoBroker, redis_url: str) -> None:
    """Raise :class:`RedisAccessError` (one line) if Redis refuses anything kumiko needs, or
    is a Redis Cluster node (see the module docstring). Other connection errors propagate as
    they are."""
    try:
        _check(broker, redis_url)
    except redis.ResponseError as exc:
        cluster = cluster_problem(exc)
        if cluster is not None:
            raise RedisAccessError(redis_url, cluster) from None
        raise
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        problem = tls_problem(exc) or tls_hint(exc) or scheme_problem(redis_url, exc)
        if problem is not None:
            raise RedisAccessError(redis_url, problem) from None
        raise


def _check(broker: KumikoBroker, redis_url: str) -> None:
    client = broker.client
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise RedisAccessError(redis_url, f"refuses the credentials: {exc}") from None
    except redis.exceptions.NoPermissionError as exc:
        raise _refusal(redis_url, "ping", exc) from None
    samples = sample_keys(broker)
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("script|load", lambda: client.script_load(lua_source("probe"))),
        ("evalsha", lambda: broker.lua.probe(keys=[], args=["\n".join(samples), *commands()])),
    ]
    findings: Any = None
    for command, step in steps:
        try:
            findings = step()
        except redis.exceptions.NoPermissionError as exc:
            raise _refusal(redis_url, command, exc) from None
        except redis.ResponseError as exc:
            if "acl_check_cmd" in str(exc):
                raise RedisAccessError(
                    redis_url,
                    "is older than Redis 7: kumiko needs Redis 7 or later (its start-up check "
                    "asks redis.acl_check_cmd)",
                ) from None
            raise
    problem = _finding_problem([text(item) for item in findings], samples)
    if problem is not None:
        raise RedisAccessError(redis_url, problem)
    # Kumiko's and Dramatiq's keys in one command: a Redis Cluster node refuses it (CROSSSLOT
    # or MOVED) unless both carry the dataset's hash tag (redis+cluster://), as it would
    # refuse every broker script.
    client.mget([keys.probe(broker.queue_prefix), broker.namespace])


def sample_keys(broker: KumikoBroker) -> dict[str, str]:
    """One key of each shape a process of ``broker`` touches (for the start-up check), each
    with the ACL key pattern that grants it: kumiko's own keys, Dramatiq's namespace key, the
    queue list, message hash, delay queue, schedule, dead letters and doorbells of both lanes and of
    every other queue declared on the broker (plain ``@dramatiq.actor`` queues), this
    worker's ack sets of them, and the shared heartbeats."""
    prefix, namespace = broker.queue_prefix, broker.namespace
    queues = [lane_queue(prefix, lane) for lane in LANES]
    queues += sorted(
        {q_name(queue) for queue in broker.get_declared_queues()} - set(queues),
    )
    found = [
        keys.probe(prefix),
        keys.inflight(prefix),
        keys.hold_asks(prefix, broker.broker_id),
        keys.hold_bell(prefix, broker.broker_id),
        keys.hold_answer(prefix, "probe"),
        namespace,
        keys.heartbeats(namespace),
    ]
    for queue in queues:
        for each in (queue, dq_name(queue)):
            found += [
                keys.queue_list(each, namespace),
                keys.queue_messages(each, namespace),
                keys.queue_bell(each, namespace),
                keys.consumer_acks(broker.broker_id, each, namespace),
            ]
        found += [
            keys.queue_schedule(queue, namespace),
            keys.dead_letters(queue, namespace),
            keys.dead_letter_messages(queue, namespace),
        ]
    samples = {key: _pattern_of(key, prefix) for key in dict.fromkeys(found)}
    channel = keys.results_channel(prefix)
    samples[f"&{channel}"] = f"&{channel}"  # a channel: the probe checks it as one
    return samples


def _pattern_of(key: str, queue_prefix: str) -> str:
    """The documented key pattern that grants ``key`` (the dataset's, else the broad ones)."""
    for pattern in [*key_patterns(queue_prefix), *key_patterns(None)]:
        if fnmatch.fnmatchcase(key, pattern):
            return pattern
    return key


def _finding_problem(findings: list[str], samples: dict[str, str]) -> str | None:
    """What the probe's findings (``[kind, command, key, ...]``) mean, in one line: a missing
    key pattern first, then a missing command, then a command refused on one key."""
    entries = [tuple(findings[i : i + 3]) for i in range(0, len(findings), 3)]
    for kind in ("unknown", "key", "command", "channel", "pair"):
        for found, command, key in entries:
            if found != kind:
                continue
            name = command.upper().replace("|", " ")
            if kind == "unknown":
                return f"cannot be checked for {name}: kumiko's probe has no entry for it (a bug)"
            if kind == "key":
                return (
                    f"does not let this user access the key {key!r}, which kumiko uses (add "
                    f"~{samples.get(key, key)} to its key patterns)"
                )
            if kind == "command":
                return (
                    f"does not let this user run {name}, which kumiko needs (add +{command} to "
                    "its rules)"
                )
            if kind == "channel":
                return (
                    f"does not let this user {name} on the channel {key!r}, which kumiko "
                    f"uses (add &{key} to its rules)"
                )
            return f"does not let this user run {name} on the key {key!r}, which kumiko needs"
    return None


def cluster_problem(exc: BaseException) -> str | None:
    """If ``exc`` is how a Redis Cluster node answers a command kumiko sends, that in one
    line; else ``None``."""
    if isinstance(exc, redis.exceptions.MasterDownError):
        return None  # a replica cut off from its primary, not Cluster
    cluster = (
        redis.exceptions.ClusterDownError,
        redis.exceptions.AskError,
        redis.exceptions.TryAgainError,
        redis.exceptions.ClusterCrossSlotError,
    )
    message = str(exc)
    if isinstance(exc, cluster) or "cluster mode" in message or message.startswith("CROSSSLOT"):
        return (
            f"is a Redis Cluster node ({message.splitlines()[0][:80]}): name the cluster with a "
            "redis+cluster://host:port,host:port/0 URL (rediss+cluster:// for TLS), which puts "
            "every key of the dataset in the slot of its queue prefix's hash tag"
        )
    return None


def _refusal(redis_url: str, command: str, exc: BaseException) -> RedisAccessError:
    name = command.upper().replace("|", " ")
    return RedisAccessError(
        redis_url, f"does not let this user run {name}, which kumiko needs: {exc}"
    )
