"""Finding messages: by id, by id prefix, and pages of those waiting and running.

A message is found by the few redis ids kumiko derives from its id
(:meth:`LookupAdmin.redis_id_candidates`, used by ``cancel``, ``waiting_state`` and
``retry_dead``), never by a search of a queue; an id prefix is looked up among the newest
run records (:meth:`LookupAdmin.ids_starting_with`).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from dramatiq.common import dq_name

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.enqueueing import moved_redis_id
from kumiko_dramatiq.broker.keys import consumer_acks, heartbeats, queue_messages
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.codec import ORIGIN_ID, TRIGGER
from kumiko_dramatiq.ids import redis_id_candidates
from kumiko_dramatiq.ops.admin_base import AdminBase
from kumiko_dramatiq.ops.history import STATUSES, JobRun
from kumiko_dramatiq.ops.waiting import QueuedMessage, Waiting

#: How many of the newest run records of each status, and of the newest dead letters of each
#: lane, an id prefix is looked up among (:meth:`Admin.ids_starting_with`).
PREFIX_WINDOW = 1_000


class LookupAdmin(AdminBase):
    """Finding messages: by id, by id prefix, waiting, running."""

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

    def waiting_state(self, message_id: str) -> str | None:
        """Where ``message_id`` (or a sequential hand-off carrying it on) is now, read the way
        :meth:`cancel` looks for it but changing nothing: ``"queued"`` (waiting in a lane
        queue, its suspects or a paused job's parked list), ``"delayed"`` (on a delay queue),
        ``"running"`` (claimed by a worker), or ``None`` (none of these: it ended, or never
        was). Two round trips, whatever the size of the queues."""
        found = self._waiting(message_id)
        return None if found is None else found[0]

    def _waiting(self, message_id: str) -> tuple[str, Any] | None:
        """:meth:`waiting_state`'s answer with the body it found."""
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
        pipe.zrange(heartbeats(self.broker.namespace), 0, -1)
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
                return None if marker is not None else ("delayed", body)
            return ("running" if any(claims) else "queued"), body
        return None

    def job_state(self, message_id: str) -> str:
        """Where ``message_id`` is in its life (``runner.job_state``): ``"queued"``,
        ``"parked"`` (queued while its job is paused), ``"delayed"`` (also backing off before a
        retry), ``"running"``, ``"completed"``, ``"dead"``, ``"cancelled"`` or ``"unknown"``
        (never seen, or its records expired). A sequential hand-off carrying it on counts as
        it. A few round trips, whatever the size of the queues."""
        found = self._waiting(message_id)
        if found is not None:
            state, body = found
            if state == "queued" and self.client.sismember(keys.paused(self.prefix), _job_of(body)):
                return "parked"
            return state
        records = [
            json.loads(raw) for raw in self.client.hvals(keys.run_record(self.prefix, message_id))
        ]
        if not records:
            carried = [
                run
                for run in self.history.runs(origin_id=message_id, limit=1)
                if run.message_id != message_id
            ]
            if carried:  # a hand-off carried it on under an id of its own
                records = [{"a": carried[0].attempt, "s": carried[0].status}]
        if not records:
            dead = self.client.exists(keys.dead_note(self.prefix, message_id))
            return "dead" if dead else "unknown"
        status = str(max(records, key=lambda r: int(r.get("a", 0))).get("s"))
        if status == "failed":  # its retry is on its way (it was just moved or enqueued)
            return "delayed"
        return status if status in ("completed", "dead", "cancelled", "running") else "unknown"

    def known(self, message_id: str) -> bool:
        """Whether ``message_id`` waits, runs, or left a run record or dead letter note."""
        return self.waiting_state(message_id) is not None or bool(
            self.client.exists(
                keys.run_record(self.prefix, message_id), keys.dead_note(self.prefix, message_id)
            )
        )

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


def _job_of(body: Any) -> str:
    """The job an encoded message runs (a per-tenant wrapper's is its job's), or ``""``."""
    try:
        actor = str(json.loads(body)["actor_name"])
    except (ValueError, KeyError, TypeError):
        return ""
    return actor.removesuffix(":fanout")


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
