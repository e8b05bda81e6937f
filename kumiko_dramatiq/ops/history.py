"""Run history: one record per attempt of every job, kept in Redis, queried by the operator.

This module is the read side (:class:`JobRun`, the record format and the queries); the
write side (the end record of each attempt, handed to the settle call) is
:mod:`kumiko_dramatiq.middleware.history`.

Every attempt leaves one :class:`JobRun`, written on the calls that already happen: the
fetch of a lane queue puts each message it claims in the in-flight hash (``keys.inflight``:
its deliveries count, claim time and worker; ``lua/fetch_lane.lua``), where running runs are
read from, together with the message itself, so the fetch decodes nothing; the one Lua call
that settles a delivery writes the attempt's record (``lua/settle.lua``: completed, failed
with a retry following, or dead; a sequential hand-off is no attempt and writes none). No
round trip of its own. Boot gates, which run in-process, write theirs with one call per
attempt (:meth:`RunHistory.put`).

- **Identity**: ``origin_id`` is the id ``dispatch``/``handle_event``/the scheduler/boot
  returned or logged; it stays the same across retries (the same message id), sequential
  hand-offs and a per-tenant wrapper's children (``kumiko_origin_id`` on the message), so the
  id a caller got back finds every run that came of it.
- **Crashes**: a run cut short by its worker's death stays "running" until its message is
  delivered again (the new delivery supersedes it, and the attempt's record counts its
  ``deliveries``) or dead-lettered after ``max_deliveries`` deaths (``dead``, error type
  ``WorkerDied``, ``worker died during N deliveries``).
- **Lifetime**: completed and cancelled records live ``Retention.completed_age_s``; failed
  and dead ones ``Retention.failed_age_s``. ``history_cap`` (default 100,000) bounds their
  number: about one write in 32 also trims (old index entries, and the oldest records beyond
  the cap, completed first).
- **Size**: a record is a JSON object with short keys (:data:`FIELDS`), about 1 KB with its
  index entries (measured in ``benchmarks/``); payloads are kept only with
  ``JobRunner(record_payloads=True)``; tracebacks are cut to 8 KiB.
- **Keys** (``kumiko:{prefix}:``): ``run:{message id}`` (hash attempt -> record),
  ``runs:job:{job}:{status}``, ``runs:status:{status}``, ``runs:tenant:{tenant}``,
  ``runs:origin:{origin}`` (sorted sets of ``"{message id}:{attempt}"`` by the time of the
  record's last write), ``dead:{message id}`` (a dead letter's error, for ``kumiko dead``).
"""

from __future__ import annotations

import itertools
import json
import traceback as tb
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal

import redis
from dramatiq.message import Message

from kumiko_dramatiq.broker import keys
from kumiko_dramatiq.broker.delivery import RunWrite
from kumiko_dramatiq.broker.keys import queue_messages
from kumiko_dramatiq.broker.lua import LuaScripts
from kumiko_dramatiq.broker.replies import text
from kumiko_dramatiq.codec import KumikoOptions
from kumiko_dramatiq.options import LANES, lane_queue
from kumiko_dramatiq.registry import WRAPPER_SUFFIX
from kumiko_dramatiq.settings import Settings

RunStatus = Literal["running", "completed", "failed", "dead", "cancelled"]
STATUSES: Final[tuple[RunStatus, ...]] = ("running", "completed", "failed", "dead", "cancelled")

#: Record field -> JobRun attribute (short keys keep records small; Lua writes the same).
FIELDS: Final = {
    "j": "job_name",
    "m": "message_id",
    "o": "origin_id",
    "t": "tenant_id",
    "tr": "trigger",
    "a": "attempt",
    "ma": "max_attempts",
    "s": "status",
    "q": "enqueued_at",
    "st": "started_at",
    "en": "ended_at",
    "d": "duration_ms",
    "et": "error_type",
    "em": "error_message",
    "tb": "traceback",
    "w": "worker",
    "sa": "scheduled_at",
    "dk": "dedup_key",
    "n": "deliveries",
    "p": "payload",
}
#: Tracebacks are cut to this many bytes (the end, where the error is, is kept).
MAX_TRACEBACK_BYTES: Final = 8 * 1024
#: Error messages are cut to this many characters.
MAX_ERROR_CHARS: Final = 2_000


@dataclass(frozen=True)
class JobRun:
    """One attempt of one job, as the run history keeps it."""

    job_name: str
    message_id: str
    origin_id: str
    tenant_id: str | None
    trigger: str
    attempt: int
    max_attempts: int
    status: RunStatus
    enqueued_at: datetime | None
    started_at: datetime | None
    ended_at: datetime | None
    duration_ms: int | None
    error_type: str | None
    error_message: str | None
    traceback: str | None
    worker: str | None
    scheduled_at: datetime | None
    dedup_key: str | None
    #: deliveries of this attempt to a worker (more than 1 after a crash)
    deliveries: int | None = None
    #: the payload, only with ``JobRunner(record_payloads=True)``
    payload: dict[str, Any] | None = None

    @classmethod
    def decode(cls, raw: bytes | str) -> JobRun:
        data = json.loads(raw)
        values = {attribute: data.get(key) for key, attribute in FIELDS.items()}
        for name in ("enqueued_at", "started_at", "ended_at"):
            values[name] = _instant(values[name])
        scheduled = values["scheduled_at"]
        values["scheduled_at"] = None if scheduled is None else datetime.fromisoformat(scheduled)
        for name in ("attempt", "max_attempts"):
            values[name] = int(values[name])
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict with the contract's field names (datetimes as ISO-8601)."""
        out: dict[str, Any] = {}
        for attribute in FIELDS.values():
            value = getattr(self, attribute)
            out[attribute] = value.isoformat() if isinstance(value, datetime) else value
        return out


def _instant(ms: Any) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(int(ms) / 1000, UTC)


def format_traceback(exception: BaseException) -> str:
    """The traceback of ``exception``, cut to its last :data:`MAX_TRACEBACK_BYTES` bytes."""
    text = "".join(tb.format_exception(exception))
    data = text.encode()
    if len(data) <= MAX_TRACEBACK_BYTES:
        return text
    return "...\n" + data[-MAX_TRACEBACK_BYTES:].decode(errors="ignore")


def run_ttls_ms(settings: Settings) -> tuple[int, int]:
    """(TTL of completed/cancelled records, TTL of running/failed/dead records), in ms."""
    retention = settings.retention
    return retention.completed_age_s * 1000, retention.failed_age_s * 1000


def record_write(
    fields: dict[str, Any], status: RunStatus, settings: Settings, *, dead_note: str = ""
) -> RunWrite:
    """A :class:`RunWrite` of the record ``fields`` (short keys) with ``status``."""
    fields = {**fields, "s": status}
    return RunWrite(
        message_id=fields["m"],
        attempt=fields["a"],
        job=fields["j"],
        status=status,
        tenant=fields.get("t") or "",
        origin=fields.get("o") or fields["m"],
        record=json.dumps(
            {k: v for k, v in fields.items() if v is not None}, separators=(",", ":"), default=str
        ),
        dead_note=dead_note,
        started_ms=_order_ms(fields),
    )


def _order_ms(fields: dict[str, Any]) -> int | None:
    """A record's order score: its start, else its enqueue time (ms), else None."""
    for key in ("st", "q"):
        value = fields.get(key)
        if isinstance(value, int | float):
            return int(value)
    return None


def error_fields(exception: BaseException | None) -> dict[str, Any]:
    """The error type, message and traceback of a record (empty without an error)."""
    if exception is None:
        return {}
    return {
        "et": type(exception).__name__,
        "em": str(exception)[:MAX_ERROR_CHARS],
        "tb": format_traceback(exception),
    }


class RunHistory:
    """Queries over the run history of one dataset (``client`` on its Redis database)."""

    def __init__(self, client: redis.Redis, lua: LuaScripts, queue_prefix: str) -> None:
        self.client = client
        self.lua = lua
        self.prefix = queue_prefix
        self.root = keys.root(queue_prefix)
        self.inflight = keys.inflight(queue_prefix)
        self.queues = [lane_queue(queue_prefix, lane) for lane in LANES]

    def run_record(self, message_id: str) -> list[JobRun]:
        """Every recorded attempt of ``message_id``, oldest first (a running one included)."""
        raw = self.client.hgetall(keys.run_record(self.prefix, message_id))
        runs = {run.attempt: run for run in (JobRun.decode(value) for value in raw.values())}
        for run in self.running():
            if run.message_id == message_id:
                runs[run.attempt] = run
        return [runs[attempt] for attempt in sorted(runs)]

    def running(self) -> list[JobRun]:
        """The runs out with a worker now, read off the in-flight hash and their messages (a
        run whose worker died shows until its message is delivered again or dead-lettered)."""
        entries = {
            text(rid): text(entry) for rid, entry in self.client.hgetall(self.inflight).items()
        }
        if not entries:
            return []
        rids = list(entries)
        pipe = self.client.pipeline(transaction=False)
        for queue in self.queues:
            pipe.hmget(queue_messages(queue), rids)
        bodies: dict[str, Any] = {}
        for reply in pipe.execute():
            for rid, body in zip(rids, reply, strict=True):
                if body is not None:
                    bodies[rid] = body
        runs = []
        for rid, body in bodies.items():
            run = _running_run(body, entries[rid])
            if run is not None:
                runs.append(run)
        return runs

    def runs(
        self,
        job: str | None = None,
        *,
        status: RunStatus | None = None,
        tenant_id: str | None = None,
        message_id: str | None = None,
        origin_id: str | None = None,
        since: datetime | None = None,
        before: datetime | None = None,
        limit: int = 50,
    ) -> list[JobRun]:
        """Run records, newest first (by the time of their last write), filtered."""
        if message_id is not None:
            found = self.run_record(message_id)
            return _filtered(found, job, status, tenant_id, origin_id, since, before)[:limit]
        low = "-inf" if since is None else int(since.timestamp() * 1000)
        high = "+inf" if before is None else f"({int(before.timestamp() * 1000)}"
        if origin_id is not None:
            indexes = [keys.runs_by_origin(self.prefix, origin_id)]
        elif tenant_id is not None:
            indexes = [keys.runs_by_tenant(self.prefix, tenant_id)]
        elif job is not None:
            wanted = STATUSES if status is None else (status,)
            indexes = [keys.runs_by_job(self.prefix, job, s) for s in wanted]
        else:
            wanted = STATUSES if status is None else (status,)
            indexes = [keys.runs_by_status(self.prefix, s) for s in wanted]
        extra = self.run_record(origin_id) if origin_id is not None else []
        if status in (None, "running"):
            extra += self.running()
        picked = _filtered(extra, job, status, tenant_id, origin_id, since, before)
        scored = [(_last_write(run).timestamp() * 1000, run) for run in picked]
        # Read each index newest first, a page at a time; stop once `limit` records that pass
        # the filters are newer than anything still unread (records gone are skipped).
        offsets = dict.fromkeys(indexes, 0)
        floors: dict[str, float] = {}
        while offsets:
            pipe = self.client.pipeline(transaction=False)
            for index, offset in offsets.items():
                pipe.zrevrangebyscore(index, high, low, start=offset, num=limit, withscores=True)
            for index, reply in zip(list(offsets), pipe.execute(), strict=True):
                members = [(float(score), text(member)) for member, score in reply]
                loaded = self._load([member for _, member in members])
                for (score, _), run in zip(members, loaded, strict=True):
                    if run is not None and _filtered(
                        [run], job, status, tenant_id, None, since, before
                    ):
                        scored.append((score, run))
                if len(reply) < limit:
                    del offsets[index]
                    floors.pop(index, None)
                else:
                    offsets[index] += limit
                    floors[index] = members[-1][0]
            scored.sort(key=lambda item: item[0], reverse=True)
            unread_max = max(floors.values(), default=float("-inf"))
            if len([1 for score, _ in scored if score >= unread_max]) >= limit:
                break
        unique: dict[tuple[str, int], JobRun] = {}
        for _, run in sorted(scored, key=lambda item: item[0], reverse=True):
            unique.setdefault((run.message_id, run.attempt), run)
        return list(unique.values())[:limit]

    def counts(
        self, statuses: Sequence[RunStatus], edges_ms: Sequence[int]
    ) -> dict[str, list[int]]:
        """Per status, how many records were last written in each interval
        ``[edges_ms[i], edges_ms[i + 1])`` (epoch ms): one ``ZCOUNT`` per status and interval
        on ``runs:status:{status}``, all in one round trip, never a scan."""
        pipe = self.client.pipeline(transaction=False)
        for status in statuses:
            for low, high in itertools.pairwise(edges_ms):
                pipe.zcount(keys.runs_by_status(self.prefix, status), low, f"({high}")
        replies = iter(pipe.execute())
        intervals = max(0, len(edges_ms) - 1)
        return {status: [int(next(replies)) for _ in range(intervals)] for status in statuses}

    def _load(self, members: Sequence[str]) -> list[JobRun | None]:
        """The records of index members (``None`` for one that expired or was trimmed)."""
        if not members:
            return []
        pipe = self.client.pipeline(transaction=False)
        for member in members:
            message_id, _, attempt = member.rpartition(":")
            pipe.hget(keys.run_record(self.prefix, message_id), attempt)
        return [None if raw is None else JobRun.decode(raw) for raw in pipe.execute()]

    def put(self, run: RunWrite, at: datetime, settings: Settings) -> None:
        """Write one record outside a delivery (boot gates): one Lua call."""
        self.lua.run_put(
            keys=[keys.run_record(self.prefix, run.message_id)],
            args=[
                self.root,
                run.message_id,
                run.attempt,
                run.job,
                run.status,
                run.tenant,
                run.origin,
                int(at.timestamp() * 1000),
                run.record,
                *run_ttls_ms(settings),
                settings.history_cap,
                4,
                "" if run.started_ms is None else run.started_ms,
            ],
        )

    def dead_note(self, message_id: str) -> dict[str, Any] | None:
        """What kumiko noted when ``message_id`` was dead-lettered (error, attempt, ...)."""
        raw = self.client.get(keys.dead_note(self.prefix, message_id))
        return None if raw is None else dict(json.loads(raw))


def _running_run(body: Any, entry: str) -> JobRun | None:
    """The running run of an in-flight message (``None`` if it is not a kumiko message)."""
    try:
        message = Message.decode(body if isinstance(body, bytes) else str(body).encode())
        options = KumikoOptions.decode(message.options)
    except Exception:
        return None
    deliveries, _, rest = entry.partition("|")
    claimed, _, worker = rest.partition("|")
    job = str(message.actor_name).removesuffix(WRAPPER_SUFFIX)
    return JobRun(
        job_name=job,
        message_id=str(message.message_id),
        origin_id=options.origin_id or str(message.message_id),
        tenant_id=options.tenant_id,
        trigger=options.trigger,
        attempt=options.attempt,
        max_attempts=options.max_attempts,
        status="running",
        enqueued_at=_instant(message.message_timestamp),
        started_at=_instant(claimed or None),
        ended_at=None,
        duration_ms=None,
        error_type=None,
        error_message=None,
        traceback=None,
        worker=worker or None,
        scheduled_at=options.scheduled_at,
        dedup_key=options.dedup_key,
        deliveries=int(deliveries) if deliveries.isdigit() else None,
    )


def _last_write(run: JobRun) -> datetime:
    return run.ended_at or run.started_at or datetime.min.replace(tzinfo=UTC)


def _filtered(
    runs: Iterable[JobRun],
    job: str | None,
    status: str | None,
    tenant_id: str | None,
    origin_id: str | None,
    since: datetime | None,
    before: datetime | None,
) -> list[JobRun]:
    out = []
    for run in runs:
        when = _last_write(run)
        if (
            (job is None or run.job_name == job)
            and (status is None or run.status == status)
            and (tenant_id is None or run.tenant_id == tenant_id)
            and (origin_id is None or run.origin_id == origin_id)
            and (since is None or when >= since)
            and (before is None or when < before)
        ):
            out.append(run)
    return out
