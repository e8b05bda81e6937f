"""Browsing waiting work: :class:`QueuedMessage` and :class:`Waiting` (``runner.queued``).

A page of waiting messages is read a batch at a time from where they wait, never by a walk of
the whole queue:

- **queued**: first the messages waiting for a cap (``max_running``, ``rate_limit``: taken
  off the queue already, they start first), from the lists of the lane's waiting groups
  (``keys.cap_waiting``, by rank; each ``keys.cap_wait`` list oldest first); then a lane
  queue's list, oldest first (from its head), skipping ids whose message was cancelled or
  purged (no body) and ids claimed by a worker (running); then the messages with a priority
  or a fair key (``keys.queue_order``): by level, each level's keys in turn order, each
  key's list oldest first;
- **parked**: a paused job's parked list (``keys.parked``), oldest first;
- **delayed**: the lane's schedule of delayed messages (``keys.queue_schedule``, a sorted set
  by due time), soonest due first, their bodies from the delay queue's hash. A message an older
  version left on Dramatiq's own delay queue list is listed once it is scheduled.

Each call reads at most ``max_read`` entries per place; a job's messages rare among many
others may take several pages, some of them short. The position after the last message of a
page travels on it (``QueuedMessage.cursor``), so ``after=`` resumes right there. Messages
taken off the head of a list meanwhile (fetched) shift the positions: a page may then skip
as many messages as were fetched since the previous one (browsing, not an inventory; counts
are :meth:`~kumiko_dramatiq.ops.admin.Admin.job_counts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import redis
from dramatiq.common import dq_name
from dramatiq.message import Message

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.codec import KumikoOptions, OptionsError
from kumiko_dramatiq.registry import Registry

#: The states ``queued`` lists, in the order ``state=None`` walks them.
WAITING_STATES = ("queued", "parked", "delayed")
#: Entries read per batch.
BATCH = 200


@dataclass(frozen=True)
class QueuedMessage:
    """A message waiting to run: ``state`` is ``"queued"``, ``"parked"`` (held by a pause) or
    ``"delayed"`` (``due_at`` set); ``attempt`` is the attempt it will run as; ``payload``
    its payload (shown only where asked for: ``kumiko queued --payload``, a signed-in
    dashboard). ``cursor`` is where the next page starts (pass the message as ``after``)."""

    message_id: str
    job_name: str
    tenant_id: str | None
    state: str
    attempt: int
    enqueued_at: datetime
    due_at: datetime | None
    payload: Any
    cursor: str = field(default="", repr=False, compare=False)
    #: its priority (0 runs first) and the key it takes its turn under (its fair key, a
    #: per-tenant child's tenant; ``None``: none)
    priority: int = 0
    fair_key: str | None = None

    def to_json(self, *, payload: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "message_id": self.message_id,
            "job_name": self.job_name,
            "tenant_id": self.tenant_id,
            "state": self.state,
            "attempt": self.attempt,
            "enqueued_at": self.enqueued_at.isoformat(),
            "due_at": None if self.due_at is None else self.due_at.isoformat(),
            "priority": self.priority,
            "fair_key": self.fair_key,
        }
        if payload:
            out["payload"] = self.payload
        return out


class Waiting:
    """Pages of waiting messages of one dataset (see the module docstring)."""

    def __init__(
        self, client: redis.Redis, registry: Registry, queue_prefix: str, lane_queues: list[str]
    ) -> None:
        self.client = client
        self.registry = registry
        self.prefix = queue_prefix
        self.lane_queues = lane_queues

    def page(
        self,
        job: str | None,
        state: str | None,
        *,
        limit: int,
        after: QueuedMessage | None,
        max_read: int = 5_000,
    ) -> list[QueuedMessage]:
        places = self._places(job, state)
        start = 0
        if after is not None and after.cursor:
            place, _, _ = after.cursor.rpartition("|")
            start = next((n for n, each in enumerate(places) if each == place), len(places))
        found: list[QueuedMessage] = []
        for n in range(start, len(places)):
            place = places[n]
            position = after.cursor.rpartition("|")[2] if n == start and after else "0"
            found += self._read(place, position, job, limit - len(found), max_read)
            if len(found) >= limit:
                break
        return found[:limit]

    def _places(self, job: str | None, state: str | None) -> list[str]:
        """Where to read, in order: ``"<state>|<queue or job>"``."""
        states = WAITING_STATES if state is None else (state,)
        queues = self.lane_queues
        jobs = list(self.registry.jobs)
        if job is not None:
            queues = [self.registry.jobs[job].queue_name(self.prefix)]
            jobs = [job]
        places = []
        for each in states:
            if each == "queued":
                places += [f"capwait|{queue}" for queue in queues]
            if each == "parked":
                places += [f"parked|{name}" for name in jobs]
            else:
                places += [f"{each}|{queue}" for queue in queues]
            if each == "queued":
                places += [f"order|{queue}" for queue in queues]
        return places

    def _read(
        self, place: str, position: str, job: str | None, limit: int, max_read: int
    ) -> list[QueuedMessage]:
        state, _, where = place.partition("|")
        if state == "capwait":
            return self._read_capwait(place, where, position, job, limit, max_read)
        if state == "delayed":
            return self._read_delayed(place, where, position, job, limit, max_read)
        if state == "order":
            return self._read_order(place, where, position, job, limit, max_read)
        if state == "parked":
            source = keys.parked(self.prefix, where)
            queue = self.registry.jobs[where].queue_name(self.prefix)
        else:
            source = keys.queue_list(where)
            queue = where
        offset = int(position) if position.isdigit() else 0
        found: list[QueuedMessage] = []
        read = 0
        while len(found) < limit and read < max_read:
            rids = [text(r) for r in self.client.lrange(source, offset, offset + BATCH - 1)]
            if not rids:
                break
            found += self._unclaimed(
                queue, rids, state, job, f"{place}|", offset, limit - len(found)
            )
            read += len(rids)
            offset += len(rids)
        return found

    def _unclaimed(
        self,
        queue: str,
        rids: list[str],
        state: str,
        job: str | None,
        cursor: str,
        offset: int,
        limit: int,
    ) -> list[QueuedMessage]:
        """The messages of ``rids`` (listed on ``queue`` from ``offset`` on) that wait: with a
        body and no claim by a worker (running), at most ``limit``; each one's cursor is
        ``cursor`` and its position after it."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(keys.queue_messages(queue), rids)
        pipe.hmget(keys.inflight(self.prefix), rids)
        bodies, claims = pipe.execute()
        found: list[QueuedMessage] = []
        for n, (body, claim) in enumerate(zip(bodies, claims, strict=True)):
            if body is None or claim is not None:
                continue
            message = self._message(body, state, job, f"{cursor}{offset + n + 1}")
            if message is not None:
                found.append(message)
                if len(found) >= limit:
                    break
        return found

    def _read_capwait(
        self, place: str, queue: str, position: str, job: str | None, limit: int, max_read: int
    ) -> list[QueuedMessage]:
        """Off the lists of the queue's groups waiting for a cap (``keys.cap_waiting``, a group
        at a time by rank; ``job``'s groups only, when given): position ``"<rank>.<offset>"``."""
        rank_text, _, offset_text = position.partition(".")
        rank = int(rank_text) if rank_text.isdigit() else 0
        offset = int(offset_text) if offset_text.isdigit() else 0
        waiting = keys.cap_waiting(self.prefix, queue)
        found: list[QueuedMessage] = []
        read = 0
        while len(found) < limit and read < max_read:
            groups = [text(g) for g in self.client.zrange(waiting, rank, rank + BATCH - 1)]
            if not groups:
                break
            read += len(groups)
            for group in groups:
                if job is None or keys.cap_group_job(group) == job:
                    while len(found) < limit and read < max_read:
                        rids = [
                            text(r)
                            for r in self.client.lrange(
                                keys.cap_wait(self.prefix, group), offset, offset + BATCH - 1
                            )
                        ]
                        if not rids:
                            break
                        bodies = self.client.hmget(keys.queue_messages(queue), rids)
                        for n, body in enumerate(bodies):
                            if body is None:
                                continue
                            cursor = f"{place}|{rank}.{offset + n + 1}"
                            message = self._message(body, "queued", job, cursor)
                            if message is not None:
                                found.append(message)
                                if len(found) >= limit:
                                    return found
                        read += len(rids)
                        offset += len(rids)
                    if len(found) >= limit or read >= max_read:
                        return found
                rank, offset = rank + 1, 0
        return found

    def _read_order(
        self, place: str, queue: str, position: str, job: str | None, limit: int, max_read: int
    ) -> list[QueuedMessage]:
        """Off the lists of the queue's order (``keys.queue_order``): by level, each level's
        ring of keys in turn, each key's list oldest first; position
        ``"<level>.<rank in ring>.<offset>"``."""
        parts = [int(p) if p.isdigit() else 0 for p in [*position.split("."), "0", "0"][:3]]
        start_level, rank, offset = parts
        found: list[QueuedMessage] = []
        read = 0
        levels = [int(text(level)) for level in self.client.zrange(keys.queue_order(queue), 0, -1)]
        for level in (each for each in levels if each >= start_level):
            if level != start_level:
                rank, offset = 0, 0
            ring = [text(k) for k in self.client.lrange(keys.queue_ring(queue, level), 0, -1)]
            while rank < len(ring) and len(found) < limit and read < max_read:
                source = (
                    keys.queue_list(queue)
                    if level == 0 and ring[rank] == ""
                    else keys.queue_at(queue, level, ring[rank])
                )
                rids = [text(r) for r in self.client.lrange(source, offset, offset + BATCH - 1)]
                if not rids or source == keys.queue_list(queue):
                    rank, offset = rank + 1, 0  # the queue's own list is read on its own
                    continue
                found += self._unclaimed(
                    queue,
                    rids,
                    "queued",
                    job,
                    f"{place}|{level}.{rank}.",
                    offset,
                    limit - len(found),
                )
                if len(found) >= limit:
                    return found
                read += len(rids)
                offset += len(rids)
            if len(found) >= limit or read >= max_read:
                break
        return found

    def _read_delayed(
        self, place: str, queue: str, position: str, job: str | None, limit: int, max_read: int
    ) -> list[QueuedMessage]:
        """Off the queue's schedule (``keys.queue_schedule``), soonest due first, by rank."""
        offset = int(position) if position.isdigit() else 0
        schedule = keys.queue_schedule(queue)
        found: list[QueuedMessage] = []
        read = 0
        while len(found) < limit and read < max_read:
            entries: list[tuple[Any, float]] = self.client.zrange(  # type: ignore[assignment]
                schedule, offset, offset + BATCH - 1, withscores=True
            )
            if not entries:
                break
            rids = [text(rid) for rid, _ in entries]
            bodies = self.client.hmget(keys.queue_messages(dq_name(queue)), rids)
            for n, ((_, score), body) in enumerate(zip(entries, bodies, strict=True)):
                if body is None:
                    continue
                message = self._message(body, "delayed", job, f"{place}|{offset + n + 1}")
                if message is not None:
                    found.append(replace(message, due_at=_instant(score)))
                    if len(found) >= limit:
                        return found
            read += len(rids)
            offset += len(rids)
        return found

    def _message(self, body: Any, state: str, job: str | None, cursor: str) -> QueuedMessage | None:
        try:
            message = Message.decode(body if isinstance(body, bytes) else str(body).encode())
            options = KumikoOptions.decode(message.options)
        except (OptionsError, Exception):
            return None
        found = self.registry.actor(str(message.actor_name))
        if found is None:
            return None
        name = found[0].qualified_name
        if job is not None and name != job:
            return None
        return QueuedMessage(
            message_id=str(message.message_id),
            job_name=name,
            tenant_id=options.tenant_id,
            state=state,
            attempt=options.attempt,
            enqueued_at=_instant(message.message_timestamp),
            due_at=None,  # a delayed one's is its score on the schedule
            payload=message.args[0] if message.args else None,
            cursor=cursor,
            priority=options.priority,
            fair_key=options.route_key,
        )


def _instant(ms: Any) -> datetime:
    return datetime.fromtimestamp(int(ms) / 1000, UTC)
