"""``runner.schedules``: schedules as data, created, changed, paused and triggered at run time.

A runtime schedule lives in Redis (:mod:`kumiko_dramatiq.schedules.model`): every
``kumiko-scheduler`` reads the due ones a few times a second (:class:`Schedules.due`, one
``ZRANGEBYSCORE``: O(due), not O(schedules)) and fires each tick in one Lua call that moves
the schedule's score on only if it still is the score it read (``lua/schedule_fire_batch.lua``): any
number of schedulers enqueue each tick once, and a pause, change or removal, which writes the
score in the same call as the spec (``lua/schedule_write.lua``), leaves no tick to fire once
it returned. A code-declared cron job is a schedule owned by code (id = the job's name): it
is listed, paused, resumed and triggered here, and changed only in code.
"""

from __future__ import annotations

import builtins
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal
from zoneinfo import ZoneInfo

from dramatiq.message import Message
from pydantic import BaseModel

from kumiko_dramatiq import ids
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.cron import Cron
from kumiko_dramatiq.errors import JobConfigError, NotFoundError, UnknownJobError
from kumiko_dramatiq.messages import build_message
from kumiko_dramatiq.payloads import empty_payload, payload_to_enqueue
from kumiko_dramatiq.registry import JobDefinition, Registry
from kumiko_dramatiq.schedules.model import (
    Schedule,
    check_id,
    encode_spec,
    instant,
    misfire_of,
    next_fire_ms,
    same_schedule,
    spec_of,
)

logger = logging.getLogger("kumiko_dramatiq.scheduler")

#: How often a write that met another write of the same schedule reads it again.
WRITE_ATTEMPTS: Final = 5


@dataclass(frozen=True)
class Fired:
    """What one due schedule came to (``Schedules.fire``): ``outcome`` ``"enqueued"``,
    ``"skipped"`` (a run of it is queued or running), ``"buffered"`` (waits behind the
    running one), ``"missed"`` (due ticks skipped: no scheduler ran), ``"gone"`` (paused,
    changed, removed or fired by another scheduler meanwhile) or ``"unknown"`` (its job is
    not this app's: left to the schedulers of the app that declares it)."""

    schedule_id: str
    outcome: str
    tick: datetime | None = None
    message_id: str | None = None


_OUTCOMES: Final = {0: "gone", 1: "enqueued", 2: "skipped", 3: "buffered", 4: "missed"}


@dataclass(frozen=True)
class _Tick:
    """A tick to fire: its message, its time and the rest of its script arguments."""

    schedule_id: str
    message: Message[Any]
    at: datetime | None
    tail: list[Any]


class Schedules:
    """The runtime schedules of one dataset, and the code-declared ones beside them."""

    def __init__(
        self, broker: KumikoBroker, registry: Registry, *, max_payload_bytes: int, guard_ttl_ms: int
    ) -> None:
        self.broker = broker
        self.registry = registry
        self.prefix = broker.queue_prefix
        self.max_payload_bytes = max_payload_bytes
        self.guard_ttl_ms = guard_ttl_ms

    # -- the API ------------------------------------------------------------------------
    def upsert(
        self,
        schedule_id: str,
        job_name: str,
        *,
        cron: Cron | None = None,
        every_ms: int | None = None,
        payload: dict[str, Any] | BaseModel | None = None,
        overlap: str | None = None,
        paused: bool = False,
    ) -> Schedule:
        """Create or change runtime schedule ``schedule_id``: ``job_name`` with ``payload``
        on every tick of ``cron`` (its time zone) or every ``every_ms`` ms (at least 1,000,
        counted from the upsert that set it); ``overlap`` ``None``: the ``Cron``'s (``"allow"``
        for ``every_ms``). The same arguments again change nothing (safe
        on every deploy); a change moves the next tick to the first of the new timing after
        now. ``JobConfigError`` for an unknown job, a bad id (or a code-declared job's), both
        or neither of ``cron`` and ``every_ms``, a bad ``overlap`` or ``paused``, and
        ``PayloadError`` for a payload the job refuses: nothing written."""
        schedule_id = self._runtime_id(schedule_id, "upsert")
        job = self.registry.jobs.get(job_name)
        if job is None:
            raise JobConfigError(
                None, f"schedule {schedule_id!r}", "names a job no feature declares", job_name
            )
        body = payload_to_enqueue(job, payload, max_bytes=self.max_payload_bytes)
        spec = spec_of(
            schedule_id,
            job.qualified_name,
            body,
            cron=cron,
            every_ms=every_ms,
            overlap=overlap if overlap is not None or cron is None else cron.overlap,
            paused=paused,
        )
        for _ in range(WRITE_ATTEMPTS):
            stored_text = self._stored_text(schedule_id)
            stored = json.loads(stored_text) if stored_text else None
            if stored is not None and same_schedule(stored, spec):
                return self.get(schedule_id)
            now_ms = self._now_ms()
            new = {**spec, "anchor": now_ms}
            if self._write(schedule_id, stored_text, new, None if paused else now_ms):
                return self.get(schedule_id)
        raise JobConfigError(None, f"schedule {schedule_id!r}", "changed by others meanwhile")

    def get(self, schedule_id: str) -> Schedule:
        """Schedule ``schedule_id`` (a runtime one, or a code-declared cron job's name);
        ``NotFoundError`` when there is none."""
        schedule_id = check_id(schedule_id)
        code = self._code_job(schedule_id)
        if code is not None:
            return self._code_schedules([code])[0]
        pipe = self.broker.client.pipeline(transaction=True)
        pipe.hget(keys.schedules(self.prefix), schedule_id)
        pipe.zscore(keys.schedules_due(self.prefix), schedule_id)
        pipe.hget(keys.schedules_last(self.prefix), schedule_id)
        stored, due, last = pipe.execute()
        if stored is None:
            raise NotFoundError(f"no schedule {schedule_id!r}")
        return _runtime_schedule(schedule_id, json.loads(stored), due, last)

    def list(self) -> builtins.list[Schedule]:
        """Every schedule, runtime and code-declared, by next fire time (paused ones last)."""
        pipe = self.broker.client.pipeline(transaction=True)
        pipe.hgetall(keys.schedules(self.prefix))
        pipe.zrange(keys.schedules_due(self.prefix), 0, -1, withscores=True)
        pipe.hgetall(keys.schedules_last(self.prefix))
        specs, due, last = pipe.execute()
        scores = {text(member): score for member, score in due}
        lasts = {text(member): value for member, value in last.items()}
        found = [
            _runtime_schedule(
                text(sid), json.loads(raw), scores.get(text(sid)), lasts.get(text(sid))
            )
            for sid, raw in specs.items()
        ]
        found += self._code_schedules(self._code_jobs())
        far = datetime.max.replace(tzinfo=UTC)
        return sorted(found, key=lambda s: (s.next_fire or far, s.id))

    def pause(self, schedule_id: str) -> bool:
        """Fire no tick of ``schedule_id`` from now on (none after this returned); ``False``
        when it is unknown or paused already."""
        return self._set_paused(schedule_id, True)

    def resume(self, schedule_id: str) -> bool:
        """Fire its ticks again, from the first after now; ``False`` when it is unknown or
        not paused."""
        return self._set_paused(schedule_id, False)

    def remove(self, schedule_id: str) -> bool:
        """Delete runtime schedule ``schedule_id`` (no tick after this returned); ``False``
        when there is none. A code-declared one: ``JobConfigError`` (``declared in code``)."""
        schedule_id = self._runtime_id(schedule_id, "remove")
        for _ in range(WRITE_ATTEMPTS):
            stored = self._stored_text(schedule_id)
            if stored is None:
                return False
            if self._write(schedule_id, stored, None, None):
                return True
        return False

    def trigger(self, schedule_id: str) -> str:
        """Enqueue one run of the schedule now, with its payload (a manual dispatch: its
        ticks go on as before); the message id. ``NotFoundError`` for an unknown one."""
        schedule = self.get(schedule_id)
        job = self._job(schedule.job_name)
        message = build_message(job, schedule.payload, queue_prefix=self.prefix, trigger="manual")
        self.broker.enqueue(message)
        return str(message.message_id)

    # -- the schedulers' side -------------------------------------------------------------
    def due(self, now_ms: int, limit: int = 500) -> builtins.list[tuple[str, int]]:
        """The runtime schedules due at ``now_ms`` (id, due score), earliest first."""
        found: Any = self.broker.client.zrangebyscore(
            keys.schedules_due(self.prefix), "-inf", now_ms, start=0, num=limit, withscores=True
        )
        return [(text(member), int(score)) for member, score in found]

    def specs(self, schedule_ids: builtins.list[str]) -> builtins.list[str | None]:
        """The stored specs of ``schedule_ids`` (``None``: removed), in one read."""
        if not schedule_ids:
            return []
        found = self.broker.client.hmget(keys.schedules(self.prefix), schedule_ids)
        return [None if raw is None else text(raw) for raw in found]

    def fire(
        self,
        schedule_id: str,
        due_ms: int,
        now_ms: int,
        identity: str,
        stored: str | Literal[False] | None = False,
    ) -> Fired:
        """Fire schedule ``schedule_id``, due at ``due_ms``: its tick, or (later than its
        misfire grace: its ``Cron``'s ``grace_s``, 60 s for an ``every_ms`` one) the latest
        tick within the grace (``misfire="coalesce"``) or none (``"skip"``); in one Lua call
        that does nothing unless the schedule is still due at ``due_ms``. ``stored``: its
        spec as :meth:`specs` read it (``False``: read it here)."""
        if stored is False:
            stored = self._stored_text(schedule_id)
        (fired,) = self.fire_many([(schedule_id, due_ms, stored)], now_ms, identity)
        return fired

    def fire_many(
        self,
        due: builtins.list[tuple[str, int, str | None]],
        now_ms: int,
        identity: str,
    ) -> builtins.list[Fired]:
        """:meth:`fire` for many due schedules ((id, due score, stored spec) each, the specs
        as :meth:`specs` read them): one Lua call per queue their jobs run on
        (``lua/schedule_fire_batch.lua``). What each came to, in order."""
        fired: builtins.list[Fired | None] = []
        by_queue: dict[str, builtins.list[tuple[int, _Tick]]] = {}
        for schedule_id, due_ms, stored in due:
            tick = None if stored is None else self._tick(schedule_id, due_ms, now_ms, stored)
            if tick is None or isinstance(tick, Fired):
                fired.append(tick or Fired(schedule_id, "gone"))
                continue
            fired.append(None)
            by_queue.setdefault(tick.message.queue_name, []).append((len(fired) - 1, tick))
        for ticks in by_queue.values():
            reply = self.broker.enqueue_batch(
                [tick.message for _, tick in ticks],
                self.broker.lua.schedule_fire_batch,
                args=[
                    keys.schedules_due(self.prefix),
                    keys.schedules_last(self.prefix),
                    keys.cron_skipped(self.prefix),
                    self.guard_ttl_ms,
                    identity,
                ],
                leads=[tick.schedule_id for _, tick in ticks],
                tails=[tick.tail for _, tick in ticks],
            )
            for (at, tick), code in zip(ticks, reply, strict=True):
                outcome = _OUTCOMES.get(int(code), "gone")
                message_id = str(tick.message.message_id) if outcome == "enqueued" else None
                fired[at] = Fired(tick.schedule_id, outcome, tick.at, message_id)
        return [each for each in fired if each is not None]

    def _tick(self, schedule_id: str, due_ms: int, now_ms: int, stored: str) -> _Tick | Fired:
        """The message of schedule ``schedule_id``'s tick due at ``due_ms`` and the rest of
        its arguments to ``lua/schedule_fire_batch.lua``, or what it came to without one."""
        spec = json.loads(stored)
        job = self.registry.jobs.get(spec["job"])
        if job is None:  # another app's job: its schedulers fire it
            return Fired(schedule_id, "unknown")
        tick_ms: int | None = due_ms
        misfire, grace_ms = misfire_of(spec)
        if now_ms - due_ms > grace_ms:
            # missed while no scheduler ran: "coalesce" runs the latest tick within the grace
            # in their stead, "skip" none
            tick_ms = None
            candidate = next_fire_ms(spec, now_ms - grace_ms)
            while misfire == "coalesce" and candidate <= now_ms:
                tick_ms, candidate = candidate, next_fire_ms(spec, candidate)
        next_ms = next_fire_ms(spec, max(now_ms, tick_ms or now_ms))
        at = None if tick_ms is None else _tick(tick_ms, spec["timezone"])
        message_id = ids.schedule_tick_id(schedule_id, tick_ms or due_ms)
        dedup_key = f"schedule:{schedule_id}"
        message = build_message(
            job,
            spec["payload"],
            queue_prefix=self.prefix,
            trigger="cron",
            message_id=message_id,
            scheduled_at=at,
            dedup_key=None if spec["overlap"] == "allow" else dedup_key,
        )
        tail = [
            due_ms,
            next_ms,
            "" if tick_ms is None else tick_ms,
            spec["overlap"],
            message_id,
            json.dumps(spec["payload"]),
            job.qualified_name,
            keys.enqueue_guard(self.prefix, message_id),
            keys.dedup(self.prefix, job.qualified_name, dedup_key),
            keys.dedup_index(self.prefix, job.qualified_name),
        ]
        return _Tick(schedule_id, message, at, tail)

    # -- internals --------------------------------------------------------------------------
    def _set_paused(self, schedule_id: str, paused: bool) -> bool:
        schedule_id = check_id(schedule_id)
        if self._code_job(schedule_id) is not None:
            key = keys.schedules_paused(self.prefix)
            client = self.broker.client
            changed = client.sadd(key, schedule_id) if paused else client.srem(key, schedule_id)
            return bool(changed)
        for _ in range(WRITE_ATTEMPTS):
            stored_text = self._stored_text(schedule_id)
            if stored_text is None:
                return False
            spec = json.loads(stored_text)
            if spec["paused"] == paused:
                return False
            now_ms = self._now_ms()
            new = {**spec, "paused": paused}
            if not paused and new.get("every_ms") is not None:
                new["anchor"] = now_ms
            if self._write(schedule_id, stored_text, new, None if paused else now_ms):
                return True
        return False

    def _write(
        self,
        schedule_id: str,
        stored: str | None,
        spec: dict[str, Any] | None,
        after_ms: int | None,
    ) -> bool:
        next_ms = "" if spec is None or after_ms is None else next_fire_ms(spec, after_ms)
        reply = self.broker.lua.schedule_write(
            keys=[
                keys.schedules(self.prefix),
                keys.schedules_due(self.prefix),
                keys.schedules_last(self.prefix),
            ],
            args=[schedule_id, stored or "", "" if spec is None else encode_spec(spec), next_ms],
        )
        return int(reply[0]) == 1

    def _stored_text(self, schedule_id: str) -> str | None:
        raw = self.broker.client.hget(keys.schedules(self.prefix), schedule_id)
        return None if raw is None else text(raw)

    def _now_ms(self) -> int:
        seconds, micros = self.broker.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def _runtime_id(self, schedule_id: str, action: str) -> str:
        schedule_id = check_id(schedule_id)
        if self._code_job(schedule_id) is not None:
            raise JobConfigError(
                schedule_id,
                "schedule",
                f"is declared in code (trigger=Cron(...)): change it there, not by {action}",
            )
        return schedule_id

    def _job(self, job_name: str) -> JobDefinition:
        job = self.registry.jobs.get(job_name)
        if job is None:
            raise UnknownJobError(job_name, sorted(self.registry.jobs))
        return job

    def _code_jobs(self) -> builtins.list[JobDefinition]:
        return [job for job in self.registry.jobs.values() if isinstance(job.options.trigger, Cron)]

    def _code_job(self, schedule_id: str) -> JobDefinition | None:
        job = self.registry.jobs.get(schedule_id)
        return job if job is not None and isinstance(job.options.trigger, Cron) else None

    def _code_schedules(self, jobs: builtins.list[JobDefinition]) -> builtins.list[Schedule]:
        if not jobs:
            return []
        pipe = self.broker.client.pipeline(transaction=False)
        pipe.smembers(keys.schedules_paused(self.prefix))
        for job in jobs:
            pipe.get(keys.cron_last_tick(self.prefix, job.qualified_name))
        paused_raw, *lasts = pipe.execute()
        paused = {text(member) for member in paused_raw}
        now = datetime.now(UTC)
        out = []
        for job, last in zip(jobs, lasts, strict=True):
            cron = job.options.trigger
            assert isinstance(cron, Cron)
            name = job.qualified_name
            out.append(
                Schedule(
                    id=name,
                    job_name=name,
                    cron=cron.expr,
                    every_ms=None,
                    timezone=cron.timezone,
                    payload=empty_payload(job, max_bytes=self.max_payload_bytes),
                    overlap=cron.overlap,
                    paused=name in paused,
                    next_fire=None if name in paused else cron.next_fire_time(now),
                    last_fire=None if last is None else datetime.fromtimestamp(int(last), UTC),
                    owner="code",
                )
            )
        return out


def _tick(tick_ms: int, timezone: str) -> datetime:
    return datetime.fromtimestamp(tick_ms / 1000, ZoneInfo(timezone))


def _runtime_schedule(schedule_id: str, spec: dict[str, Any], due: Any, last: Any) -> Schedule:
    return Schedule(
        id=schedule_id,
        job_name=spec["job"],
        cron=spec.get("cron"),
        every_ms=spec.get("every_ms"),
        timezone=spec["timezone"],
        payload=spec["payload"],
        overlap=spec["overlap"],
        paused=spec["paused"],
        next_fire=instant(None if due is None else float(due)),
        last_fire=instant(None if last is None else float(text(last))),
        owner="runtime",
    )


__all__ = ["Fired", "Schedules"]
