"""What guards runs: sequential locks and cap slots, live dedup keys, boot markers.

Locks and live dedup keys are read off the indexes their Lua scripts keep (``locks``:
``keys.locks_index``; ``dedup_page``: ``keys.dedup_index``), a cap's slots off its sorted
set, boot markers with one ``MGET``: each read costs its page, never the size of the
keyspace.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.keys import queue_messages
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.codec import ORIGIN_ID, TENANT_ID
from kumiko_dramatiq.middleware.presence import live_processes
from kumiko_dramatiq.ops.admin_base import AdminBase
from kumiko_dramatiq.registry import JobDefinition


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


#: A position in the live dedup keys: (job, the record's expiry in epoch ms, how many keys of
#: that job with that very expiry were listed already). Keys are listed by job, then newest
#: expiry first.
DedupCursor = tuple[str, float, int]


class GuardsAdmin(AdminBase):
    """What guards runs: sequential locks and cap slots, live dedup keys, boot markers."""

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
