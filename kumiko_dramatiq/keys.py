"""Every Redis key kumiko writes, one function each, all under ``kumiko:{queue_prefix}:``.

A dataset is one Redis database plus one queue prefix: runners with
different prefixes never touch each other's keys. Dramatiq's own keys
(``dramatiq:{queue}``, ``dramatiq:{queue}.msgs``, ``.DQ``, ``.XQ``) are
built by :func:`queue_list` and :func:`queue_messages` only.
"""

from __future__ import annotations

DRAMATIQ_NAMESPACE = "dramatiq"


def _root(queue_prefix: str) -> str:
    return f"kumiko:{queue_prefix}"


def queue_list(queue_name: str, namespace: str = DRAMATIQ_NAMESPACE) -> str:
    """Dramatiq's list of redis message ids of ``queue_name``."""
    return f"{namespace}:{queue_name}"


def queue_messages(queue_name: str, namespace: str = DRAMATIQ_NAMESPACE) -> str:
    """Dramatiq's hash of redis message id -> encoded message of ``queue_name``."""
    return f"{namespace}:{queue_name}.msgs"


def consumer_acks(worker_id: str, queue_name: str, namespace: str = DRAMATIQ_NAMESPACE) -> str:
    """Dramatiq's set of fetched-but-unacked redis message ids of one worker and queue."""
    return f"{namespace}:__acks__.{worker_id}.{queue_name}"


def heartbeats(namespace: str = DRAMATIQ_NAMESPACE) -> str:
    """Dramatiq's sorted set of worker ids by last heartbeat."""
    return f"{namespace}:__heartbeats__"


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
