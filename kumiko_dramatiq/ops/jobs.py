"""The declared jobs as they stand (``kumiko jobs``, ``runner.jobs()``, ``runner.job_counts()``).

:meth:`JobsAdmin.jobs` gives each job's options, next and last cron fire, whether it is
paused and how full its caps are; :meth:`JobsAdmin.job_counts` its messages by state, from
the counts the scripts keep (``keys.queue_counts``), the parked lists and the runs in flight:
bounded by the declared jobs and the runs in flight, whatever the queues' size.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.counts import backfill_counts
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.cron import Cron
from kumiko_dramatiq.middleware.presence import live_processes
from kumiko_dramatiq.ops.admin_base import AdminBase
from kumiko_dramatiq.payloads import PayloadField, schema_fields
from kumiko_dramatiq.registry import JobDefinition


@dataclass(frozen=True)
class JobInfo:
    name: str
    lane: str
    trigger: str
    retries: int
    backoff: str | None
    per_tenant: bool
    concurrency: str
    run_on_boot: bool
    boot_gate: bool
    timeout_ms: int | None
    next_fire: datetime | None
    last_fire: datetime | None
    paused: bool
    #: the caps (``None``: none) and how full they are: slots held now, starts in the rate
    #: limit's window now (all tenants' windows together for a per-tenant one), messages
    #: waiting for them
    max_running: int | None = None
    rate_limit: str | None = None
    #: ``max_running_per_key`` (``None``: none) and the job's priority (0 runs first)
    max_running_per_key: int | None = None
    priority: int = 0
    running_slots: int = 0
    rate_window_starts: int = 0
    cap_waiting: int = 0
    #: A typed job's payload model (its class name) and the fields of its JSON schema;
    #: ``None`` for an untyped job (:mod:`kumiko_dramatiq.payloads`).
    payload_model: str | None = None
    payload_schema: list[PayloadField] | None = None

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        for name in ("next_fire", "last_fire"):
            value = out[name]
            out[name] = None if value is None else value.isoformat()
        if self.payload_schema is not None:
            out["payload_schema"] = [each.to_json() for each in self.payload_schema]
        return out


#: The states ``job_counts`` gives for each job.
COUNT_STATES = ("queued", "delayed", "running", "parked", "dead")


class JobsAdmin(AdminBase):
    """The declared jobs: their options and state, their message counts, their caps' fullness."""

    def backfill_counts(self) -> None:
        """Make the per-job counts of every lane queue exact over older data
        (:func:`~kumiko_dramatiq.broker.counts.backfill_counts`)."""
        for queue in self.lane_queues:
            backfill_counts(self.broker, queue)

    def job_counts(self) -> dict[str, dict[str, int]]:
        """Every declared job -> its messages queued (waiting for a slot too), delayed,
        running (claimed by a live worker), parked (held by a pause) and dead: the counts the
        scripts keep (``keys.queue_counts``), the parked lists and the runs in flight. Costs
        one hash per lane, two keys per job and the runs in flight, whatever the queues'
        size."""
        self.backfill_counts()
        jobs = list(self.registry.jobs)
        pipe = self.client.pipeline(transaction=False)
        for queue in self.lane_queues:
            pipe.hgetall(keys.queue_counts(queue))
        for job in jobs:
            pipe.llen(keys.parked(self.prefix, job))
            pipe.scard(keys.parked_withdrawn(self.prefix, job))
        replies = pipe.execute()
        out = {job: dict.fromkeys(COUNT_STATES, 0) for job in jobs}
        bodies = dict.fromkeys(jobs, 0)
        for counts in replies[: len(self.lane_queues)]:
            for name_field, value in counts.items():
                kind, _, actor = text(name_field).partition(":")
                found = self.registry.actor(actor)
                if found is None or kind not in ("q", "d", "x"):
                    continue
                name = found[0].qualified_name
                if kind == "q":
                    bodies[name] += int(value)
                else:
                    out[name]["delayed" if kind == "d" else "dead"] += int(value)
        parked = iter(replies[len(self.lane_queues) :])
        for job in jobs:
            out[job]["parked"] = max(0, int(next(parked)) - int(next(parked)))
        alive = {
            f"{process.host}:{process.pid}"
            for process in live_processes(self.client, self.prefix)
            if process.role == "worker"
        }
        for run in self.history.running():
            if run.job_name in out and run.worker in alive:
                out[run.job_name]["running"] += 1
        for job in jobs:
            counts = out[job]
            counts["queued"] = max(0, bodies[job] - counts["running"] - counts["parked"])
            counts["delayed"] = max(0, counts["delayed"])
            counts["dead"] = max(0, counts["dead"])
        return out

    def jobs(self, now: datetime | None = None) -> list[JobInfo]:
        now = datetime.now(UTC) if now is None else now
        declared = list(self.registry.jobs.values())
        paused = {text(job) for job in self.client.smembers(keys.paused(self.prefix))}
        cron_jobs = [job for job in declared if isinstance(job.options.trigger, Cron)]
        last = (
            self.client.mget(
                [keys.cron_last_tick(self.prefix, job.qualified_name) for job in cron_jobs]
            )
            if cron_jobs
            else []
        )
        last_by_job = dict(zip((j.qualified_name for j in cron_jobs), last, strict=True))
        fullness = self.caps_fullness()
        infos = []
        for job in declared:
            options = job.options
            trigger = options.trigger
            next_fire = trigger.next_fire_time(now) if isinstance(trigger, Cron) else None
            raw_last = last_by_job.get(job.qualified_name)
            model = job.payload_model
            infos.append(
                JobInfo(
                    name=job.qualified_name,
                    lane=options.run_in,
                    trigger=_describe_trigger(job),
                    retries=options.retries,
                    backoff=None
                    if options.backoff is None
                    else f"{options.backoff.type} {options.backoff.delay_ms} ms",
                    per_tenant=options.per_tenant,
                    concurrency=options.concurrency,
                    run_on_boot=options.run_on_boot,
                    boot_gate=options.boot_gate,
                    timeout_ms=options.timeout_ms,
                    next_fire=next_fire,
                    last_fire=None
                    if raw_last is None
                    else datetime.fromtimestamp(int(raw_last), UTC),
                    paused=job.qualified_name in paused,
                    payload_model=None if model is None else model.__name__,
                    payload_schema=None if model is None else schema_fields(model),
                    max_running=options.max_running,
                    max_running_per_key=options.max_running_per_key,
                    priority=options.priority,
                    rate_limit=None
                    if options.rate_limit is None
                    else (
                        f"{options.rate_limit.count} per {options.rate_limit.per_ms} ms"
                        + (" per tenant" if options.rate_limit.per_tenant else "")
                    ),
                    **fullness.get(job.qualified_name, {}),
                )
            )
        return infos

    def caps_fullness(self) -> dict[str, dict[str, int]]:
        """Per capped job: ``running_slots`` (live slot leases), ``rate_window_starts``
        (starts in its rate limit's window now; a per-tenant limit's tenant windows are not
        summed: 0) and ``cap_waiting`` (messages waiting for its caps). One round trip plus
        Redis's clock, bounded by the declared jobs."""
        capped = self.capped_jobs()
        if not capped:
            return {}
        now_s, now_us = self.client.time()
        now_ms = int(now_s) * 1000 + int(now_us) // 1000
        pipe = self.client.pipeline(transaction=False)
        for job in capped:
            pipe.zcount(keys.cap_slots(self.prefix, job.qualified_name), f"({now_ms}", "+inf")
            rate = job.options.rate_limit
            since = now_ms - (rate.per_ms if rate is not None else 0)
            pipe.zcount(
                keys.cap_rate(self.prefix, keys.cap_group(job.qualified_name, None)),
                f"({since}",
                "+inf",
            )
        pipe.hgetall(keys.cap_waits(self.prefix))
        *counts, waits = pipe.execute()
        waiting = {text(name): max(0, int(count)) for name, count in waits.items()}
        return {
            job.qualified_name: {
                "running_slots": int(counts[2 * i]),
                "rate_window_starts": int(counts[2 * i + 1]),
                "cap_waiting": waiting.get(job.qualified_name, 0),
            }
            for i, job in enumerate(capped)
        }


def _describe_trigger(job: JobDefinition) -> str:
    trigger = job.options.trigger
    if isinstance(trigger, Cron):
        return f"cron {trigger.expr} {trigger.timezone}"
    name = getattr(trigger, "name", None)
    return f"event {name}" if name else "manual"
