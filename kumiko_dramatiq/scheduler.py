"""The cron scheduler: APScheduler 3 wakes it on every tick, kumiko enqueues each tick once.

``kumiko-scheduler`` (also ``python -m kumiko_dramatiq.scheduler``) runs it for the app the
environment names (``KUMIKO_APP``, ``KUMIKO_REDIS_URL``, ``KUMIKO_QUEUE_PREFIX``; see
:mod:`kumiko_dramatiq.environment`); ``JobRunner(run_scheduler=True)`` runs the same
:class:`Scheduler` inside a worker. It only enqueues: workers run the jobs.

Contract
========

Triggers
    Every job of the registry whose trigger is a :class:`~kumiko_dramatiq.Cron` (any lane)
    gets one APScheduler job whose trigger, :class:`TickTrigger`, asks
    :meth:`Cron.next_fire_time` and nothing else. APScheduler is used as the timer: its
    ``BackgroundScheduler`` thread sleeps until the next tick of any job (no polling) and
    hands the due job to :class:`_InlineExecutor`, which calls kumiko in that same thread.
    APScheduler's own ``coalesce``/``misfire_grace_time`` never decide anything: kumiko
    recomputes the due ticks from :meth:`Cron.next_fire_time` and applies its own misfire
    policy (:func:`plan_ticks`).

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
    tick starts its fan-out wrapper.

Misfires (documented default: ``Cron(..., misfire="coalesce", grace_s=60)``)
    A tick is *on time* when the running scheduler handles it as the only due tick and less
    than ``grace_s`` seconds after its time; it is enqueued. Every other due tick is
    *missed*: those due when a scheduler starts (every tick after the last tick enqueued
    in the dataset, ``keys.cron_last_tick``), and those due together after the scheduler
    fell behind (a stall, or Redis errors that made enqueues fail). For missed ticks:

    * ``misfire="coalesce"``: the latest missed tick less than ``grace_s`` old is enqueued,
      under its own tick id, standing for all missed ticks of the grace window; older ones
      are skipped. One log line each (INFO for coalesced ticks, WARNING for skipped ones).
    * ``misfire="skip"``: every missed tick is skipped (WARNING); the next tick runs.

    A backlog is never replayed: only the grace window is ever enumerated. ``grace_s`` is
    capped at ``Retention.completed_age_s`` so that no tick can outlive its guard. A dataset
    without a last-tick record (the first start, or idle longer than its TTL) has missed
    nothing.

Redis keys (all per queue prefix)
    ``keys.enqueue_guard(prefix, tick_id)``: the guard, value = the scheduler's identity
    (``host:pid:random``), TTL ``completed_age_s``. ``keys.cron_last_tick(prefix, job)``:
    the latest tick enqueued (UTC epoch seconds), only ever raised, written in the same Lua
    call as the guard, TTL ``completed_age_s`` refreshed on every tick. Reset: delete them.

Logging (logger ``kumiko_dramatiq.scheduler``)
    Every tick this process enqueued: INFO with job, tick (ISO) and message id. A tick that
    another replica enqueued first: DEBUG. Redis errors: ERROR, then the tick counts as
    missed at the next wake-up.

CLI
    SIGTERM or SIGINT stop it gracefully (exit status 0). A missing or bad ``KUMIKO_APP`` is
    one line on stderr and exit status 2; Redis unreachable at start (within
    ``boot_redis_timeout_ms``) is one line and status 1.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import FrameType
from typing import TYPE_CHECKING, Any

import redis
from apscheduler.executors.base import BaseExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.date import DateTrigger

from . import ids, keys
from .broker import AtomicStep
from .cron import Cron
from .environment import AppLoadError, runner_from_environment
from .errors import RedisUnavailableError
from .messages import build_message
from .registry import JobDefinition
from .scripts import PRELUDE

if TYPE_CHECKING:
    from redis.commands.core import Script

    from .runner import JobRunner

__all__ = ["Scheduler", "TickPlan", "TickTrigger", "effective_grace_s", "main", "plan_ticks"]

logger = logging.getLogger("kumiko_dramatiq.scheduler")

#: KEYS[3] = tick guard, KEYS[4] = the job's last-tick record.
#: ARGV[3] = guard TTL (ms), ARGV[4] = guard value (scheduler identity),
#: ARGV[5] = tick (UTC epoch seconds), ARGV[6] = last-tick record TTL (ms).
#: Enqueues the message iff the guard did not exist; raises the last-tick record to the
#: tick either way (never lowers it). Returns {1} (enqueued) or {0}.
TICK_SCRIPT = """
local enqueued = 0
if redis.call("exists", KEYS[3]) == 0 then
    enqueue_message()
    redis.call("set", KEYS[3], ARGV[4], "PX", ARGV[3])
    enqueued = 1
end
local last = tonumber(redis.call("get", KEYS[4]))
if last == nil or last < tonumber(ARGV[5]) then
    redis.call("set", KEYS[4], ARGV[5], "PX", ARGV[6])
else
    redis.call("pexpire", KEYS[4], ARGV[6])
end
return {enqueued}
"""

_EXECUTOR = "kumiko"
_CATCH_UP_JOB_ID = "kumiko:catch-up"
#: Delay before a start-up catch-up that hit a Redis error is tried again.
_CATCH_UP_RETRY_S = 1.0


# -- pure tick logic -------------------------------------------------------------------------


class TickTrigger(BaseTrigger):  # type: ignore[misc]
    """APScheduler trigger whose fire times are :meth:`Cron.next_fire_time`.

    ``get_next_fire_time(previous, now)`` returns the first tick strictly after the later of
    ``previous`` and ``now`` (compared as UTC instants), as a UTC datetime. Starting from
    ``now`` when the scheduler is behind keeps APScheduler from enumerating a backlog; the
    ticks it passes over are kumiko's to account for (:func:`plan_ticks`).
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


@dataclass(frozen=True)
class TickPlan:
    """What to do with the ticks of one cron job that are due now.

    ``enqueue``: the one tick to enqueue, or ``None``. ``coalesced``: missed ticks within
    the grace window that ``enqueue`` stands for (not enqueued themselves). Skipped ticks:
    every one lies in ``[skipped_first, skipped_through]`` (both ``None`` when none was
    skipped; ``skipped_through`` is an instant, not necessarily a tick).
    """

    enqueue: datetime | None = None
    coalesced: tuple[datetime, ...] = ()
    skipped_first: datetime | None = None
    skipped_through: datetime | None = None


def plan_ticks(
    cron: Cron,
    after: datetime | None,
    now: datetime,
    *,
    catching_up: bool,
    grace_s: int | None = None,
) -> TickPlan:
    """Decide which of the ticks in ``(after, now]`` of ``cron`` to enqueue (pure).

    ``after`` is the last instant already accounted for: the last tick enqueued in the
    dataset when ``catching_up`` (a scheduler start), else the previous wake-up of this
    scheduler; ``None`` means nothing was ever enqueued, so nothing was missed.
    ``grace_s`` defaults to ``cron.grace_s``. A tick is within the grace window when it is
    less than ``grace_s`` seconds before ``now``. See the module docstring for the rules;
    only the grace window is enumerated, whatever the gap.
    """
    if after is None:
        return TickPlan()
    grace = cron.grace_s if grace_s is None else grace_s
    after_utc = after.astimezone(UTC)
    now_utc = now.astimezone(UTC)
    first_due = cron.next_fire_time(after_utc)
    if first_due.astimezone(UTC) > now_utc:
        return TickPlan()
    window_start = max(after_utc, now_utc - timedelta(seconds=grace))
    recent = list(cron.fire_times(window_start, now_utc))
    older = first_due.astimezone(UTC) <= window_start
    zone = first_due.tzinfo
    if not catching_up and not older and len(recent) == 1:
        return TickPlan(enqueue=recent[0])
    if cron.misfire == "coalesce" and recent:
        return TickPlan(
            enqueue=recent[-1],
            coalesced=tuple(recent[:-1]),
            skipped_first=first_due if older else None,
            skipped_through=window_start.astimezone(zone) if older else None,
        )
    return TickPlan(
        skipped_first=first_due,
        skipped_through=recent[-1] if recent else window_start.astimezone(zone),
    )


def effective_grace_s(cron: Cron, completed_age_s: int) -> int:
    """``cron.grace_s`` capped at the guards' lifetime, so no tick outlives its guard."""
    return min(cron.grace_s, completed_age_s)


# -- APScheduler glue ------------------------------------------------------------------------


class _InlineExecutor(BaseExecutor):  # type: ignore[misc]
    """Runs a due job in the scheduler thread, passing APScheduler's run times.

    Enqueueing a tick is one Redis round trip, so no thread pool is needed, and running
    inline means no tick is ever refused for "max instances" (which would drop it).
    """

    def submit_job(self, job: Any, run_times: Sequence[datetime]) -> None:
        try:
            job.func(*job.args, run_times=list(run_times), **job.kwargs)
        except Exception:
            logger.exception("kumiko scheduler: job %s failed", job.id)

    def _do_submit_job(self, job: Any, run_times: Sequence[datetime]) -> None:
        self.submit_job(job, run_times)


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
    """Enqueues the ticks of every cron job of ``runner``'s registry; see the module docs.

    ``start()`` returns at once (the work runs in APScheduler's background thread);
    ``stop()`` is idempotent, safe before ``start()``, and returns once that thread ended
    (an enqueue in flight completes first). It does not close the runner's connections.
    """

    def __init__(self, runner: JobRunner) -> None:
        self.runner = runner
        self.identity = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        completed_age_s = runner.retention.completed_age_s
        self._tracks = [
            _Track(
                job, job.options.trigger, effective_grace_s(job.options.trigger, completed_age_s)
            )
            for job in runner.registry.jobs.values()
            if isinstance(job.options.trigger, Cron)
        ]
        self._guard_ttl_ms = completed_age_s * 1000
        self._lock = threading.Lock()
        self._aps: BackgroundScheduler | None = None
        self._started = False
        self._stopped = False

    @functools.cached_property
    def _tick_script(self) -> Script:
        return self.runner.broker.client.register_script(PRELUDE + TICK_SCRIPT)

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
                executors={_EXECUTOR: _InlineExecutor()},
                # kumiko decides misfires itself (plan_ticks): APScheduler must neither drop
                # a late wake-up nor refuse one.
                job_defaults={"coalesce": True, "misfire_grace_time": None, "max_instances": 1},
            )
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
        logger.info(
            "kumiko scheduler %s started: %d cron job(s), queue prefix %s",
            self.identity,
            len(self._tracks),
            self.runner.queue_prefix,
        )
        if not self._tracks:
            logger.warning("kumiko scheduler: the registry declares no cron job")

    def stop(self) -> None:
        """Stop scheduling; wait for the tick being enqueued, if any. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            aps, self._aps = self._aps, None
        if aps is not None:
            aps.shutdown(wait=True)
            logger.info("kumiko scheduler %s stopped", self.identity)

    # -- in the scheduler thread -------------------------------------------------------------

    def _add_catch_up(self, aps: BackgroundScheduler, at: datetime) -> None:
        aps.add_job(
            self._catch_up,
            trigger=DateTrigger(run_date=at),
            id=_CATCH_UP_JOB_ID,
            name="kumiko cron catch-up",
            executor=_EXECUTOR,
            replace_existing=True,
        )

    def _catch_up(self, run_times: Sequence[datetime] = ()) -> None:
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

    def _on_tick(self, track: _Track, run_times: Sequence[datetime] = ()) -> None:
        """APScheduler found a tick of ``track`` due."""
        now = datetime.now(UTC)
        if run_times:
            # The tick APScheduler saw due is due, whatever the wall clock did since.
            now = max(now, run_times[-1].astimezone(UTC))
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
            except redis.RedisError as exc:
                logger.error(
                    "kumiko scheduler: %s: tick %s NOT enqueued (%s); it counts as missed",
                    track.job.qualified_name,
                    plan.enqueue.isoformat(),
                    exc,
                )
                return
        track.after = now

    def _enqueue(self, job: JobDefinition, tick: datetime) -> None:
        prefix = self.runner.queue_prefix
        tick_id = ids.cron_tick_id(job.qualified_name, tick)
        message = build_message(
            job,
            {},
            queue_prefix=prefix,
            trigger="cron",
            message_id=tick_id,
            extra_options={"kumiko_scheduled_at": tick.isoformat()},
        )
        step = AtomicStep(
            script=self._tick_script,
            keys=(
                keys.enqueue_guard(prefix, tick_id),
                keys.cron_last_tick(prefix, job.qualified_name),
            ),
            args=(
                self._guard_ttl_ms,
                self.identity,
                int(tick.timestamp()),
                self._guard_ttl_ms,
            ),
        )
        _, reply = self.runner.broker.enqueue_atomic(message, step)
        if reply[0] == 1:
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
        prefix = self.runner.queue_prefix
        values = self.runner.broker.client.mget(
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


# -- the console script ----------------------------------------------------------------------


def main() -> int:
    """``kumiko-scheduler``: run the scheduler until SIGTERM or SIGINT; return the status."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
    try:
        runner = runner_from_environment()
    except Exception as exc:  # any failure to load the app is one line, status 2
        print(f"kumiko-scheduler: {_one_line(exc)}", file=sys.stderr)
        return 2

    stopping = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            runner.wait_for_redis()
        except RedisUnavailableError as exc:
            print(f"kumiko-scheduler: {_one_line(exc)}", file=sys.stderr)
            return 1
        scheduler = Scheduler(runner)
        scheduler.start()
        try:
            while not stopping.wait(timeout=3600):
                pass
        finally:
            scheduler.stop()
    finally:
        runner.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, AppLoadError | RedisUnavailableError):
        return text
    return f"{type(exc).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
