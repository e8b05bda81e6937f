"""The cron scheduler: APScheduler 3 wakes it on every tick, kumiko enqueues each tick once.

``kumiko-scheduler`` (also ``python -m kumiko_dramatiq.scheduler``; the command line is
:func:`kumiko_dramatiq.ops.cli.scheduler_main`) runs it for the app ``KUMIKO_APP`` names;
``JobRunner(run_scheduler=True)`` runs the same :class:`Scheduler` inside a worker. It takes a
broker, a registry and the retention, nothing more, and it only enqueues: workers run the jobs.

Contract
========

Triggers
    Every job of the registry whose trigger is a :class:`~kumiko_dramatiq.Cron` (any lane)
    gets one APScheduler job whose trigger, :class:`TickTrigger`, asks
    :meth:`Cron.next_fire_time` and nothing else. APScheduler is used as the timer, through
    its public API: its ``BackgroundScheduler`` thread sleeps until the next tick of any job
    (no polling) and submits the due job to a one-thread ``ThreadPoolExecutor``, so kumiko's
    Redis I/O never runs in APScheduler's own thread or under its locks, and ticks of all jobs
    are handled one at a time. APScheduler's own ``coalesce``/``misfire_grace_time`` never
    decide anything: kumiko recomputes the due ticks from :meth:`Cron.next_fire_time` and
    applies its own misfire policy (:func:`kumiko_dramatiq.scheduler.ticks.plan_ticks`). A run that
    APScheduler refuses because the previous one still runs (a Redis stall) loses nothing:
    the next wake-up accounts for every tick since the last one handled.

Tick identity (exactly once per tick)
    The message of tick ``t`` of job ``j`` has the id ``ids.cron_tick_id(j, t)`` and is
    written by ONE Lua call together with its guard ``keys.enqueue_guard(prefix, id)``
    (``SET NX``, TTL ``Retention.completed_age_s``): any number of schedulers against the
    same Redis database and queue prefix enqueue each tick once, and a crash (kill -9) at
    any point can neither lose a tick already written nor write it twice. There is no
    leader lock: each replica spends one round trip
    per tick, and a leader lease would only add a fail-over gap in which ticks arrive late.

The message
    ``build_message(job, {}, trigger="cron", message_id=<tick id>)`` (so it carries
    ``build_message_options(job)``), plus ``kumiko_scheduled_at``: the tick, ISO 8601 with
    its UTC offset, in the cron's time zone (``JobContext.scheduled_at``). A per-tenant job's
    tick starts its fan-out wrapper. A typed job's ``{}`` is its model's dump of ``{}``
    (:func:`~kumiko_dramatiq.payloads.empty_payload`; ``Registry`` proved it validates).

Misfires
    See :mod:`kumiko_dramatiq.scheduler.ticks`. One log line per decision (INFO for coalesced ticks,
    WARNING for skipped ones).

Redis keys (all per queue prefix)
    ``keys.enqueue_guard(prefix, tick_id)``: the guard, value = the scheduler's identity
    (``host:pid:random``), TTL ``completed_age_s``. ``keys.cron_last_tick(prefix, job)``:
    the latest tick enqueued (UTC epoch seconds), only ever raised, written in the same Lua
    call as the guard, TTL ``completed_age_s`` refreshed on every tick. Reset: delete them.

Logging (logger ``kumiko_dramatiq.scheduler``)
    Every tick this process enqueued: INFO with job, tick (ISO) and message id. A tick that
    another replica enqueued first: DEBUG. Redis errors: ERROR, then the tick counts as
    missed at the next wake-up.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import redis
from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES, JobEvent
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.date import DateTrigger

from kumiko_dramatiq import ids
from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.broker import KumikoBroker
from kumiko_dramatiq.cron import Cron
from kumiko_dramatiq.errors import PayloadError
from kumiko_dramatiq.limits import DEFAULT_MAX_PAYLOAD_BYTES
from kumiko_dramatiq.messages import build_message
from kumiko_dramatiq.middleware.presence import Registration
from kumiko_dramatiq.options import Retention
from kumiko_dramatiq.payloads import empty_payload
from kumiko_dramatiq.registry import JobDefinition, Registry
from kumiko_dramatiq.scheduler.ticks import TickPlan, effective_grace_s, plan_ticks
from kumiko_dramatiq.schedules import ScheduleLoop, Schedules
from kumiko_dramatiq.shards.routing import pinned_shard

__all__ = ["Scheduler", "TickTrigger"]

logger = logging.getLogger("kumiko_dramatiq.scheduler")

_EXECUTOR = "kumiko"
_CATCH_UP_JOB_ID = "kumiko-catch-up"
#: Delay before a start-up catch-up that hit a Redis error is tried again.
_CATCH_UP_RETRY_S = 1.0


class TickTrigger(BaseTrigger):  # type: ignore[misc]
    """APScheduler trigger whose fire times are :meth:`Cron.next_fire_time`.

    ``get_next_fire_time(previous, now)`` returns the first tick strictly after the later of
    ``previous`` and ``now`` (compared as UTC instants), as a UTC datetime. Starting from
    ``now`` when the scheduler is behind keeps APScheduler from enumerating a backlog; the
    ticks it passes over are kumiko's to account for
    (:func:`~kumiko_dramatiq.scheduler.ticks.plan_ticks`).
    """

    __slots__ = ("cron",)

    def __init__(self, cron: Cron) -> None:
        self.cron = cron

    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime) -> datetime:
        after = now.astimezone(UTC)
        if previous_fire_time is not None:
            after = max(after, previous_fire_time.astimezone(UTC))
        return self.cron.next_fire_time(after).astimezone(UTC)

    def __str__(self) -> str:
        return f"kumiko cron[{self.cron.expr!r}, {self.cron.timezone}]"

    def __repr__(self) -> str:
        return f"<TickTrigger {self.cron!r}>"


@dataclass
class _Track:
    """One cron job as this scheduler follows it."""

    job: JobDefinition
    cron: Cron
    grace_s: int
    #: The instant up to which this scheduler has accounted for every tick; ``None`` until
    #: the start-up catch-up against the dataset's last-tick record succeeded.
    after: datetime | None = field(default=None)


class Scheduler:
    """Enqueues the ticks of every cron job of ``registry`` on ``broker``; see the module docs.

    ``start()`` returns at once (the work runs in APScheduler's threads); ``stop()`` is
    idempotent, safe before ``start()``, and returns once those threads ended (an enqueue in
    flight completes first). It does not close the broker's connections. ``shard``: (which,
    of how many) when the dataset has several (:mod:`kumiko_dramatiq.shards`): it then ticks
    only the cron jobs that live in that shard, on that shard's ``broker``.
    """

    def __init__(
        self,
        broker: KumikoBroker,
        registry: Registry,
        *,
        retention: Retention,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        shard: tuple[int, int] = (0, 1),
    ) -> None:
        self.broker = broker
        self.queue_prefix = broker.queue_prefix
        self.identity = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        completed_age_s = retention.completed_age_s
        self._tracks = [
            _Track(
                job, job.options.trigger, effective_grace_s(job.options.trigger, completed_age_s)
            )
            for job in registry.jobs.values()
            if isinstance(job.options.trigger, Cron) and pinned_shard(job, shard[1]) == shard[0]
        ]
        self._guard_ttl_ms = completed_age_s * 1000
        self._lock = threading.Lock()
        self._registration = Registration(
            broker.client,
            broker.queue_prefix,
            identity=self.identity,
            role="scheduler",
            lane=None,
            ttl_ms=broker.heartbeat_timeout,
            shards=shard[1],
        )
        self._aps: BackgroundScheduler | None = None
        #: the runtime schedules' thread (kumiko_dramatiq.schedules)
        self._loop = ScheduleLoop(
            Schedules(
                broker,
                registry,
                max_payload_bytes=max_payload_bytes,
                guard_ttl_ms=self._guard_ttl_ms,
            ),
            self.identity,
        )
        self._started = False
        self._stopped = False

    @property
    def running(self) -> bool:
        """True between ``start()`` and ``stop()``."""
        return self._aps is not None

    def start(self) -> None:
        """Schedule every cron job and start the background thread (non-blocking)."""
        with self._lock:
            if self._started or self._stopped:
                raise RuntimeError("a Scheduler starts once; build a new one")
            self._started = True
            aps = BackgroundScheduler(
                timezone=UTC,
                daemon=True,
                executors={_EXECUTOR: ThreadPoolExecutor(max_workers=1)},
                # kumiko decides misfires itself (plan_ticks): APScheduler must not drop a
                # late wake-up.
                job_defaults={"coalesce": True, "misfire_grace_time": None, "max_instances": 1},
            )
            aps.add_listener(self._on_aps_event, EVENT_JOB_ERROR | EVENT_JOB_MAX_INSTANCES)
            for track in self._tracks:
                aps.add_job(
                    self._on_tick,
                    trigger=TickTrigger(track.cron),
                    args=(track,),
                    id=track.job.qualified_name,
                    name=track.job.qualified_name,
                    executor=_EXECUTOR,
                )
            self._add_catch_up(aps, datetime.now(UTC))
            self._aps = aps
            try:
                aps.start()
            except BaseException:
                self._aps = None
                raise
            self._registration.start()
            self._loop.start()
        logger.info(
            "kumiko scheduler %s started: %d cron job(s), queue prefix %s",
            self.identity,
            len(self._tracks),
            self.queue_prefix,
        )
        if not self._tracks:
            logger.info("kumiko scheduler: the registry declares no cron job")

    def stop(self) -> None:
        """Stop scheduling; wait for the tick being enqueued, if any. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            aps, self._aps = self._aps, None
        if aps is not None:
            self._loop.stop()
            aps.shutdown(wait=True)
            self._registration.stop()
            logger.info("kumiko scheduler %s stopped", self.identity)

    # -- in the executor thread --------------------------------------------------------------

    @staticmethod
    def _on_aps_event(event: JobEvent) -> None:
        if event.code == EVENT_JOB_MAX_INSTANCES:
            logger.warning(
                "kumiko scheduler: %s is still handling an earlier tick; the next wake-up "
                "accounts for this one",
                event.job_id,
            )
        else:
            logger.error(
                "kumiko scheduler: %s failed: %s", event.job_id, getattr(event, "exception", None)
            )

    def _add_catch_up(self, aps: BackgroundScheduler, at: datetime) -> None:
        aps.add_job(
            self._catch_up,
            trigger=DateTrigger(run_date=at),
            id=_CATCH_UP_JOB_ID,
            name="kumiko cron catch-up",
            executor=_EXECUTOR,
            replace_existing=True,
        )

    def _catch_up(self) -> None:
        """Account for the ticks missed while no scheduler of this process ran."""
        pending = [track for track in self._tracks if track.after is None]
        if not pending:
            return
        now = datetime.now(UTC)
        try:
            recorded = self._recorded_ticks(pending)
        except redis.RedisError as exc:
            logger.error("kumiko scheduler: cannot read the last ticks (%s); retrying", exc)
        else:
            for track, after in zip(pending, recorded, strict=True):
                self._settle(track, after, now, catching_up=True)
        aps = self._aps
        if aps is not None and any(track.after is None for track in self._tracks):
            self._add_catch_up(aps, now + timedelta(seconds=_CATCH_UP_RETRY_S))

    def _on_tick(self, track: _Track) -> None:
        """APScheduler found a tick of ``track`` due (it fires at or after the tick)."""
        now = datetime.now(UTC)
        if track.after is not None:
            self._settle(track, track.after, now, catching_up=False)
            return
        try:
            (after,) = self._recorded_ticks([track])
        except redis.RedisError as exc:
            logger.error(
                "kumiko scheduler: %s: cannot read its last tick (%s)",
                track.job.qualified_name,
                exc,
            )
            return
        self._settle(track, after, now, catching_up=True)

    def _settle(
        self, track: _Track, after: datetime | None, now: datetime, *, catching_up: bool
    ) -> None:
        plan = plan_ticks(track.cron, after, now, catching_up=catching_up, grace_s=track.grace_s)
        self._log_plan(track, plan)
        if plan.enqueue is not None:
            try:
                self._enqueue(track.job, plan.enqueue)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # The command may have run (its reply lost): only the dataset knows. Read its
                # last tick again soon, and catch up from there (the tick's id is guarded, so
                # one that did land is never enqueued twice).
                logger.error(
                    "kumiko scheduler: %s: tick %s not confirmed (%s); checking the dataset's "
                    "last tick again in %.0f s",
                    track.job.qualified_name,
                    plan.enqueue.isoformat(),
                    exc,
                    _CATCH_UP_RETRY_S,
                )
                self._retry_later(track, now)
                return
            except redis.RedisError as exc:
                # Redis answered and refused the command: the tick was not written.
                logger.error(
                    "kumiko scheduler: %s: tick %s NOT enqueued, Redis refused it (%s); "
                    "trying again in %.0f s",
                    track.job.qualified_name,
                    plan.enqueue.isoformat(),
                    exc,
                    _CATCH_UP_RETRY_S,
                )
                self._retry_later(track, now)
                return
            except PayloadError as exc:
                # The job's model no longer accepts its tick's payload: no retry can help.
                logger.error(
                    "kumiko scheduler: %s: tick %s NOT enqueued (%s); it counts as missed",
                    track.job.qualified_name,
                    plan.enqueue.isoformat(),
                    exc,
                )
        track.after = now

    def _retry_later(self, track: _Track, now: datetime) -> None:
        """Forget what ``track`` knows and catch it up from the dataset's last tick soon."""
        track.after = None
        aps = self._aps
        if aps is not None:
            self._add_catch_up(aps, now + timedelta(seconds=_CATCH_UP_RETRY_S))

    def _enqueue(self, job: JobDefinition, tick: datetime) -> None:
        prefix = self.queue_prefix
        tick_id = ids.cron_tick_id(job.qualified_name, tick)
        cron = job.options.trigger
        overlap = cron.overlap if isinstance(cron, Cron) else "allow"
        payload = empty_payload(job)
        dedup_key = f"schedule:{job.qualified_name}"
        message = build_message(
            job,
            payload,
            queue_prefix=prefix,
            trigger="cron",
            message_id=tick_id,
            scheduled_at=tick,
            dedup_key=None if overlap == "allow" else dedup_key,
        )
        _, reply = self.broker.enqueue_step(
            message,
            self.broker.lua.cron_tick,
            keys=[
                keys.enqueue_guard(prefix, tick_id),
                keys.cron_last_tick(prefix, job.qualified_name),
                keys.schedules_paused(prefix),
                keys.dedup(prefix, job.qualified_name, dedup_key),
                keys.dedup_index(prefix, job.qualified_name),
                keys.cron_skipped(prefix),
            ],
            args=[
                self._guard_ttl_ms,
                self.identity,
                int(tick.timestamp()),
                self._guard_ttl_ms,
                job.qualified_name,
                overlap,
                tick_id,
                json.dumps(payload),
            ],
        )
        if reply[0] == 3:
            logger.warning(
                "cron tick skipped: job=%s tick=%s (overlap=%s: its last run is queued or running)",
                job.qualified_name,
                tick.isoformat(),
                overlap,
            )
        elif reply[0] == 4:
            logger.info(
                "cron tick waits behind the running one: job=%s tick=%s",
                job.qualified_name,
                tick.isoformat(),
            )
        elif reply[0] == 2:
            logger.info(
                "cron tick not enqueued, its schedule is paused: job=%s tick=%s",
                job.qualified_name,
                tick.isoformat(),
            )
        elif reply[0] == 1:
            logger.info(
                "cron tick enqueued: job=%s tick=%s message_id=%s",
                job.qualified_name,
                tick.isoformat(),
                tick_id,
            )
        else:
            logger.debug(
                "cron tick already enqueued: job=%s tick=%s message_id=%s",
                job.qualified_name,
                tick.isoformat(),
                tick_id,
            )

    def _recorded_ticks(self, tracks: Sequence[_Track]) -> list[datetime | None]:
        """The last tick enqueued per job, from the dataset (one round trip)."""
        prefix = self.queue_prefix
        values = self.broker.client.mget(
            [keys.cron_last_tick(prefix, track.job.qualified_name) for track in tracks]
        )
        return [
            None if value is None else datetime.fromtimestamp(int(value), UTC) for value in values
        ]

    @staticmethod
    def _log_plan(track: _Track, plan: TickPlan) -> None:
        name = track.job.qualified_name
        if plan.coalesced and plan.enqueue is not None:
            logger.info(
                "cron misfire: job=%s: %d missed tick(s) from %s coalesced into tick %s",
                name,
                len(plan.coalesced),
                plan.coalesced[0].isoformat(),
                plan.enqueue.isoformat(),
            )
        if plan.skipped_first is not None and plan.skipped_through is not None:
            logger.warning(
                "cron misfire: job=%s: missed ticks from %s through %s skipped "
                "(misfire=%s, grace_s=%d)",
                name,
                plan.skipped_first.isoformat(),
                plan.skipped_through.isoformat(),
                track.cron.misfire,
                track.grace_s,
            )
