"""Acting on messages and jobs: cancel, stop a run, run a delayed message now, pause, resume.

Every action that changes more than one key is one Lua call, so it is all-or-nothing
(``resume`` one call per :data:`RESUME_STEP` parked messages):

- **cancel** (``lua/cancel.lua``): a queued, delayed, backing-off, parked or waiting message
  never starts; a running one is not interrupted, nor one that ended;
- **stop_run** (``keys.stop_request``): the worker running the attempt reads the request;
- **run_now** (``lua/move_now.lua``): a delayed message is queued now;
- **pause** (``keys.paused``): a paused job's messages are parked when a fetch meets them;
  **resume** (``lua/resume.lua``) puts them back at the head of their queue, its cron ticks
  following the job's misfire policy.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from dramatiq.common import dq_name

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.enqueueing import moved_redis_id
from kumiko_dramatiq.broker.holds import new_request_id
from kumiko_dramatiq.broker.keys import queue_list, queue_messages
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.codec import TRIGGER, KumikoOptions, OptionsError
from kumiko_dramatiq.cron import Cron
from kumiko_dramatiq.ops.asking import Ask, Asking
from kumiko_dramatiq.ops.history import run_ttls_ms
from kumiko_dramatiq.ops.lookup import LookupAdmin
from kumiko_dramatiq.registry import JobDefinition

logger = logging.getLogger("kumiko_dramatiq")


#: Parked ids resume moves back to their queue per Lua call (about a millisecond of Redis).
RESUME_STEP = 1_000
#: How many times ``cancel`` looks again for a message its holder no longer had (settled, or
#: back on its queue) before it says it runs.
CANCEL_ROUNDS = 3


class ControlAdmin(LookupAdmin):
    """Acting on messages and jobs: cancel, stop, run now, pause, resume."""

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
