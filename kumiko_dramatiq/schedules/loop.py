"""The schedulers' side of runtime schedules: :class:`ScheduleLoop`, a thread of
``kumiko-scheduler`` that fires the due ones.

Every :data:`POLL_S` it reads the due schedules (one ``ZRANGEBYSCORE``: an idle scheduler costs
Redis O(due), not O(schedules)) and fires each (``Schedules.fire``: one Lua call, exactly once
however many schedulers run). So a change reaches every scheduler within one poll, and a tick
is enqueued within one poll of its time. A Redis error is logged; the next poll goes on.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Final

import redis

from kumiko_dramatiq.schedules.store import Fired, Schedules

logger = logging.getLogger("kumiko_dramatiq.scheduler")

#: Seconds between two reads of the due schedules.
POLL_S: Final = 0.25
#: Due schedules read at once, fired in chunks of CHUNK (one Lua call each), and batches read
#: per poll at most.
BATCH: Final = 300
CHUNK: Final = 50
MAX_BATCHES: Final = 100


class ScheduleLoop:
    """Fires the due runtime schedules of ``schedules`` every :data:`POLL_S`."""

    def __init__(self, schedules: Schedules, identity: str, poll_s: float = POLL_S) -> None:
        self.schedules = schedules
        self.identity = identity
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unknown: set[str] = set()
        self._random = random.Random()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kumiko-schedules", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def poll(self) -> list[Fired]:
        """Fire what is due now, :data:`BATCH` at a time until none is left (at most
        :data:`MAX_BATCHES`), in chunks of :data:`CHUNK` (one Lua call each) taken in an
        order of their own, so that schedulers reading the same due ones mostly fire
        different chunks; what each came to."""
        client = self.schedules.broker.client
        fired: list[Fired] = []
        for _ in range(MAX_BATCHES):
            seconds, micros = client.time()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            due = [
                (schedule_id, due_ms)
                for schedule_id, due_ms in self.schedules.due(now_ms, BATCH)
                if schedule_id not in self._unknown
            ]
            if not due:
                break
            chunks = [due[at : at + CHUNK] for at in range(0, len(due), CHUNK)]
            self._random.shuffle(chunks)
            for chunk in chunks:
                specs = self.schedules.specs([schedule_id for schedule_id, _ in chunk])
                ticks = [
                    (schedule_id, due_ms, spec)
                    for (schedule_id, due_ms), spec in zip(chunk, specs, strict=True)
                ]
                for result in self.schedules.fire_many(ticks, now_ms, self.identity):
                    self._log(result)
                    fired.append(result)
            if len(due) < BATCH:
                break
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
