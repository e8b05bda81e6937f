"""Every Redis key of kumiko's own, one function each, all under ``kumiko:{queue_prefix}:``.

A dataset is one Redis database plus one queue prefix: runners with different prefixes
never touch each other's keys. Dramatiq's own layout (``dramatiq:{queue}``, ``.msgs``,
``.DQ``, ``.XQ``, ack sets, heartbeats) is the broker's business: its key builders live in
:mod:`kumiko_dramatiq.broker`, the one module that knows that layout.
"""

from __future__ import annotations


def _root(queue_prefix: str) -> str:
    return f"kumiko:{queue_prefix}"


def root(queue_prefix: str) -> str:
    """``kumiko:{queue_prefix}:``, under which the run history's keys live (built in Lua:
    see :mod:`kumiko_dramatiq.history`)."""
    return f"{_root(queue_prefix)}:"


def sent(queue_prefix: str, redis_message_id: str) -> str:
    """Set when a redis message id was written: a re-sent write finds it."""
    return f"{_root(queue_prefix)}:sent:{redis_message_id}"


def enqueue_guard(queue_prefix: str, message_id: str) -> str:
    """Set when a deterministic message id was enqueued (fan-out children, cron ticks)."""
    return f"{_root(queue_prefix)}:enqueued:{message_id}"


def boot_marker(queue_prefix: str, job_name: str) -> str:
    """Persistent: the boot-once job ``job_name`` was enqueued in this dataset."""
    return f"{_root(queue_prefix)}:boot:{job_name}"


def sequential_lock(queue_prefix: str, job_name: str, tenant_id: str | None) -> str:
    """The lease of a sequential job (per tenant for per-tenant jobs)."""
    scope = "" if tenant_id is None else f":tenant:{len(tenant_id)}:{tenant_id}"
    return f"{_root(queue_prefix)}:lock:{job_name}{scope}"


def dedup(queue_prefix: str, job_name: str, dedup_key: str) -> str:
    """The record of the live job behind ``dedup_key``."""
    return f"{_root(queue_prefix)}:dedup:{job_name}:{dedup_key}"


def completed(queue_prefix: str, message_id: str) -> str:
    """ "Already completed" marker of a message id, kept ``completed_age_s``."""
    return f"{_root(queue_prefix)}:done:{message_id}"


def cron_last_tick(queue_prefix: str, job_name: str) -> str:
    """The latest tick of cron job ``job_name`` enqueued in this dataset
    (UTC epoch seconds); the scheduler's misfire catch-up starts after it."""
    return f"{_root(queue_prefix)}:cron:last:{job_name}"


def inflight(queue_prefix: str) -> str:
    """Hash: redis id of a message out with a worker -> ``"<deliveries>|<claimed ms>|<worker>"``
    (deliveries without an outcome count crashes; the run history reads running runs here)."""
    return f"{_root(queue_prefix)}:inflight"


def suspects(queue_prefix: str, queue_name: str) -> str:
    """List: redis ids of ``queue_name`` whose worker died while holding them, waiting to run
    alone."""
    return f"{_root(queue_prefix)}:suspects:{queue_name}"


def probe(queue_prefix: str) -> str:
    """Base of the keys the start-up permission probe writes and deletes at once."""
    return f"{_root(queue_prefix)}:probe"


def cancelled(queue_prefix: str, message_id: str) -> str:
    """Set by ``cancel`` for a delayed message a worker holds in memory: its move drops it."""
    return f"{_root(queue_prefix)}:cancel:{message_id}"


def paused(queue_prefix: str) -> str:
    """Set of the names of paused jobs."""
    return f"{_root(queue_prefix)}:paused"


def parked(queue_prefix: str, job_name: str) -> str:
    """List: redis ids of a paused job's messages, held back until it is resumed."""
    return f"{_root(queue_prefix)}:parked:{job_name}"


def process(queue_prefix: str, identity: str) -> str:
    """A live worker's or scheduler's registration (JSON, TTL: its heartbeat timeout)."""
    return f"{_root(queue_prefix)}:proc:{identity}"


def processes(queue_prefix: str) -> str:
    """Sorted set of registered process ids by last refresh (ms)."""
    return f"{_root(queue_prefix)}:procs"


def runs_by_status(queue_prefix: str, status: str) -> str:
    """Sorted set indexing the run records of one status (written in Lua, see
    :mod:`kumiko_dramatiq.history`; the metrics count it)."""
    return f"{_root(queue_prefix)}:runs:status:{status}"
