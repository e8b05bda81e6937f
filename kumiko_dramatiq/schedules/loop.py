"""The schedulers' side of runtime schedules: :class:`ScheduleLoop`, a thread of
``kumiko-scheduler`` that fires the due ones.

Every :data:`POLL_S` it reads the due schedules (one ``ZRANGEBYSCORE``: an idle scheduler costs
Redis O(due), not O(schedules)) and fires each (``Schedules.fire``: one Lua call, exactly once
however many schedulers run). So a change reaches every scheduler within one poll, and a tick
is enqueued within one poll of its time. A Redis error is logged; the next poll goes on.
"""

from __future__ import annotations

import logging
import threading
from typing import Final

import redis

from kumiko_dramatiq.schedules.store import Fired, Schedules

logger = logging.getLogger("kumiko_dramatiq.scheduler")

#: Seconds between two reads of the due schedules.
POLL_S: Final = 0.25


class ScheduleLoop:
    """Fires the due runtime schedules of ``schedules`` every :data:`POLL_S`."""

    def __init__(self, schedules: Schedules, identity: str, poll_s: float = POLL_S) -> None:
        self.schedules = schedules
        self.identity = identity
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unknown: set[str] = set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kumiko-schedules", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def poll(self) -> list[Fired]:
        """Fire what is due now (one pass); what each came to."""
        client = self.schedules.broker.client
        seconds, micros = client.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        fired = []
        for schedule_id, due_ms in self.schedules.due(now_ms):
            if schedule_id in self._unknown:
                continue
            result = self.schedules.fire(schedule_id, due_ms, now_ms, self.identity)
            self._log(result)
            fired.append(result)
        return fired

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except redis.RedisError as exc:
                logger.error("kumiko scheduler: runtime schedules not read: %s", exc)
            except Exception:
                logger.exception("kumiko scheduler: runtime schedules")

    def _log(self, fired: Fired) -> None:
        tick = "" if fired.tick is None else fired.tick.isoformat()
        if fired.outcome == "enqueued":
            logger.info(
                "schedule tick enqueued: schedule=%s tick=%s message_id=%s",
                fired.schedule_id,
                tick,
                fired.message_id,
            )
        elif fired.outcome == "skipped":
            logger.warning(
                "schedule tick skipped: schedule=%s tick=%s (overlap=skip: its last run is "
                "queued or running)",
                fired.schedule_id,
                tick,
            )
        elif fired.outcome == "missed":
            logger.warning(
                "schedule %s: ticks missed while no scheduler ran, skipped (older than the grace)",
                fired.schedule_id,
            )
        elif fired.outcome == "unknown":
            self._unknown.add(fired.schedule_id)
            logger.error(
                "schedule %s: its job is not declared in this scheduler's app; left to "
                "another scheduler",
                fired.schedule_id,
            )
