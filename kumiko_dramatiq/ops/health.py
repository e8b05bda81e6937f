"""The problems ``runner.status()`` reports: what an operator must look at now.

Each problem is one line, and the list is empty when the dataset is healthy (``kumiko status
--check`` exits 1 when it is not, for a cron job or a probe). :func:`problems` is pure; its
inputs come from :func:`read_health` (one round trip of two reads beside the liveness listing
``status()`` makes anyway). The problems, in order:

- a live worker (or scheduler) that cannot refresh its liveness (its record is older than
  :func:`~kumiko_dramatiq.middleware.presence.stale_after_ms`: it does not reach Redis, or is
  stuck); one presumed dead (its record expired) is forgotten, not a problem for ever;
- a worker reporting a consumer thread down (ended and being restarted, or stuck);
- a Redis whose ``maxmemory-policy`` is not ``noeviction`` (it may evict any key);
- a dataset reset under running workers (the note a process left on finding the dataset
  marker gone: :mod:`kumiko_dramatiq.middleware.presence`), for an hour after it;
- cron jobs declared and no live scheduler (no tick is enqueued).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

import redis

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.cron import Cron
from kumiko_dramatiq.middleware.presence import ProcessInfo, eviction_problem
from kumiko_dramatiq.registry import Registry
from kumiko_dramatiq.shards.routing import pinned_shard


@dataclass(frozen=True)
class HealthReading:
    """What :func:`problems` needs from Redis beside the live processes."""

    #: Redis's ``maxmemory-policy`` (``None``: this user may not read it)
    eviction_policy: str | None
    #: when a running process found the dataset reset, and which (``None``: no note)
    reset_at: datetime | None
    reset_by: str


def read_health(client: redis.Redis, queue_prefix: str) -> HealthReading:
    """Read the eviction policy and the dataset-reset note (one pipelined round trip)."""
    pipe = client.pipeline(transaction=False)
    pipe.info("memory")
    pipe.get(keys.dataset_reset(queue_prefix))
    info, note = pipe.execute(raise_on_error=False)
    policy = None
    if isinstance(info, dict):
        policy = str(info.get("maxmemory_policy", "noeviction"))
    elif isinstance(info, Exception) and not isinstance(
        info, redis.exceptions.NoPermissionError | redis.ResponseError
    ):
        raise info
    if isinstance(note, Exception):
        raise note
    reset_at, reset_by = None, ""
    if note is not None:
        try:
            data = json.loads(text(note))
            reset_at = datetime.fromtimestamp(int(data["at"]) / 1000, UTC)
            reset_by = str(data.get("by", ""))
        except (ValueError, KeyError, TypeError):
            reset_at = datetime.now(UTC)
    return HealthReading(policy, reset_at, reset_by)


def problems(
    reading: HealthReading,
    registry: Registry,
    workers: list[ProcessInfo],
    schedulers: list[ProcessInfo],
    now: datetime,
    shard: tuple[int, int] = (0, 1),
) -> list[str]:
    """The problems of a dataset, one line each (empty: healthy); ``shard``: (which, of how
    many) when it is a shard of one (it then counts the cron jobs that live in it). Pure."""
    found: list[str] = []
    for process in [*workers, *schedulers]:
        name = f"{process.role} {process.host}:{process.pid}"
        if process.lane is not None:
            name += f" ({process.lane})"
        if process.stale:
            quiet_s = int((now - process.last_seen).total_seconds())
            found.append(
                f"{name} has not refreshed its liveness for {quiet_s} s: it does not reach "
                "Redis, or it is stuck"
            )
        for issue in process.issues:
            found.append(f"{name}: {issue}")
        if process.consumers_down and not process.issues:
            found.append(f"{name}: {process.consumers_down} consumer(s) down")
    if reading.eviction_policy is not None:
        eviction = eviction_problem(reading.eviction_policy)
        if eviction is not None:
            found.append(eviction)
    if reading.reset_at is not None:
        by = f" (found by {reading.reset_by})" if reading.reset_by else ""
        found.append(
            f"the dataset was reset at {reading.reset_at.isoformat(timespec='seconds')}"
            f"{by}: Redis restarted without persistence or was flushed under running "
            "workers; delayed messages, backoffs, locks, dedup keys and run records written "
            "before were lost"
        )
    cron_jobs = [
        name
        for name, job in registry.jobs.items()
        if isinstance(job.options.trigger, Cron) and pinned_shard(job, shard[1]) == shard[0]
    ]
    if cron_jobs and not schedulers:
        found.append(
            f"{len(cron_jobs)} cron job(s) declared but no scheduler is alive: no tick is "
            "enqueued; run kumiko-scheduler (or a runner with run_scheduler=True)"
        )
    return found
