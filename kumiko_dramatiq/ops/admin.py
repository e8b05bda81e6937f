"""Operating a dataset: what is queued, dead, locked, keyed, paused and alive, and actions on it.

:class:`Admin` answers the ``kumiko`` command, the dashboard and ``JobRunner``'s admin
methods (``status``, ``dead_letters``, ``retry_dead``, ``cancel``, ``pause``, ``resume``,
plus ``jobs``, ``locks`` and ``dedup_keys``). Reads are plain reads (a status is one pipelined
round trip plus the liveness listing); the dashboard's reads stay bounded whatever the size
of the dataset (``dead_letter_page``, ``locks_in_flight``, ``walk_dedup_keys``,
``dedup_record``, ``boot_markers``). Every action that changes more than one key is one Lua
call, so it is all-or-nothing (``retry_all_dead`` is one such retry per letter):

- **retry** (``lua/retry_dead.lua``): the dead letter leaves the dead letters and a new
  message is enqueued in one step, with a fresh attempt budget, a new message id, the
  original origin id (the id the caller first got back) and, for a per-tenant child, its
  tenant; the dedup key is not carried (the key's job ended when it died);
- **cancel** (``lua/cancel.lua``): a queued, delayed, backing-off, parked or waiting message
  never starts; one held in a worker's memory until due is dropped by its move; a running one
  is not interrupted (``False``, nothing changed);
- **pause** (``keys.paused``): a paused job's messages are not fetched but parked
  (``keys.parked``) when a fetch meets them: kept, never run, no busy loop, on every worker;
  **resume** (``lua/resume.lua``) puts them back at the head of their queue. Cron ticks parked
  meanwhile follow the job's misfire policy: ``coalesce`` runs the latest one, ``skip`` none.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import redis
from dramatiq.common import dq_name
from dramatiq.message import Message, generate_unique_id

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.broker import KumikoBroker
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
    TRIGGER,
    KumikoOptions,
    OptionsError,
)
from kumiko_dramatiq.cron import Cron
from kumiko_dramatiq.middleware.presence import ProcessInfo, live_processes
from kumiko_dramatiq.ops.history import JobRun, RunHistory, run_ttls_ms
from kumiko_dramatiq.options import LANES, lane_queue
from kumiko_dramatiq.payloads import PayloadField, schema_fields
from kumiko_dramatiq.registry import JobDefinition, Registry
from kumiko_dramatiq.settings import Settings


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

    def to_json(self) -> dict[str, Any]:
        return {
            "lanes": [lane.to_json() for lane in self.lanes],
            "workers": [worker.to_json() for worker in self.workers],
            "schedulers": [scheduler.to_json() for scheduler in self.schedulers],
            "paused": self.paused,
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
    job_name: str
    tenant_id: str | None
    message_id: str
    origin_id: str | None
    worker: str | None
    expires_in_ms: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


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
        processes = live_processes(self.client, self.prefix)
        workers = [p for p in processes if p.role == "worker"]
        paused = sorted(text(job) for job in self.client.smembers(keys.paused(self.prefix)))
        pipe = self.client.pipeline(transaction=False)
        worker_ids = [text(w) for w in self.client.zrange(heartbeats(), 0, -1)]
        for queue in self.lane_queues:
            pipe.llen(queue_list(queue))
            pipe.llen(keys.suspects(self.prefix, queue))
            pipe.hlen(queue_messages(dq_name(queue)))
            pipe.zcard(dead_letters(queue))
            for worker in worker_ids:
                pipe.scard(consumer_acks(worker, queue))
        for job in paused:
            pipe.llen(keys.parked(self.prefix, job))
        replies = iter(pipe.execute())
        lanes = []
        for lane, queue in zip(LANES, self.lane_queues, strict=True):
            queued = int(next(replies)) + int(next(replies))
            delayed = int(next(replies))
            dead = int(next(replies))
            running = sum(int(next(replies)) for _ in worker_ids)
            lanes.append(LaneStatus(lane, queue, queued, delayed, running, dead, 0))
        parked_by_job = {job: int(next(replies)) for job in paused}
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
        return Status(
            lanes=lanes,
            workers=workers,
            schedulers=[p for p in processes if p.role == "scheduler"],
            paused=paused,
        )

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
                )
            )
        return infos

    def dead_letters(self, job: str | None = None, *, limit: int = 100) -> list[DeadLetter]:
        """Dead-lettered kumiko messages, newest first, with their last error."""
        found: list[DeadLetter] = []
        for queue in self.lane_queues:
            entries: list[tuple[Any, float]] = self.client.zrevrange(  # type: ignore[assignment]
                dead_letters(queue), 0, -1, withscores=True
            )
            if not entries:
                continue
            rids = [text(entry[0]) for entry in entries]
            bodies = self.client.hmget(dead_letter_messages(queue), rids)
            for rid, (_, score), body in zip(rids, entries, bodies, strict=True):
                letter = self._dead_letter(queue, rid, float(score), body)
                if letter is not None and (job is None or letter.job_name == job):
                    found.append(letter)
        found.sort(key=lambda letter: letter.dead_at, reverse=True)
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
            if len(matched) >= limit or offset >= max_read:
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

    def locks(self) -> list[LockInfo]:
        """Held sequential locks: job, tenant, the run that holds it, time left."""
        pattern = keys.sequential_lock(self.prefix, "*", None)
        found = []
        for raw in self.client.scan_iter(match=pattern, count=1000):
            key = text(raw)
            pipe = self.client.pipeline(transaction=False)
            pipe.get(key)
            pipe.pttl(key)
            token, ttl = pipe.execute()
            if token is None:
                continue
            job_name, tenant = keys.parse_sequential_lock(self.prefix, key)
            found.append(self._lock_info(job_name, tenant, text(token), int(ttl), {}))
        return sorted(found, key=lambda lock: (lock.job_name, lock.tenant_id or ""))

    def _lock_info(
        self,
        job_name: str,
        tenant: str | None,
        token: str,
        ttl_ms: int,
        known: dict[str, JobRun],
    ) -> LockInfo:
        """A held lock, its owner run found in ``known`` or else in the run history (the
        owner token is ``"<message id>:<random>"``)."""
        message_id = token.split(":", 1)[0]
        holder = known.get(message_id)
        if holder is None:
            runs = self.history.run_record(message_id)
            holder = runs[-1] if runs else None
        return LockInfo(
            job_name=job_name,
            tenant_id=tenant,
            message_id=message_id,
            origin_id=None if holder is None else holder.origin_id,
            worker=None if holder is None else holder.worker,
            expires_in_ms=ttl_ms,
        )

    def locks_in_flight(self) -> list[LockInfo]:
        """Held sequential locks, read by their keys instead of by walking the keyspace as
        :meth:`locks` does: the lock of each sequential job, and for a per-tenant sequential
        job the lock of each tenant with a run in flight (a lock is taken and released by a
        run in flight, and a dead worker's run stays in flight until its message is delivered
        again, after its lock expired). So it misses at most a lock whose holder left the
        in-flight runs without releasing it, for the ``lock_ttl_ms`` until it expires.
        Cost: the in-flight runs plus one round trip, whatever the size of the keyspace."""
        running = self.history.running()
        candidates: dict[str, tuple[str, str | None]] = {}
        for job in self.registry.jobs.values():
            if job.options.concurrency == "sequential" and not job.options.per_tenant:
                name = job.qualified_name
                candidates[keys.sequential_lock(self.prefix, name, None)] = (name, None)
        for run in running:
            declared = self.registry.jobs.get(run.job_name)
            if (
                declared is not None
                and declared.options.concurrency == "sequential"
                and declared.options.per_tenant
                and run.tenant_id is not None
            ):
                key = keys.sequential_lock(self.prefix, run.job_name, run.tenant_id)
                candidates[key] = (run.job_name, run.tenant_id)
        if not candidates:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in candidates:
            pipe.get(key)
            pipe.pttl(key)
        replies = iter(pipe.execute())
        by_message = {run.message_id: run for run in running}
        found = []
        for job_name, tenant in candidates.values():
            token, ttl = next(replies), next(replies)
            if token is None:
                continue
            found.append(self._lock_info(job_name, tenant, text(token), int(ttl), by_message))
        return sorted(found, key=lambda lock: (lock.job_name, lock.tenant_id or ""))

    def dedup_keys(self, job: str | None = None) -> list[DedupInfo]:
        """Live dedup keys: job, key, the message it stands for, its state."""
        pattern = self._dedup_pattern(job)
        names = [text(raw) for raw in self.client.scan_iter(match=pattern, count=1000)]
        found = [
            info
            for start in range(0, len(names), 1000)
            for info in self._dedup_infos(names[start : start + 1000])
        ]
        return sorted(found, key=lambda info: (info.job_name, info.dedup_key))

    def walk_dedup_keys(
        self, job: str | None = None, *, cursor: int = 0, max_keys: int = 50_000, limit: int = 200
    ) -> tuple[list[DedupInfo], int]:
        """Live dedup keys found by walking about ``max_keys`` keys of the keyspace from
        ``cursor`` (``SCAN``, 10,000 at a time; dedup records have no index), stopping early
        once ``limit`` are found; and the cursor to walk on from (0 when the walk is done).
        A key alive for the whole walk is found once at least; one written meanwhile may not
        be (Redis ``SCAN``'s guarantee)."""
        step = 10_000
        names: list[str] = []
        walked = 0
        while True:
            cursor, batch = self.client.scan(cursor, match=self._dedup_pattern(job), count=step)
            names += [text(raw) for raw in batch]
            walked += step
            if cursor == 0 or walked >= max_keys or len(names) >= limit:
                break
        found = self._dedup_infos(names)
        return sorted(found, key=lambda info: (info.job_name, info.dedup_key)), int(cursor)

    def dedup_record(self, job: JobDefinition, dedup_key: str) -> DedupInfo | None:
        """The live dedup record of ``dedup_key`` of ``job``, if any (read by its key)."""
        found = self._dedup_infos([keys.dedup(self.prefix, job.qualified_name, dedup_key)])
        return found[0] if found else None

    def _dedup_pattern(self, job: str | None) -> str:
        base = keys.dedup(self.prefix, "", "")[:-1]  # "kumiko:{prefix}:dedup:"
        return keys.dedup(self.prefix, job, "*") if job else base + "*"

    def _dedup_infos(self, names: Sequence[str]) -> list[DedupInfo]:
        """The records behind dedup record keys ``names`` (one round trip; gone ones left out)."""
        if not names:
            return []
        base = keys.dedup(self.prefix, "", "")[:-1]
        pipe = self.client.pipeline(transaction=False)
        for key in names:
            pipe.hgetall(key)
            pipe.pttl(key)
        replies = iter(pipe.execute())
        found = []
        for key in names:
            fields, ttl = next(replies), next(replies)
            if not fields:
                continue
            record = {text(k): text(v) for k, v in fields.items()}
            rest = key[len(base) :]
            parts = rest.split(":", 3)
            job_name, dedup_key = ":".join(parts[:3]), parts[3] if len(parts) > 3 else ""
            found.append(
                DedupInfo(
                    job_name=job_name,
                    dedup_key=dedup_key,
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
        when it has one, else by reading the dead letters."""
        noted = self._noted_dead_letter(message_id)
        if noted is not None:
            return self._retry(noted)
        for letter in self.dead_letters(limit=1_000_000):
            if letter.message_id == message_id:
                return self._retry(letter)
        return None

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

    def cancel(self, message_id: str) -> tuple[bool, str]:
        """Cancel ``message_id`` if it has not started: ``(True, queue)``, or ``(False, why)``
        with why ``"running"`` or ``"gone"``."""
        completed_ttl, failed_ttl = run_ttls_ms(self.settings)
        reply = self.broker.lua.cancel(
            keys=[self.broker.namespace],
            args=[
                keys.root(self.prefix),
                message_id,
                int(datetime.now(UTC).timestamp() * 1000),
                completed_ttl,
                failed_ttl,
                self.settings.heartbeat_timeout_ms + 3_600_000,
                *self.lane_queues,
            ],
        )
        return reply[0] == 1, text(reply[1])

    def pause(self, job: JobDefinition) -> bool:
        """Pause ``job``; ``False`` if it was paused already."""
        return bool(self.client.sadd(keys.paused(self.prefix), job.qualified_name))

    def resume(self, job: JobDefinition) -> tuple[int, int] | None:
        """Resume ``job``: ``(requeued, dropped)`` parked messages, or ``None`` if it was not
        paused."""
        if not self.client.sismember(keys.paused(self.prefix), job.qualified_name):
            return None
        parked_key = keys.parked(self.prefix, job.qualified_name)
        queue = job.queue_name(self.prefix)
        drop = self._skipped_ticks(job, self.client.lrange(parked_key, 0, -1), queue)
        completed_ttl, failed_ttl = run_ttls_ms(self.settings)
        requeued, dropped = self.broker.lua.resume(
            keys=[keys.paused(self.prefix), parked_key, queue_list(queue), queue_messages(queue)],
            args=[
                job.qualified_name,
                keys.root(self.prefix),
                int(datetime.now(UTC).timestamp() * 1000),
                completed_ttl,
                failed_ttl,
                *drop,
            ],
        )
        return int(requeued), int(dropped)

    def _skipped_ticks(self, job: JobDefinition, parked: Sequence[Any], queue: str) -> list[str]:
        """The parked cron ticks the job's misfire policy skips on resume: with ``coalesce``
        all but the latest, with ``skip`` all of them."""
        trigger = job.options.trigger
        if not isinstance(trigger, Cron) or not parked:
            return []
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
            return [rid for _, rid in ticks]
        return [rid for _, rid in ticks[:-1]]


def _describe_trigger(job: JobDefinition) -> str:
    trigger = job.options.trigger
    if isinstance(trigger, Cron):
        return f"cron {trigger.expr} {trigger.timezone}"
    name = getattr(trigger, "name", None)
    return f"event {name}" if name else "manual"
