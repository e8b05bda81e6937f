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
  ``runs:origin:{origin}`` (sorted sets of run ids ``"{message id}:{attempt}"`` by the
  attempt's start, ms; each outlives the records written to it: it expires 2 minutes after
  the longest record age from its last TTL refresh, which a writer does at least once a
  minute while it writes to it),
  ``stats:{job}:{hour}`` (:mod:`kumiko_dramatiq.ops.stats`), ``dead:{message id}`` (a
  dead letter's error, for ``kumiko dead``), ``progress:{message id}:{attempt}`` (a running
  attempt's latest ``ctx.progress``, written by its worker, :mod:`kumiko_dramatiq.worker.progress`;
  :meth:`RunHistory.running` reads them in one ``MGET``).
"""

from __future__ import annotations

import itertools
import json
import traceback as tb
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
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
    #: unique per record: ``"<message id>:<attempt>"``; the tie-breaker of the run order
    run_id: str = ""
    #: a running attempt's latest ``ctx.progress`` value (0.0-1.0), else ``None``
    progress: float | None = None
    #: a running attempt's latest ``ctx.progress`` note, else ``None``
    progress_note: str | None = None

    def __post_init__(self) -> None:
        if not self.run_id:
            object.__setattr__(self, "run_id", f"{self.message_id}:{self.attempt}")

    @property
    def order_ms(self) -> int:
        """Where the record sits in the run order: its attempt's start (its enqueue time if
        it never started), in ms; ties go by :attr:`run_id`."""
        when = self.started_at or self.enqueued_at
        return 0 if when is None else round(when.timestamp() * 1000)

    @property
    def order_key(self) -> tuple[int, str]:
        """(``order_ms``, ``run_id``): newest first is this key, highest first."""
        return self.order_ms, self.run_id

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
        for attribute in (*FIELDS.values(), "run_id", "progress", "progress_note"):
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
        """Every recorded attempt of ``message_id``, oldest first (a running one included).
        The runs in flight are read first, the records after: an attempt that ends in between
        (its settle takes its in-flight entry and writes its record in one step) is found by
        one read or the other, never by neither, and its record wins."""
        runs = {run.attempt: run for run in self.running() if run.message_id == message_id}
        raw = self.client.hgetall(keys.run_record(self.prefix, message_id))
        for run in (JobRun.decode(value) for value in raw.values()):
            runs[run.attempt] = run
        return [runs[attempt] for attempt in sorted(runs)]

    def find(self, run_id: str) -> JobRun | None:
        """The record ``run_id`` (``"<message id>:<attempt>"``), running or ended; ``None``
        if there is none."""
        message_id, _, attempt = run_id.rpartition(":")
        for run in self.run_record(message_id):
            if str(run.attempt) == attempt:
                return run
        return None

    def running(self) -> list[JobRun]:
        """The runs out with a worker now, read off the in-flight hash and their messages (a
        run whose worker died shows until its message is delivered again or dead-lettered). A
        message a worker holds ahead of its threads is not running: it shows once its worker
        reported its start (``lua/include/inflight.lua``). Each run carries its latest
        ``ctx.progress`` (:func:`with_progress`: one more command)."""
        entries = {
            text(rid): text(entry)
            for rid, entry in self.client.hgetall(self.inflight).items()
            if not is_held_entry(entry)
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
        return with_progress(self.client, self.prefix, runs)

    def runs(
        self,
        job: str | None = None,
        *,
        status: RunStatus | None = None,
        tenant_id: str | None = None,
        message_id: str | None = None,
        origin_id: str | None = None,
        since: datetime | None = None,
        before: datetime | JobRun | None = None,
        limit: int = 50,
    ) -> list[JobRun]:
        """Run records, newest first: by the attempt's start (its enqueue time if it never
        started), ties by ``run_id``; filtered. ``before``: a time (records that started
        before it), or the last :class:`JobRun` of the previous page (the page starts right
        after it in that order, so walking pages yields every record exactly once). Each
        index is read from the cursor's rank on (``lua/runs_from.lua``, O(log n)), a page at
        a time, until ``limit`` records that pass the filters are found in it."""
        cursor = _cursor(before)
        if message_id is not None:
            attempts = sorted(self.run_record(message_id), key=_key, reverse=True)
            return _filtered(attempts, job, status, tenant_id, origin_id, since, cursor)[:limit]
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
        found = {run.run_id: run for run in extra}
        floor = None if since is None else round(since.timestamp() * 1000)
        score, member = ("+inf", "") if cursor is None else (str(cursor[0]), cursor[1])
        starts = [int(rank) for rank in self.lua.runs_from(keys=indexes, args=[score, member])]
        for index, start in zip(indexes, starts, strict=True):
            self._read_index(index, start, floor, limit, found, job, status, tenant_id)
        picked = _filtered(found.values(), job, status, tenant_id, origin_id, since, cursor)
        return sorted(picked, key=_key, reverse=True)[:limit]

    def _read_index(
        self,
        index: str,
        start: int,
        floor: int | None,
        limit: int,
        found: dict[str, JobRun],
        job: str | None,
        status: str | None,
        tenant_id: str | None,
    ) -> None:
        """Read ``index`` from rank ``start`` on, a page at a time, into ``found`` until
        ``limit`` records passing the filters were read, the index ends or its scores fall
        below ``floor`` (records gone are skipped)."""
        passing = 0
        while passing < limit:
            reply: list[Any] = self.client.zrevrange(
                index, start, start + limit - 1, withscores=True
            )
            start += limit
            members = [text(member) for member, score in reply if floor is None or score >= floor]
            for run in self._load(members):
                if run is not None and _filtered([run], job, status, tenant_id, None, None, None):
                    # a record read after the runs in flight is newer than a running entry of
                    # the same attempt (the attempt ended in between)
                    seen = found.get(run.run_id)
                    if seen is None or seen.status == "running":
                        found[run.run_id] = run
                    passing += 1
            if len(members) < len(reply) or len(reply) < limit:
                return

    def counts(
        self, statuses: Sequence[RunStatus], edges_ms: Sequence[int]
    ) -> dict[str, list[int]]:
        """Per status, how many records' attempts started in each interval
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


def with_progress(client: redis.Redis, queue_prefix: str, runs: list[JobRun]) -> list[JobRun]:
    """``runs`` (running ones) with their latest ``ctx.progress``: one ``MGET`` of their
    progress keys (:mod:`kumiko_dramatiq.worker.progress`), none without runs. A key written
    by another worker than the one running the attempt now (left by a worker that died) is
    not shown."""
    if not runs:
        return runs
    found = client.mget([keys.progress(queue_prefix, run.message_id, run.attempt) for run in runs])
    return [_progressed(run, raw) for run, raw in zip(runs, found, strict=True)]


def _progressed(run: JobRun, raw: Any) -> JobRun:
    if raw is None:
        return run
    try:
        data = json.loads(raw)
        value, note, worker = data.get("v"), data.get("n"), data.get("w")
    except (ValueError, AttributeError):
        return run
    if worker != run.worker:
        return run
    return replace(
        run,
        progress=float(value) if isinstance(value, int | float) else None,
        progress_note=note if isinstance(note, str) else None,
    )


def is_held_entry(entry: bytes | str) -> bool:
    """Whether an in-flight entry is a held message's (claimed ahead, not started)."""
    return (entry[:1] == b"h") if isinstance(entry, bytes) else entry.startswith("h")


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


def _key(run: JobRun) -> tuple[int, str]:
    return run.order_key


def _cursor(before: datetime | JobRun | None) -> tuple[int, str] | None:
    """``before`` as a point in the run order: (ms, run id); a time is (its ms, ""), before
    every run id at that ms."""
    if before is None:
        return None
    if isinstance(before, JobRun):
        return before.order_key
    return round(before.timestamp() * 1000), ""


def _filtered(
    runs: Iterable[JobRun],
    job: str | None,
    status: str | None,
    tenant_id: str | None,
    origin_id: str | None,
    since: datetime | None,
    cursor: tuple[int, str] | None,
) -> list[JobRun]:
    floor = None if since is None else round(since.timestamp() * 1000)
    out = []
    for run in runs:
        key = run.order_key
        if (
            (job is None or run.job_name == job)
            and (status is None or run.status == status)
            and (tenant_id is None or run.tenant_id == tenant_id)
            and (origin_id is None or run.origin_id == origin_id)
            and (floor is None or key[0] >= floor)
            and (cursor is None or key < cursor)
        ):
            out.append(run)
    return out
