"""Operating a dataset: what is queued, dead, locked, keyed, paused and alive, and actions on it.

:class:`Admin` answers the ``kumiko`` command, the dashboard and ``JobRunner``'s admin
methods (``status``, ``dead_letters``, ``retry_dead``, ``cancel``, ``pause``, ``resume``,
plus ``jobs``, ``locks`` and ``dedup_keys``). Every read and action costs Redis work bounded
by its page or its message, never by the size of the keyspace or of a queue: a status is two
pipelined round trips plus the liveness listing; dead letters are read a page at a time
(``dead_letter_page``); locks and live dedup keys are read off the indexes their Lua scripts
keep (``locks``: ``keys.locks_index``; ``dedup_page``: ``keys.dedup_index``); a message is
found by the few redis ids kumiko derives from its id (``redis_id_candidates``, used by
``cancel``, ``waiting_state`` and ``retry_dead``); an id prefix is looked up among the newest
run records (``ids_starting_with``). Every action that changes more than one key is one Lua
call, so it is all-or-nothing (``retry_all_dead`` is one such retry per letter, ``resume``
one call per :data:`RESUME_STEP` parked messages):

- **retry** (``lua/retry_dead.lua``): the dead letter leaves the dead letters and a new
  message is enqueued in one step, with a fresh attempt budget, a new message id, the
  original origin id (the id the caller first got back) and, for a per-tenant child, its
  tenant; the dedup key is not carried (the key's job ended when it died);
- **cancel** (``lua/cancel.lua``): a queued, delayed, backing-off, parked or waiting message
  never starts (its body is deleted and its redis id noted as withdrawn, so the fetch that
  meets it drops it: no search of the list); one held in a worker's memory until due is
  dropped by its move; a running one is not interrupted, nor one that ended (``False``,
  nothing changed);
- **pause** (``keys.paused``): a paused job's messages are not fetched but parked
  (``keys.parked``) when a fetch meets them: kept, never run, no busy loop, on every worker;
  **resume** (``lua/resume.lua``) puts them back at the head of their queue. Cron ticks parked
  meanwhile follow the job's misfire policy: ``coalesce`` runs the latest one, ``skip`` none.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import redis
from dramatiq.common import dq_name
from dramatiq.message import Message, generate_unique_id

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.broker.counts import backfill_counts
from kumiko_dramatiq.broker.enqueueing import moved_redis_id
from kumiko_dramatiq.broker.holds import new_request_id
from kumiko_dramatiq.broker.keys import (
    consumer_acks,
    dead_letter_messages,
    dead_letters,
    heartbeats,
    queue_list,
    queue_messages,
)
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.codec import (
    DEDUP_KEY,
    FAILURES,
    ORIGIN_ID,
    TENANT_ID,
    TRIGGER,
    KumikoOptions,
    OptionsError,
)
from kumiko_dramatiq.cron import Cron
from kumiko_dramatiq.ids import redis_id_candidates
from kumiko_dramatiq.middleware.presence import ProcessInfo, live_processes
from kumiko_dramatiq.ops.asking import Ask, Asking
from kumiko_dramatiq.ops.health import problems, read_health
from kumiko_dramatiq.ops.history import STATUSES, JobRun, RunHistory, is_held_entry, run_ttls_ms
from kumiko_dramatiq.ops.waiting import QueuedMessage, Waiting
from kumiko_dramatiq.options import LANES, lane_queue
from kumiko_dramatiq.payloads import PayloadField, schema_fields
from kumiko_dramatiq.registry import JobDefinition, Registry
from kumiko_dramatiq.settings import Settings

logger = logging.getLogger("kumiko_dramatiq")


@dataclass(frozen=True)
class LaneStatus:
    """Message counts of one lane: waiting, waiting out a delay or backoff, claimed by a
    worker (running), dead-lettered, and held back because their job is paused."""

    lane: str
    queue: str
    queued: int
    delayed: int
    running: int
    dead: int
    parked: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Status:
    lanes: list[LaneStatus]
    workers: list[ProcessInfo]
    schedulers: list[ProcessInfo]
    paused: list[str]
    #: what an operator must look at, one line each; empty when healthy
    #: (:mod:`kumiko_dramatiq.ops.health`)
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "lanes": [lane.to_json() for lane in self.lanes],
            "workers": [worker.to_json() for worker in self.workers],
            "schedulers": [scheduler.to_json() for scheduler in self.schedulers],
            "paused": self.paused,
            "problems": self.problems,
        }


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


@dataclass(frozen=True)
class DeadLetter:
    message_id: str
    job_name: str
    queue: str
    redis_message_id: str
    dead_at: datetime
    attempts: int | None
    tenant_id: str | None
    origin_id: str | None
    error_type: str | None
    error_message: str | None
    traceback: str | None

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["dead_at"] = self.dead_at.isoformat()
        return out


@dataclass(frozen=True)
class LockInfo:
    """A held sequential lock: its job and tenant, the run holding it (``message_id``, its
    ``origin_id`` and ``worker``, from the runs in flight), the time left on its lease, when
    it was taken, and whether its holder's worker is alive (``False`` also when no run in
    flight holds it: the lock only waits out its lease)."""

    job_name: str
    tenant_id: str | None
    message_id: str
    origin_id: str | None
    worker: str | None
    expires_in_ms: int
    held_since: datetime | None = None
    worker_alive: bool = True
    #: ``"lock"`` (a sequential lock) or ``"slot"`` (one of a ``max_running`` job's slots)
    kind: str = "lock"

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["held_since"] = None if self.held_since is None else self.held_since.isoformat()
        return out


@dataclass(frozen=True)
class DedupInfo:
    job_name: str
    dedup_key: str
    message_id: str
    state: str
    follow_up_id: str | None
    expires_in_ms: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class BootMarker:
    """A ``run_on_boot`` job and its boot marker: the fixed message id of its boot run, or
    ``None`` when unset (the next worker start of its lane enqueues it)."""

    job_name: str
    lane: str
    message_id: str | None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


#: A position in the dead letters, newest first: (dead-letter time in epoch ms, redis id).
DeadCursor = tuple[float, str]
#: A position in the live dedup keys: (job, the record's expiry in epoch ms, how many keys of
#: that job with that very expiry were listed already). Keys are listed by job, then newest
#: expiry first.
DedupCursor = tuple[str, float, int]
#: How many pages :meth:`Admin.dead_letters` reads at most (each bounded, see
#: :meth:`Admin.dead_letter_page`).
DEAD_LIST_PAGES = 20
#: Parked ids resume moves back to their queue per Lua call (about a millisecond of Redis).
RESUME_STEP = 1_000
#: Entries one purge step reads at most (``lua/purge_step.lua``), and bytes of message bodies
#: (it stops once the bodies it read reach them): 0.2 to 0.7 ms of Redis per step, median,
#: whatever the messages' size (``benchmarks/purge.py``).
PURGE_STEP = 25
PURGE_STEP_BYTES = 65_536
#: The states ``purge`` takes, and what it walks for each (``lua/purge_step.lua``'s modes).
PURGE_WALKS: dict[str, tuple[str, ...]] = {
    # queued: the queue's list and suspects, then the lists of those waiting for a cap
    "queued": ("queued", "suspects", "capwait"),
    "delayed": ("delayed",),
    "parked": ("parked",),
    "dead": ("dead",),
}


def purge_scan_count(count: int, spent: int, read: int) -> int:
    """The ``COUNT`` of a purge step's next ``HSCAN`` after one of ``count`` that read
    ``read`` bodies of ``spent`` bytes in all: as many bodies of that average size as fit
    :data:`PURGE_STEP_BYTES`, from 1 to :data:`PURGE_STEP` (``count`` again when it read
    none). A walk starts at 1: the first step learns the bodies' size from one body."""
    if read <= 0:
        return count
    return max(1, min(PURGE_STEP, PURGE_STEP_BYTES * read // max(1, spent)))


#: How many times ``cancel`` looks again for a message its holder no longer had (settled, or
#: back on its queue) before it says it runs.
CANCEL_ROUNDS = 3
#: The states ``job_counts`` gives for each job.
COUNT_STATES = ("queued", "delayed", "running", "parked", "dead")
#: How many of the newest run records of each status, and of the newest dead letters of each
#: lane, an id prefix is looked up among (:meth:`Admin.ids_starting_with`).
PREFIX_WINDOW = 1_000


class Admin:
    """The admin API over one dataset (``broker``'s Redis and queue prefix)."""

    def __init__(self, broker: KumikoBroker, registry: Registry, settings: Settings) -> None:
        self.broker = broker
        self.registry = registry
        self.settings = settings
        self.client: redis.Redis = broker.client
        self.prefix = settings.queue_prefix
        self.history = RunHistory(broker.client, broker.lua, self.prefix)

    @property
    def lane_queues(self) -> list[str]:
        return [lane_queue(self.prefix, lane) for lane in LANES]

    # -- reads ---------------------------------------------------------------------------
    def status(self) -> Status:
        """Per lane: queued (its list and suspects, less the ids cancel withdrew, and what the
        workers hold ahead of their threads), delayed, running (in the live workers' ack sets,
        started), dead, and parked (every declared job's
        parked messages, a paused one's or what a resume cut short left); live processes;
        paused jobs. Two round trips plus the liveness listing, whatever the dataset's size."""
        processes = live_processes(self.client, self.prefix)
        workers = [p for p in processes if p.role == "worker"]
        paused = sorted(text(job) for job in self.client.smembers(keys.paused(self.prefix)))
        pipe = self.client.pipeline(transaction=False)
        worker_ids = [text(w) for w in self.client.zrange(heartbeats(), 0, -1)]
        for queue in self.lane_queues:
            pipe.llen(queue_list(queue))
            pipe.llen(keys.suspects(self.prefix, queue))
            pipe.scard(keys.queue_withdrawn(queue))
            pipe.hlen(queue_messages(dq_name(queue)))
            pipe.zcard(dead_letters(queue))
            for worker in worker_ids:
                pipe.smembers(consumer_acks(worker, queue))
        # every job's parked list: a paused job's, and what a resume cut short left behind
        held = sorted(set(paused) | set(self.registry.jobs))
        for job in held:
            pipe.llen(keys.parked(self.prefix, job))
            pipe.scard(keys.parked_withdrawn(self.prefix, job))
        pipe.hgetall(keys.cap_waits(self.prefix))
        *counts, cap_waits = pipe.execute()
        replies = iter(counts)
        # messages waiting for a cap (max_running, rate_limit) are queued, on their job's lane
        capped_by_lane: dict[str, int] = {}
        for job_name, count in cap_waits.items():
            declared = self.registry.jobs.get(text(job_name))
            lane_name = "worker" if declared is None else declared.options.run_in
            capped_by_lane[lane_name] = capped_by_lane.get(lane_name, 0) + max(0, int(count))
        lanes = []
        for lane, queue in zip(LANES, self.lane_queues, strict=True):
            # ids cancel withdrew stay in the lists until a fetch meets them: not counted
            listed = int(next(replies)) + int(next(replies)) + capped_by_lane.get(lane, 0)
            queued = max(0, listed - int(next(replies)))
            delayed = int(next(replies))
            dead = int(next(replies))
            claimed = [text(rid) for _ in worker_ids for rid in next(replies)]
            # a message a worker holds ahead of its threads has not started: it is queued
            ahead = self._held_among(claimed)
            running = len(claimed) - ahead
            lanes.append(LaneStatus(lane, queue, queued + ahead, delayed, running, dead, 0))
        parked_by_job = {job: max(0, int(next(replies)) - int(next(replies))) for job in held}
        lanes = [
            LaneStatus(
                **{
                    **lane.__dict__,
                    "parked": sum(
                        count
                        for job, count in parked_by_job.items()
                        if job in self.registry.jobs
                        and self.registry.jobs[job].options.run_in == lane.lane
                    ),
                }
            )
            for lane in lanes
        ]
        schedulers = [p for p in processes if p.role == "scheduler"]
        return Status(
            lanes=lanes,
            workers=workers,
            schedulers=schedulers,
            paused=paused,
            problems=self.problems(workers, schedulers),
        )

    def _held_among(self, rids: list[str]) -> int:
        """How many of the claimed ``rids`` are held, not started (their in-flight entries;
        bounded by what the workers claim, twice their threads each)."""
        if not rids:
            return 0
        entries = self.client.hmget(keys.inflight(self.prefix), rids)
        return sum(1 for entry in entries if entry is not None and is_held_entry(entry))

    def current_problems(self) -> list[str]:
        """:attr:`Status.problems` alone (the liveness listing and two reads), for the
        dashboard's banner on every page."""
        processes = live_processes(self.client, self.prefix)
        return self.problems(
            [p for p in processes if p.role == "worker"],
            [p for p in processes if p.role == "scheduler"],
        )

    def problems(self, workers: list[ProcessInfo], schedulers: list[ProcessInfo]) -> list[str]:
        """The dataset's problems (:mod:`kumiko_dramatiq.ops.health`), one line each."""
        reading = read_health(self.client, self.prefix)
        return problems(reading, self.registry, workers, schedulers, datetime.now(UTC))

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

    def capped_jobs(self) -> list[JobDefinition]:
        """The declared jobs with a cap (``max_running`` or ``rate_limit``)."""
        return [job for job in self.registry.jobs.values() if job.is_capped]

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

    def dead_letters(self, job: str | None = None, *, limit: int = 100) -> list[DeadLetter]:
        """Dead-lettered kumiko messages, newest first, with their last error: the first
        ``limit`` (``job``'s only, when given), read a page at a time
        (:meth:`dead_letter_page`), at most :data:`DEAD_LIST_PAGES` pages."""
        found: list[DeadLetter] = []
        cursor: DeadCursor | None = None
        for _ in range(DEAD_LIST_PAGES):
            page, cursor = self.dead_letter_page(job, after=cursor, limit=limit - len(found))
            found += page
            if cursor is None or len(found) >= limit:
                break
        return found[:limit]

    def _dead_letter(
        self, queue: str, rid: str, score: float, body: Any, *, read_note: bool = True
    ) -> DeadLetter | None:
        if body is None:
            return None
        try:
            message = Message.decode(body)
        except Exception:
            message = None
        message_id = rid if message is None else str(message.message_id)
        actor = "?" if message is None else str(message.actor_name)
        entry = self.registry.actor(actor)
        job_name = entry[0].qualified_name if entry is not None else actor
        options: KumikoOptions | None = None
        if message is not None and isinstance(message.options, dict):
            try:
                options = KumikoOptions.decode(message.options)
            except OptionsError:
                options = None
        note = self.history.dead_note(message_id) if message is not None and read_note else None
        return DeadLetter(
            message_id=message_id,
            job_name=job_name,
            queue=queue,
            redis_message_id=rid,
            dead_at=datetime.fromtimestamp(score / 1000, UTC),
            attempts=None if note is None else note.get("a"),
            tenant_id=None if options is None else options.tenant_id,
            origin_id=(None if options is None else options.origin_id) or message_id,
            error_type=None if note is None else note.get("et"),
            error_message=None if note is None else note.get("em"),
            traceback=None if note is None else note.get("tb"),
        )

    def dead_letter_page(
        self,
        job: str | None = None,
        *,
        after: DeadCursor | None = None,
        limit: int = 50,
        max_read: int = 5_000,
        notes: bool = True,
    ) -> tuple[list[DeadLetter], DeadCursor | None]:
        """One page of dead letters, newest first, starting just after ``after``: at most
        ``limit`` of them (only ``job``'s when given), and the cursor of the next page
        (``None`` at the end). Each lane's dead letters are read newest first, a batch at a
        time (``ZREVRANGEBYSCORE ... LIMIT``, never the whole set), at most ``max_read``
        entries per lane and call, so a job whose letters are rare among many may take
        several pages, some of them empty. Pages are ordered by (time, redis id): they neither
        repeat nor skip a letter, however many share a millisecond. With ``notes`` each letter
        carries its last error (one more round trip for the page)."""
        found: list[tuple[DeadCursor, DeadLetter]] = []
        floors: list[DeadCursor] = []
        for queue in self.lane_queues:
            matched, floor = self._read_dead(queue, job, after, limit, max_read)
            found += matched
            if floor is not None:
                floors.append(floor)
        # A lane that stopped early has unread letters below its floor, which may outrank
        # what other lanes found there: keep only what is complete.
        floor = max(floors, default=None)
        found.sort(key=lambda item: item[0], reverse=True)
        if floor is not None:
            found = [item for item in found if item[0] >= floor]
        page = found[:limit]
        next_cursor: DeadCursor | None = None
        if len(found) > limit or (page and len(found) == limit and floor is not None):
            next_cursor = page[-1][0]
        elif floor is not None:
            next_cursor = floor
        letters = [letter for _, letter in page]
        return (self._with_notes(letters) if notes else letters), next_cursor

    def _read_dead(
        self, queue: str, job: str | None, after: DeadCursor | None, limit: int, max_read: int
    ) -> tuple[list[tuple[DeadCursor, DeadLetter]], DeadCursor | None]:
        """``queue``'s dead letters (``job``'s) after ``after``, newest first, until ``limit``
        match or ``max_read`` were read; and the last entry read when more remain."""
        batch = limit if job is None else max(limit, min(200, max_read))
        high: float | str = "+inf" if after is None else after[0]
        offset = 0
        matched: list[tuple[DeadCursor, DeadLetter]] = []
        while True:
            entries: list[tuple[Any, float]] = self.client.zrevrangebyscore(  # type: ignore[assignment]
                dead_letters(queue), high, "-inf", start=offset, num=batch, withscores=True
            )
            offset += len(entries)
            fresh = [(float(score), text(rid)) for rid, score in entries]
            fresh = [key for key in fresh if after is None or key < after]
            if fresh:
                bodies = self.client.hmget(dead_letter_messages(queue), [rid for _, rid in fresh])
                for key, body in zip(fresh, bodies, strict=True):
                    letter = self._dead_letter(queue, key[1], key[0], body, read_note=False)
                    if letter is not None and (job is None or letter.job_name == job):
                        matched.append((key, letter))
            if len(entries) < batch:
                return matched, None
            # stop early only past the cursor (a read of nothing but entries at or above it,
            # ties of its score, must go on, or the next page would start at the same place)
            if len(matched) >= limit or (offset >= max_read and fresh):
                return matched, (float(entries[-1][1]), text(entries[-1][0]))

    def _with_notes(self, letters: Sequence[DeadLetter]) -> list[DeadLetter]:
        """``letters`` with their last error from their dead letter notes (one round trip)."""
        if not letters:
            return []
        pipe = self.client.pipeline(transaction=False)
        for letter in letters:
            pipe.get(keys.dead_note(self.prefix, letter.message_id))
        out = []
        for letter, raw in zip(letters, pipe.execute(), strict=True):
            note = None if raw is None else json.loads(raw)
            out.append(
                letter
                if not isinstance(note, dict)
                else replace(
                    letter,
                    attempts=note.get("a"),
                    error_type=note.get("et"),
                    error_message=note.get("em"),
                    traceback=note.get("tb"),
                )
            )
        return out

    def boot_markers(self) -> list[BootMarker]:
        """Every ``run_on_boot`` job with its boot marker (one ``MGET``)."""
        jobs = [job for job in self.registry.jobs.values() if job.options.run_on_boot]
        if not jobs:
            return []
        values = self.client.mget([keys.boot_marker(self.prefix, j.qualified_name) for j in jobs])
        return [
            BootMarker(job.qualified_name, job.options.run_in, None if v is None else text(v))
            for job, v in zip(jobs, values, strict=True)
        ]

    def locks(self, *, limit: int = 1_000) -> list[LockInfo]:
        """Held sequential locks (at most ``limit``), by job and tenant: read off the index
        the lock scripts keep (``keys.locks_index``; a lease that ran out is not listed),
        each checked against its lock's key, with its holder from the runs in flight and
        whether that holder's worker is alive. Cost: the page, the runs in flight and the
        live processes, whatever the size of the keyspace."""
        slots = self.slot_holders(limit=limit)
        now_ms = int(datetime.now(UTC).timestamp() * 1000)
        names = [
            text(name)
            for name in self.client.zrevrangebyscore(
                keys.locks_index(self.prefix), "+inf", f"({now_ms}", start=0, num=limit
            )
        ]
        if not names:
            return slots
        lock_root = keys.sequential_lock(self.prefix, "", None)
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.get(lock_root + name)
            pipe.pttl(lock_root + name)
        pipe.hmget(keys.locks_since(self.prefix), names)
        *pairs, since = pipe.execute()
        running = {run.message_id: run for run in self.history.running()}
        alive = {
            f"{process.host}:{process.pid}"
            for process in live_processes(self.client, self.prefix)
            if process.role == "worker"
        }
        found = []
        for i, name in enumerate(names):
            token, ttl = pairs[2 * i], pairs[2 * i + 1]
            if token is None or int(ttl) < 0:
                continue  # released or run out since the index was read
            job_name, tenant = keys.parse_sequential_lock(self.prefix, lock_root + name)
            message_id = text(token).split(":", 1)[0]
            holder = running.get(message_id)
            worker = None if holder is None else holder.worker
            found.append(
                LockInfo(
                    job_name=job_name,
                    tenant_id=tenant,
                    message_id=message_id,
                    origin_id=None if holder is None else holder.origin_id,
                    worker=worker,
                    expires_in_ms=int(ttl),
                    held_since=None
                    if since[i] is None
                    else datetime.fromtimestamp(int(since[i]) / 1000, UTC),
                    worker_alive=worker is not None and worker in alive,
                )
            )
        found = sorted(found, key=lambda lock: (lock.job_name, lock.tenant_id or ""))
        return found + slots[: max(0, limit - len(found))]

    def slot_holders(self, *, limit: int = 1_000) -> list[LockInfo]:
        """The live slots of ``max_running`` jobs (at most ``limit``), as :class:`LockInfo`
        of kind ``"slot"``: the run holding each (read off its message and the in-flight
        hash), the time left on its lease and whether its worker is alive. Bounded by the
        declared jobs and ``limit``."""
        capped = [job for job in self.capped_jobs() if job.options.max_running is not None]
        if not capped:
            return []
        now_s, now_us = self.client.time()
        now_ms = int(now_s) * 1000 + int(now_us) // 1000
        pipe = self.client.pipeline(transaction=False)
        for job in capped:
            pipe.zrangebyscore(
                keys.cap_slots(self.prefix, job.qualified_name),
                f"({now_ms}",
                "+inf",
                start=0,
                num=limit,
                withscores=True,
            )
        held = [
            (job, text(token), int(expiry))
            for job, reply in zip(capped, pipe.execute(), strict=True)
            for token, expiry in reply
        ][:limit]
        if not held:
            return []
        rids = [token.rpartition("#")[0] for _, token, _ in held]
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(keys.inflight(self.prefix), rids)
        for (job, _, _), rid in zip(held, rids, strict=True):
            pipe.hget(queue_messages(job.queue_name(self.prefix)), rid)
        entries, *bodies = pipe.execute()
        alive = {
            f"{process.host}:{process.pid}"
            for process in live_processes(self.client, self.prefix)
            if process.role == "worker"
        }
        found = []
        for (job, token, expiry), entry, body in zip(held, entries, bodies, strict=True):
            message_id, origin_id, tenant = token, None, None
            try:
                message = json.loads(body) if body is not None else None
            except ValueError:
                message = None
            if isinstance(message, dict):
                message_id = str(message.get("message_id") or token)
                options = message.get("options")
                if isinstance(options, dict):
                    origin_id = options.get(ORIGIN_ID) or message_id
                    tenant = options.get(TENANT_ID)
            claimed = text(entry).split("|", 2) if entry is not None else []
            worker = claimed[2] if len(claimed) == 3 else None
            since = (
                datetime.fromtimestamp(int(claimed[1]) / 1000, UTC)
                if len(claimed) == 3 and claimed[1].isdigit()
                else None
            )
            found.append(
                LockInfo(
                    job_name=job.qualified_name,
                    tenant_id=tenant if isinstance(tenant, str) else None,
                    message_id=message_id,
                    origin_id=origin_id if isinstance(origin_id, str) else None,
                    worker=worker,
                    expires_in_ms=max(0, expiry - now_ms),
                    held_since=since,
                    worker_alive=worker is not None and worker in alive,
                    kind="slot",
                )
            )
        return found

    def dedup_page(
        self, job: str | None = None, *, after: DedupCursor | None = None, limit: int = 100
    ) -> tuple[list[DedupInfo], DedupCursor | None]:
        """Live dedup keys, by job (``job``'s alone when given), newest expiry first, starting
        just after ``after``: at most ``limit`` of them, and the cursor of the next page
        (``None`` when no more exist). Read off each job's index (``keys.dedup_index``, kept
        by the dedup scripts; a record that expired is never listed), then the records: a few
        round trips, whatever the size of the keyspace or of the index."""
        now_ms = int(datetime.now(UTC).timestamp() * 1000)
        live = f"({now_ms}"
        jobs = sorted(self.registry.jobs) if job is None else [job]
        if after is not None:
            jobs = [name for name in jobs if name >= after[0]]
        # the jobs with live keys at all: one ZCOUNT each, one round trip
        pipe = self.client.pipeline(transaction=False)
        for name in jobs:
            pipe.zcount(keys.dedup_index(self.prefix, name), live, "+inf")
        jobs = [name for name, count in zip(jobs, pipe.execute(), strict=True) if count]
        found: list[tuple[DedupInfo, DedupCursor]] = []
        for name in jobs:
            index = keys.dedup_index(self.prefix, name)
            # the position read up to: below expiry `high`, past `tie` keys of that expiry
            high, tie = (float("inf"), 0)
            if after is not None and after[0] == name:
                high, tie = after[1], after[2]
            while len(found) <= limit:
                wanted = limit + 1 - len(found)
                entries: list[tuple[Any, float]] = self.client.zrevrangebyscore(  # type: ignore[assignment]
                    index, high, live, start=tie, num=wanted, withscores=True
                )
                scored = [(text(key), float(score)) for key, score in entries]
                infos = self._dedup_infos(name, [key for key, _ in scored])
                for (_, score), info in zip(scored, infos, strict=True):
                    tie = tie + 1 if score == high else 1
                    high = score
                    if info is not None:
                        found.append((info, (name, score, tie)))
                if len(entries) < wanted:
                    break
            if len(found) > limit:
                break
        page = found[:limit]
        cursor = page[-1][1] if len(found) > limit else None
        return [info for info, _ in page], cursor

    def dedup_keys(self, job: str | None = None, *, limit: int = 1_000) -> list[DedupInfo]:
        """Live dedup keys (the first ``limit`` of :meth:`dedup_page`)."""
        return self.dedup_page(job, limit=limit)[0]

    def dedup_record(self, job: JobDefinition, dedup_key: str) -> DedupInfo | None:
        """The live dedup record of ``dedup_key`` of ``job``, if any (read by its key)."""
        return self._dedup_infos(job.qualified_name, [dedup_key])[0]

    def _dedup_infos(self, job: str, dedup_keys: Sequence[str]) -> list[DedupInfo | None]:
        """The records of ``job``'s ``dedup_keys`` (one round trip; ``None`` for one gone)."""
        if not dedup_keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in dedup_keys:
            pipe.hgetall(keys.dedup(self.prefix, job, key))
            pipe.pttl(keys.dedup(self.prefix, job, key))
        replies = pipe.execute()
        found: list[DedupInfo | None] = []
        for i, key in enumerate(dedup_keys):
            fields, ttl = replies[2 * i], replies[2 * i + 1]
            if not fields:
                found.append(None)
                continue
            record = {text(k): text(v) for k, v in fields.items()}
            found.append(
                DedupInfo(
                    job_name=job,
                    dedup_key=key,
                    message_id=record.get("id", ""),
                    state=record.get("state", ""),
                    follow_up_id=record.get("fid"),
                    expires_in_ms=int(ttl),
                )
            )
        return found

    # -- actions -------------------------------------------------------------------------
    def retry_dead(self, message_id: str) -> str | None:
        """Re-enqueue dead letter ``message_id``; the new message id, or ``None`` when it is
        not (or no longer) a dead letter. Found through its dead letter note (a few key reads)
        when it has one, else by the redis ids kumiko derives from its id, else among the
        newest :data:`PREFIX_WINDOW` dead letters of each lane: never a read of them all."""
        letter = self._noted_dead_letter(message_id) or self._found_dead_letter(message_id)
        return None if letter is None else self._retry(letter)

    def retry_all_dead(self, job: str | None = None) -> list[tuple[str, str]]:
        """Re-enqueue every dead letter (``job``'s, when given), newest first, each as
        :meth:`retry_dead` does; ``(dead message id, new message id)`` of each one retried.
        Letters that die again meanwhile are newer than the sweep and are not retried again."""
        retried: list[tuple[str, str]] = []
        cursor: DeadCursor | None = None
        while True:
            letters, cursor = self.dead_letter_page(
                job, after=cursor, limit=500, max_read=10_000, notes=False
            )
            for letter in letters:
                new_id = self._retry(letter)
                if new_id is not None:
                    retried.append((letter.message_id, new_id))
            if cursor is None:
                return retried

    def _noted_dead_letter(self, message_id: str) -> DeadLetter | None:
        """Dead letter ``message_id`` found where its note says it is (``None`` if it has no
        note, or is not there)."""
        note = self.history.dead_note(message_id)
        if note is None:
            return None
        queue, rid = note.get("q"), note.get("r")
        if not isinstance(queue, str) or not isinstance(rid, str) or queue not in self.lane_queues:
            return None
        pipe = self.client.pipeline(transaction=False)
        pipe.zscore(dead_letters(queue), rid)
        pipe.hget(dead_letter_messages(queue), rid)
        score, body = pipe.execute()
        if score is None:
            return None
        letter = self._dead_letter(queue, rid, float(score), body, read_note=False)
        return letter if letter is not None and letter.message_id == message_id else None

    def _found_dead_letter(self, message_id: str) -> DeadLetter | None:
        """Dead letter ``message_id`` without a note: by its derived redis ids, then among
        the newest dead letters of each lane."""
        candidates = self.redis_id_candidates(message_id)
        pipe = self.client.pipeline(transaction=False)
        for queue in self.lane_queues:
            for rid in candidates:
                pipe.zscore(dead_letters(queue), rid)
        scores = iter(pipe.execute())
        for queue in self.lane_queues:
            for rid in candidates:
                score = next(scores)
                if score is not None:
                    body = self.client.hget(dead_letter_messages(queue), rid)
                    letter = self._dead_letter(queue, rid, float(score), body, read_note=False)
                    if letter is not None and letter.message_id == message_id:
                        return letter
        for queue in self.lane_queues:
            entries: list[tuple[Any, float]] = self.client.zrevrange(  # type: ignore[assignment]
                dead_letters(queue), 0, PREFIX_WINDOW - 1, withscores=True
            )
            rids = [text(rid) for rid, _ in entries]
            bodies = self.client.hmget(dead_letter_messages(queue), rids) if rids else []
            for rid, (_, score), body in zip(rids, entries, bodies, strict=True):
                letter = self._dead_letter(queue, rid, float(score), body, read_note=False)
                if letter is not None and letter.message_id == message_id:
                    return letter
        return None

    def redis_id_candidates(self, message_id: str) -> list[str]:
        """The redis ids a live copy of ``message_id`` can have (a sequential hand-off's of
        the work it started included): :func:`~kumiko_dramatiq.ids.redis_id_candidates`,
        from the last attempt of it with a run record (one ``HKEYS``)."""
        attempts = [
            int(text(field))
            for field in self.client.hkeys(keys.run_record(self.prefix, message_id))
            if text(field).isdigit()
        ]
        return redis_id_candidates(message_id, max(attempts, default=0))

    def ids_starting_with(self, prefix: str, *, limit: int = 10) -> list[str]:
        """Message ids that start with ``prefix``, sorted, at most ``limit``: looked up among
        the newest :data:`PREFIX_WINDOW` run records of each status (dead letters have one
        with status ``dead``) and the runs in flight. Bounded work: a prefix of an older
        id, or of a message that never ran, finds nothing (give its full id)."""
        pipe = self.client.pipeline(transaction=False)
        for status in STATUSES:
            pipe.zrevrange(keys.runs_by_status(self.prefix, status), 0, PREFIX_WINDOW - 1)
        found: set[str] = set()
        for members in pipe.execute():
            for member in members:
                message_id = text(member).rpartition(":")[0]
                if message_id.startswith(prefix):
                    found.add(message_id)
        found.update(
            run.message_id for run in self.history.running() if run.message_id.startswith(prefix)
        )
        return sorted(found)[:limit]

    def _retry(self, letter: DeadLetter) -> str | None:
        queue = letter.queue
        body = self.client.hget(dead_letter_messages(queue), letter.redis_message_id)
        if body is None:
            return None
        message = Message.decode(body if isinstance(body, bytes) else body.encode())
        options = {k: v for k, v in message.options.items() if k not in ("eta", "redis_message_id")}
        options.pop(FAILURES, None)
        if TRIGGER in options:  # a kumiko message: a new id that keeps its origin
            options[ORIGIN_ID] = options.get(ORIGIN_ID) or letter.message_id
            options.pop(DEDUP_KEY, None)
        new_id = generate_unique_id()
        fresh: Message[Any] = Message(
            queue_name=queue,
            actor_name=message.actor_name,
            args=message.args,
            kwargs=message.kwargs,
            options=options,
            message_id=new_id,
        )
        prepared = self.broker.prepare(fresh, None)
        rid = prepared.options["redis_message_id"]
        self.broker.emit_before("enqueue", prepared, None)
        done = self.broker.lua.retry_dead(
            keys=[
                dead_letters(queue),
                dead_letter_messages(queue),
                queue_messages(queue),
                queue_list(queue),
                keys.dead_note(self.prefix, letter.message_id),
            ],
            args=[letter.redis_message_id, rid, prepared.encode()],
        )
        if done != 1:
            return None
        self.broker.emit_after("enqueue", prepared, None)
        return new_id

    def waiting_state(self, message_id: str) -> str | None:
        """Where ``message_id`` (or a sequential hand-off carrying it on) is now, read the way
        :meth:`cancel` looks for it but changing nothing: ``"queued"`` (waiting in a lane
        queue, its suspects or a paused job's parked list), ``"delayed"`` (on a delay queue),
        ``"running"`` (claimed by a worker), or ``None`` (none of these: it ended, or never
        was). Two round trips, whatever the size of the queues."""
        candidates = self.redis_id_candidates(message_id)
        places = [
            (place, rid)
            for queue in self.lane_queues
            for rid in candidates
            for place, rid in (
                (queue, rid),
                (dq_name(queue), rid),
                (queue, moved_redis_id(rid, queue)),
            )
        ]
        pipe = self.client.pipeline(transaction=False)
        pipe.zrange(heartbeats(), 0, -1)
        for place, rid in places:
            pipe.hget(queue_messages(place), rid)
        workers, *bodies = pipe.execute()
        for (place, rid), body in zip(places, bodies, strict=True):
            carried = None if body is None else _carried_id(body, message_id)
            if carried is None:
                continue
            pipe = self.client.pipeline(transaction=False)
            pipe.get(keys.cancelled(self.prefix, carried))
            for worker in workers:
                pipe.sismember(consumer_acks(text(worker), place), rid)
            marker, *claims = pipe.execute()
            if keys.is_delay_queue(place):
                # held in a worker's memory once cancelled: its move drops it
                return None if marker is not None else "delayed"
            return "running" if any(claims) else "queued"
        return None

    def cancel(self, message_id: str) -> tuple[bool, str]:
        """Cancel ``message_id`` if it has not started: ``(True, queue)``, or ``(False, why)``
        with why ``"running"``, ``"ended"`` (it completed, died or was cancelled: it has a run
        record or a dead letter note) or ``"gone"`` (no trace of it). Found by the redis ids
        kumiko derives from its id (:meth:`redis_id_candidates`), on each lane queue and its
        delay queue: a few key reads, never a search of a queue. A message a worker holds
        ahead of its threads is asked about (:mod:`kumiko_dramatiq.ops.asking`): True once
        that worker dropped it (or, silent, can no longer start it: within 1.4 s), False if
        it had started."""
        completed_ttl, failed_ttl = run_ttls_ms(self.settings)
        places: list[str] = []
        for rid in self.redis_id_candidates(message_id):
            for queue in self.lane_queues:
                places += [queue, rid, dq_name(queue), rid, queue, moved_redis_id(rid, queue)]
        for _ in range(CANCEL_ROUNDS):
            reply = self.broker.lua.cancel(
                keys=[self.broker.namespace],
                args=[
                    keys.root(self.prefix),
                    message_id,
                    int(datetime.now(UTC).timestamp() * 1000),
                    completed_ttl,
                    failed_ttl,
                    self.settings.heartbeat_timeout_ms + 3_600_000,
                    self.broker.resend_window_ms,
                    new_request_id(),
                    *places,
                ],
            )
            if reply[0] != 2:
                return reply[0] == 1, text(reply[1])
            queue, rid, holder, request = (text(each) for each in reply[1:5])
            answer = Asking(self.broker).wait([Ask(queue, holder, rid, request)])[rid]
            if answer == "dropped":
                return True, queue
            if answer == "started":
                return False, "running"
            # "gone": settled meanwhile, or back on its queue (its worker's claim recovered,
            # its consumer closed): look again
        return False, "running"

    def queued(
        self,
        job: str | None = None,
        *,
        state: str | None = None,
        limit: int = 50,
        after: QueuedMessage | None = None,
    ) -> list[QueuedMessage]:
        """A page of waiting messages (:mod:`kumiko_dramatiq.ops.waiting`)."""
        waiting = Waiting(self.client, self.registry, self.prefix, self.lane_queues)
        return waiting.page(job, state, limit=limit, after=after)

    def running(self, job: str | None = None) -> list[JobRun]:
        """The attempts running now (``job``'s only, when given), longest running first:
        read off the in-flight hash (bounded by the workers' threads), whatever the queues'
        size."""
        runs = [run for run in self.history.running() if job is None or run.job_name == job]
        return sorted(runs, key=_started_key)

    def stop_run(self, message_id: str) -> bool | None:
        """Ask the running attempt of ``message_id`` to stop (``keys.stop_request``; the
        worker running it reads it within :data:`~kumiko_dramatiq.worker.stops.POLL_S`):
        ``True``; ``False`` when it is not running but known (it waits, or ended); ``None``
        when there is no trace of it. The in-flight hash, then one ``SET``."""
        if any(run.message_id == message_id for run in self.history.running()) or (
            self._started_from_hold(message_id)
        ):
            self.client.set(
                keys.stop_request(self.prefix, message_id),
                int(datetime.now(UTC).timestamp() * 1000),
                px=keys.STOP_REQUEST_TTL_MS,
            )
            return True
        return False if self.known(message_id) else None

    def _started_from_hold(self, message_id: str) -> bool:
        """Whether ``message_id`` is held by a worker that, asked, says it started it (its
        start not reported yet), or runs now: a held message is not running."""
        rids = self.redis_id_candidates(message_id)
        asking = Asking(self.broker)
        request = new_request_id()
        for queue in self.lane_queues:
            asks, running = asking.ask(queue, rids, request, "probe")
            if running:
                return True
            if asks and "started" in asking.wait(asks).values():
                return True
        return False

    def purge(self, job: JobDefinition, state: str, *, dry_run: bool = False) -> int:
        """Remove ``job``'s messages in ``state`` (:data:`PURGE_WALKS`), at most
        :data:`PURGE_STEP` entries and about :data:`PURGE_STEP_BYTES` of their bodies per Lua
        call (``lua/purge_step.lua``), so Redis is never blocked; the number
        removed (with ``dry_run``: found, nothing changed). Dedup keys they hold are freed; no
        run record is written; one WARNING line says how many went. A running message is
        never removed; messages enqueued while it runs may or may not be."""
        queue = job.queue_name(self.prefix)
        total = 0
        for walk in PURGE_WALKS[state]:
            cursor, count = "0", 1 if walk == "delayed" else PURGE_STEP
            while True:
                removed, cursor, spent, read = self.broker.lua.purge_step(
                    keys=[self.broker.namespace],
                    args=[
                        keys.root(self.prefix),
                        job.qualified_name,
                        walk,
                        queue,
                        cursor,
                        count,
                        int(datetime.now(UTC).timestamp() * 1000),
                        PURGE_STEP_BYTES,
                        "1" if dry_run else "0",
                    ],
                )
                total += int(removed)
                cursor = text(cursor)
                if cursor == "0":
                    break
                if walk == "delayed":
                    # HSCAN hands over the bodies it visits: size its next COUNT so that
                    # bodies like the ones just read stay within the step's bytes
                    count = purge_scan_count(count, int(spent), int(read))
        if state == "queued":
            # what workers hold ahead of their threads is queued too: asked last, so that what
            # they claimed off the queue while it was walked is held by then
            asking = Asking(self.broker)
            asks, held = asking.ask_job(
                queue, job.qualified_name, new_request_id(), "purge", dry_run=dry_run
            )
            if dry_run:
                total += held
            else:
                total += sum(1 for a in asking.wait(asks).values() if a == "dropped")
        if not dry_run:
            logger.warning("purged %d %s message(s) of %s", total, state, job.qualified_name)
        return total

    def delete_dead(self, message_id: str) -> bool | None:
        """Discard dead letter ``message_id`` (``lua/delete_dead.lua``): ``True``; ``None``
        when it is not (or no longer) a dead letter. Found as :meth:`retry_dead` finds it."""
        letter = self._noted_dead_letter(message_id) or self._found_dead_letter(message_id)
        if letter is None:
            return None
        done = self.broker.lua.delete_dead(
            keys=[
                dead_letters(letter.queue),
                dead_letter_messages(letter.queue),
                keys.dead_note(self.prefix, message_id),
            ],
            args=[letter.redis_message_id],
        )
        return True if done == 1 else None

    def known(self, message_id: str) -> bool:
        """Whether ``message_id`` waits, runs, or left a run record or dead letter note."""
        return self.waiting_state(message_id) is not None or bool(
            self.client.exists(
                keys.run_record(self.prefix, message_id), keys.dead_note(self.prefix, message_id)
            )
        )

    def move_delayed_now(self, message_id: str) -> bool:
        """Queue the delayed message ``message_id`` (or a sequential hand-off carrying it on)
        now, whatever its due time: same message id, same attempt, same redis id; ``False``
        when it is not on a schedule (not delayed: queued, running, ended or unknown; or written
        by an older version onto Dramatiq's delay queue list and not scheduled yet). Found by
        the redis ids kumiko derives from its id (:meth:`redis_id_candidates`) on each lane's
        schedule: a few O(log n) steps in one Lua call (``lua/move_now.lua``), never a search.
        (``run_now`` builds on it.)"""
        places: list[str] = []
        for rid in self.redis_id_candidates(message_id):
            for queue in self.lane_queues:
                places += [queue, rid]
        reply = self.broker.lua.move_now(keys=[self.broker.namespace], args=places)
        return bool(reply[0] == 1)

    def run_now(self, message_id: str) -> bool | None:
        """Queue delayed message ``message_id`` now (:meth:`move_delayed_now`): ``True``;
        ``False`` when it is known but not delayed; ``None`` when there is no trace of it."""
        if self.move_delayed_now(message_id):
            logger.info("delayed message %s queued now (run-now)", message_id)
            return True
        return False if self.known(message_id) else None

    def pause(self, job: JobDefinition) -> bool:
        """Pause ``job``; ``False`` if it was paused already. The messages of it that workers
        hold ahead of their threads go back to its queue unstarted (their workers are asked,
        :mod:`kumiko_dramatiq.ops.asking`), where the next fetch parks them: once this returns,
        none of its messages starts until it is resumed."""
        added = bool(self.client.sadd(keys.paused(self.prefix), job.qualified_name))
        asking = Asking(self.broker)
        asks, _ = asking.ask_job(
            job.queue_name(self.prefix), job.qualified_name, new_request_id(), "back"
        )
        asking.wait(asks)
        return added

    def resume(self, job: JobDefinition) -> tuple[int, int] | None:
        """Resume ``job``: ``(requeued, dropped)`` parked messages, or ``None`` if it was not
        paused and holds nothing parked. The parked messages go back to the head of the
        queue :data:`RESUME_STEP` at a time (``lua/resume.lua``), the last parked first, so
        they end up in their parked order ahead of what was queued meanwhile; a resume cut
        short (a crash) is finished by the next one. Cron ticks parked meanwhile follow the
        job's misfire policy: ``coalesce`` keeps the latest, ``skip`` none."""
        parked_key = keys.parked(self.prefix, job.qualified_name)
        queue = job.queue_name(self.prefix)
        completed_ttl, failed_ttl = run_ttls_ms(self.settings)
        requeued = dropped = 0
        was_paused: bool | None = None
        latest_kept = False
        while True:
            drop: list[str] = []
            if isinstance(job.options.trigger, Cron):
                tail = self.client.lrange(parked_key, -RESUME_STEP, -1)
                drop, latest_kept = self._skipped_ticks(job, tail, queue, latest_kept)
            paused, moved, skipped, left = self.broker.lua.resume(
                keys=[
                    keys.paused(self.prefix),
                    parked_key,
                    queue_list(queue),
                    queue_messages(queue),
                    keys.parked_withdrawn(self.prefix, job.qualified_name),
                ],
                args=[
                    job.qualified_name,
                    keys.root(self.prefix),
                    int(datetime.now(UTC).timestamp() * 1000),
                    completed_ttl,
                    failed_ttl,
                    RESUME_STEP,
                    *drop,
                ],
            )
            if was_paused is None:
                was_paused = paused == 1
            requeued, dropped = requeued + int(moved), dropped + int(skipped)
            if int(left) == 0:
                break
        if not was_paused and requeued == dropped == 0:
            return None
        return requeued, dropped

    def _skipped_ticks(
        self, job: JobDefinition, parked: Sequence[Any], queue: str, latest_kept: bool
    ) -> tuple[list[str], bool]:
        """The parked cron ticks among ``parked`` (the tail of the parked list, resumed next)
        that the job's misfire policy skips, and whether the latest tick is kept: with
        ``coalesce`` all but the latest (the latest of the first tail that holds one, the
        tails going from the last parked back), with ``skip`` all of them."""
        trigger = job.options.trigger
        if not isinstance(trigger, Cron) or not parked:
            return [], latest_kept
        rids = [text(rid) for rid in parked]
        bodies = self.client.hmget(queue_messages(queue), rids)
        ticks: list[tuple[datetime, str]] = []
        for rid, body in zip(rids, bodies, strict=True):
            if body is None:
                continue
            options = json.loads(body).get("options", {})
            if options.get(TRIGGER) != "cron":
                continue
            try:
                tick = KumikoOptions.decode(options).scheduled_at
            except OptionsError:
                continue
            if tick is not None:
                ticks.append((tick.astimezone(UTC), rid))
        ticks.sort()
        if trigger.misfire == "skip":
            return [rid for _, rid in ticks], latest_kept
        if ticks and not latest_kept:
            return [rid for _, rid in ticks[:-1]], True
        return [rid for _, rid in ticks], latest_kept


def _carried_id(body: Any, message_id: str) -> str | None:
    """The id of encoded message ``body`` if it is ``message_id``'s, or a sequential hand-off
    carrying it on (as ``lua/cancel.lua`` decides); else ``None``."""
    try:
        message = json.loads(body)
        options = message["options"]
        own = str(message["message_id"])
    except (ValueError, KeyError, TypeError):
        return None
    if own == message_id:
        return own
    if options.get(ORIGIN_ID) == message_id and options.get(TRIGGER) == "requeue":
        return own
    return None


def _started_key(run: JobRun) -> datetime:
    return run.started_at or datetime.max.replace(tzinfo=UTC)


def _describe_trigger(job: JobDefinition) -> str:
    trigger = job.options.trigger
    if isinstance(trigger, Cron):
        return f"cron {trigger.expr} {trigger.timezone}"
    name = getattr(trigger, "name", None)
    return f"event {name}" if name else "manual"
