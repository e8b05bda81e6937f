"""Per-job hourly stats: attempts by outcome and completed durations, kept 7 days.

Written by the same Lua calls that write the run records, at a fixed small cost per attempt
(``put_run`` and ``flush_runs`` in ``lua/include/history.lua``): per job and hour (by the
attempt's end, UTC), one hash ``keys.job_stats(prefix, job, hour)`` of counters,
``failed`` (the attempt failed and a retry follows), ``dead`` and ``cancelled``, and for each
completed attempt one count: ``c<bucket>`` by its duration (:func:`bucket`: exact below 64 ms,
then buckets 10% wide, so a percentile read back is within 5%), or ``completed`` if it has
none; the hour's completed attempts are their sum. (Writers before that layout counted a
completed attempt twice, in ``completed`` and in ``b<bucket>``: such fields are read as
they are, the two layouts add up.) One ``HINCRBY`` per counter per settle call (a batch of
attempts); the hash's TTL is set to 8 days whenever a
count creates a field (the hour's first count always does), so it lives 8 days from its hour. A
record written again (a settle retried after a lost reply) counts nothing twice. Reading is
one ``HGETALL`` per job and hour asked for, in one round trip: no run-history scan.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import redis

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.replies import text

#: How many hours back the stats go (the hashes live 8 days).
MAX_HOURS: Final = 168
#: Durations below this many ms have a bucket each.
EXACT_BUCKETS: Final = 64
#: Above them, each bucket is this much wider than the one before.
STEP: Final = 1.1
#: The outcome counters of a stats hash.
OUTCOMES: Final = ("completed", "failed", "dead", "cancelled")


@dataclass(frozen=True)
class JobStats:
    """One job's attempts in one hour (UTC): counts by outcome, completed durations."""

    job_name: str
    #: the start of the hour (aware UTC)
    hour: datetime
    completed: int
    #: attempts that failed and were retried
    failed: int
    dead: int
    cancelled: int
    #: over completed attempts, within 5%; None when none completed
    p50_ms: int | None
    p95_ms: int | None

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "hour": self.hour.isoformat()}


def bucket(duration_ms: int) -> int:
    """The bucket of a duration, as the Lua writer computes it."""
    if duration_ms < EXACT_BUCKETS:
        return duration_ms
    return EXACT_BUCKETS + math.floor(math.log(duration_ms / EXACT_BUCKETS) / math.log(STEP))


def bucket_value(index: int) -> float:
    """The duration a bucket stands for: itself below 64 ms, else its geometric middle."""
    if index < EXACT_BUCKETS:
        return float(index)
    return float(EXACT_BUCKETS * STEP ** (index - EXACT_BUCKETS + 0.5))


def percentile(buckets: dict[int, int], q: float) -> int | None:
    """The ``q`` quantile (0-1) of the durations counted in ``buckets``, or None."""
    total = sum(buckets.values())
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for index in sorted(buckets):
        seen += buckets[index]
        if seen >= rank:
            return round(bucket_value(index))
    return None  # pragma: no cover - the ranks add up to total


def read_stats(
    client: redis.Redis, queue_prefix: str, jobs: Sequence[str], hours: int, now: datetime
) -> list[JobStats]:
    """The stats of ``jobs`` over the last ``hours`` hours (the current one included), newest
    hour first, then by job name; hours with no attempt left out."""
    return read_stats_over([(client, queue_prefix)], jobs, hours, now)


def read_stats_over(
    sources: Sequence[tuple[redis.Redis, str]], jobs: Sequence[str], hours: int, now: datetime
) -> list[JobStats]:
    """:func:`read_stats` over several datasets at once (the shards of one: their counts and
    duration buckets add up before the percentiles are taken), one round trip each."""
    current = int(now.timestamp() // 3600)
    wanted = [(hour, job) for hour in range(current, current - hours, -1) for job in sorted(jobs)]
    fields: list[list[tuple[Any, Any]]] = [[] for _ in wanted]
    for client, queue_prefix in sources:
        pipe = client.pipeline(transaction=False)
        for hour, job in wanted:
            pipe.hgetall(keys.job_stats(queue_prefix, job, hour))
        for found, raw in zip(fields, pipe.execute(), strict=True):
            found += raw.items()
    out = []
    for (hour, job), found in zip(wanted, fields, strict=True):
        stats = _decode(job, hour, found)
        if stats is not None:
            out.append(stats)
    return out


def _decode(job: str, hour: int, fields: Iterable[tuple[Any, Any]]) -> JobStats | None:
    counts = dict.fromkeys(OUTCOMES, 0)
    buckets: dict[int, int] = {}
    for raw_field, raw_value in fields:
        field, value = text(raw_field), int(raw_value)
        if field in counts:
            counts[field] += value
        elif field[:1] in ("b", "c") and field[1:].isdigit():
            # "c": a completed attempt counted here only; "b": an older writer's, counted in
            # "completed" too
            found = int(field[1:])
            buckets[found] = buckets.get(found, 0) + value
            if field[0] == "c":
                counts["completed"] += value
    if not any(counts.values()):
        return None
    return JobStats(
        job_name=job,
        hour=datetime.fromtimestamp(hour * 3600, UTC),
        completed=counts["completed"],
        failed=counts["failed"],
        dead=counts["dead"],
        cancelled=counts["cancelled"],
        p50_ms=percentile(buckets, 0.50),
        p95_ms=percentile(buckets, 0.95),
    )
