"""Every Redis failure that reaches a caller of kumiko's API, as one of kumiko's errors.

redis-py raises its own exception tree; a caller of ``JobRunner`` (and the ``kumiko``
command, and the dashboard) sees only :class:`~kumiko_dramatiq.errors.KumikoError`s, each a
one-line message naming what to do (:func:`kumiko_error`):

======================================================= ======================================
what redis-py raised                                     kumiko's error
======================================================= ======================================
no connection, a timeout, a server loading its data,     :class:`RedisUnavailableError`: try
a replica or a primary without enough replicas (a        again once Redis answers
fail-over), ``maxmemory`` reached (``OOM``), a server
that cannot persist (``MISCONF``), anything unforeseen
a peer that does not speak Redis's protocol              :class:`NotRedisError` (a
                                                         ``RedisUnavailableError``): check the
                                                         host and port
a refused password, an ACL user without a command or      :class:`RedisAccessError`: change the
key pattern, a database the server does not have, a       credentials, the user's rules, the
Redis Cluster node, any other refused command             database or the deployment
======================================================= ======================================
"""

from __future__ import annotations

from typing import Final

import redis

from kumiko_dramatiq.errors import (
    KumikoError,
    NotRedisError,
    RedisAccessError,
    RedisUnavailableError,
)


def kumiko_error(redis_url: str, action: str, exc: redis.RedisError) -> KumikoError:
    """The kumiko error a caller sees for ``exc``, raised while ``action`` (say "dispatching
    billing:job:send") against ``redis_url``."""
    text = " ".join(str(exc).split())
    if isinstance(exc, redis.AuthenticationError | redis.exceptions.AuthorizationError):
        return RedisAccessError(redis_url, f"refuses the credentials: {text}")
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return RedisAccessError(
            redis_url, f"does not let this user do what kumiko needs: {text} (see the ACL rules)"
        )
    if isinstance(exc, redis.exceptions.OutOfMemoryError) or text.startswith("OOM"):
        return RedisUnavailableError(
            redis_url, action, "Redis refuses writes: maxmemory reached; free memory or raise it"
        )
    if isinstance(exc, redis.exceptions.InvalidResponse):
        return NotRedisError(redis_url, action, exc)
    if isinstance(
        exc, redis.exceptions.ClusterError | redis.exceptions.AskError
    ) or text.startswith(("CROSSSLOT", "MOVED", "ASK ", "CLUSTERDOWN")):
        return RedisAccessError(
            redis_url,
            "is a Redis Cluster node: name the cluster with a redis+cluster:// URL",
        )
    if isinstance(exc, redis.ResponseError) and not text.startswith(
        ("READONLY", "NOREPLICAS", "MASTERDOWN", "LOADING", "BUSY", "MISCONF", "TRYAGAIN")
    ):
        if "DB index is out of range" in text or "invalid DB index" in text:
            return RedisAccessError(
                redis_url,
                "has no such database: give a database number below the server's `databases`",
            )
        return RedisAccessError(redis_url, f"refuses a command kumiko sends: {text}")
    return RedisUnavailableError(
        redis_url, action, exc, maybe_enqueued=action.startswith(WRITES) and _maybe_sent(exc)
    )


#: The actions (as the runner names them) that write messages: their errors say whether the
#: write may have happened.
WRITES: Final = ("dispatching", "handling event")


def _maybe_sent(exc: redis.RedisError) -> bool:
    """Whether the command may have reached Redis before ``exc``: not when the connection
    could not be made (refused, unreachable, a connect timeout), Redis refused the command
    (READONLY, LOADING, ...: nothing of it ran; also as the connection error a refusal of
    writes becomes, ``connection.unavailable_reply``) or kumiko would not send it to a
    primary being demoted (``failover.primary_problem``); else (a reply that timed out, a
    connection that dropped after the send) it may have."""
    if isinstance(exc, redis.ResponseError):
        return False
    text = str(exc)
    return not (
        "connecting to" in text
        or text.startswith(("Timeout connecting", "Redis refuses writes for now"))
        or text.endswith("not writing to it")
    )
